"""Padded sizes: the power-of-two buckets that bound how many shapes jit compiles (token counts,
sequence and cache lengths, plan segments, block-table widths)."""


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= n and >= `minimum` (itself a power of two)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))
