"""A serving request as the engine keeps it (`Request`), the checks a new one passes, what its callback
receives besides tokens, and what an engine hands another when it gives a request up (`Handoff`).

Classification (`Engine.classify`, V-LoRA's task heads): a prompt classified by an adapter's task
head (`jaxlora.lora.head`, read from the adapter's folder on first use: `Engine.task_head`) is a
one-token greedy sequence in the same steps as every other request; the forward also returns each
row's features (the final norm's output), read back only for a step where a classification's
prompt ends, and its callback gets one Event with the head's `probs` (finish reason "classified",
`classified`) instead of a token.

Prompt log-probabilities (`SamplingParams.prompt_logprobs`): a step whose rows score their prompt
returns each token's log-probability of the next prompt token and the top K; `collect_scores`
appends them to the request once per prompt position (a recomputed chunk adds nothing), and its
first event carries them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import numpy as np

from jaxlora.lora.head import TaskHead
from jaxlora.sampling import SamplingParams
from jaxlora.scheduler.serving import Sequence, StepPlan

from serve.engine_config import Event, RequestError


@dataclasses.dataclass
class Request:
    seq: Sequence  # its `sampling` holds the request's SamplingParams
    callback: Callable[[Event], None]
    submitted: float
    head: TaskHead | None = None  # a classification (`Engine.classify`): the head its features go through
    prompt_entries: list = dataclasses.field(default_factory=list)  # prompt log-probabilities so far
    scored_to: int = 1  # the next prompt position whose log-probability is due (recomputed chunks skip)
    images: object = None  # its images (`serve.vision.ImageInput`), None: text only
    image_embeds: object = None  # their rows [n * P, d] (device array) from the tower until its prefill is done


class Handoff(NamedTuple):
    """A request an engine gives up (preempted for want of KV pages, or `migrate`d) for another to
    continue: `submit(request_id, prompt, adapter, sampling, callback, output=output)`; output:
    the tokens already delivered to the callback."""

    request_id: object
    prompt: list[int]
    output: list[int]
    adapter: str | None
    sampling: SamplingParams
    callback: Callable[[Event], None]


def check_request(sampling: SamplingParams, output, head: TaskHead | None, vocab: int, merged: bool) -> None:
    """RequestError unless a request's sampling, resumed `output` tokens and `head` go together on an
    engine over `vocab` tokens (`merged`: it runs an inference mode other than "unmerged")."""
    if head is not None and (sampling.max_new_tokens != 1 or output):
        raise RequestError("a classification (head) is one prefill-only sequence: max_new_tokens 1, no output")
    if sampling.prompt_logprobs is not None and (merged or output):
        raise RequestError("prompt log-probabilities are computed in the unmerged inference mode, for a request "
                           "without resumed output")
    if any(not 0 <= t < vocab for t in [t for t, _ in sampling.logit_bias] + list(sampling.stop_token_ids)):
        raise RequestError(f"logit_bias and stop_token_ids take token ids in [0, {vocab})")
    if len(output) >= sampling.max_new_tokens or any(not 0 <= t < vocab for t in output):
        raise RequestError(f"a resumed request has fewer than max_tokens ({sampling.max_new_tokens}) output "
                           f"tokens, each in [0, {vocab})")


def prompt_k(seq: Sequence) -> int | None:
    """The request's SamplingParams.prompt_logprobs (None: none asked, or no SamplingParams)."""
    return getattr(seq.sampling, "prompt_logprobs", None)


def collect_scores(plan: StepPlan, scores: tuple, requests: dict) -> None:
    """Appends a scoring step's prompt log-probabilities to its rows' requests (`requests`: by
    sequence id; once per prompt position: a recomputed chunk adds nothing): (target log-prob [T],
    top values [T, K], ids [T, K])."""
    chosen, values, ids = scores
    offset = 0
    for row in plan.rows:
        request = requests.get(row.seq.seq_id)
        k = prompt_k(row.seq)
        if request is not None and k is not None and request.scored_to >= 0:
            prompt = row.seq.prompt
            for t in range(offset, offset + row.count):
                target = row.start + (t - offset) + 1
                if target == request.scored_to and target < len(prompt):
                    top = [(int(i), float(v)) for i, v in zip(ids[t, :k], values[t, :k])]
                    request.prompt_entries.append((prompt[target], float(chosen[t]), top))
                    request.scored_to += 1
        offset += row.count


def row_logprobs(logprobs: tuple | None, row: int, seq: Sequence) -> tuple | None:
    """Row `row`'s (log-probability, [(id, log-probability)] of the top `logprobs`) of a step's
    log-probability arrays, None if the sequence asks for none."""
    wanted = seq.sampling.logprobs
    if wanted is None or logprobs is None:
        return None
    chosen, top_values, top_ids = logprobs
    return float(chosen[row]), [(int(i), float(v)) for i, v in zip(top_ids[row, :wanted], top_values[row, :wanted])]


def classified(head: TaskHead, features: np.ndarray | None, row: int) -> Event:
    """The event of a classification whose prompt ended in row `row` of a step with `features` [R, d]."""
    if features is None:
        return Event(None, "error", "this engine's step function returns no features to classify")
    return Event(None, "classified", probs=head.probs(features[row][None])[0])
