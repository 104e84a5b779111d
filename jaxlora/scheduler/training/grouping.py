"""Adapter grouping by mean sample length with head-tail pairing (LoRAFusion §4.2.3).

Groups run in a fixed order inside every global batch, so between two global batches of one
adapter lie the microbatches of the other groups: that spacing is what lets the bubble lemma
hold without no-ops. Inside a group, pairing the longest-sample adapter with the
shortest-sample one balances the tokens each group brings to its microbatches.
"""

from __future__ import annotations

from collections.abc import Mapping


def head_tail_order(mean_lengths: Mapping[int, float]) -> list[int]:
    """Adapters alternately taken from the long end and the short end of the sorted list."""
    ordered = sorted(mean_lengths, key=lambda a: (-mean_lengths[a], a))
    head, tail, picked = 0, len(ordered) - 1, []
    while head <= tail:
        picked.append(ordered[head])
        head += 1
        if head <= tail:
            picked.append(ordered[tail])
            tail -= 1
    return picked


def group_adapters(
    mean_lengths: Mapping[int, float], group_size: int = 2
) -> tuple[tuple[int, ...], ...]:
    """Groups of `group_size` adapters, long paired with short; the last group may be smaller.

    With 4 adapters sorted long to short as [a, b, c, d] and group_size 2 the groups are
    (a, d) and (b, c).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    order = head_tail_order(mean_lengths)
    return tuple(tuple(order[i : i + group_size]) for i in range(0, len(order), group_size))
