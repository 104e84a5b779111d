"""Async scheduling (step N+1 launched before step N's tokens are read): no token is emitted past
EOS, a stop (the request aborted by its own callback, as the server does on a stop string) or
max_tokens, the row computed after an EOS is discarded, decode inputs come from the device, and
the pages of finished and aborted requests come back; the tokens are the synchronous engine's."""

import collections

from jaxlora.sampling import SamplingParams
from serve.engine import Engine, EngineConfig
from tests.serve.conftest import SMALL_ENGINE

PROMPTS = {"eos": "The capital of France is", "length": "My favourite food is", "stopper": "Once upon a time",
           "aborted": "Water boils at"}


def _reference(model, tokenizer) -> dict:
    """8 greedy tokens of each prompt from the synchronous engine, without EOS."""
    engine = Engine(model, (), EngineConfig(**SMALL_ENGINE, async_scheduling=False))
    got = {name: [] for name in PROMPTS}
    for name, text in PROMPTS.items():
        engine.submit(name, tokenizer.encode(text), None, SamplingParams(8), got[name].append)
    engine.run_until_idle()
    return {name: [e.token for e in events if e.token is not None] for name, events in got.items()}


def _eos_index(ref: dict) -> int:
    """An index k of the "eos" request's tokens whose token appears in no output before it."""
    for k in range(1, 6):
        token = ref["eos"][k]
        if token not in ref["eos"][:k] and all(token not in tokens for name, tokens in ref.items() if name != "eos"):
            return k
    raise AssertionError(f"no usable EOS token in {ref}")


def test_async_scheduling_stops_at_eos_stop_and_max_tokens_and_frees_pages(smollm2):
    model, tokenizer = smollm2
    ref = _reference(model, tokenizer)
    k = _eos_index(ref)
    engine = Engine(model, (ref["eos"][k],), EngineConfig(**SMALL_ENGINE))
    assert engine.config.async_scheduling
    sampled_rows, device_inputs, real_step = collections.Counter(), [], engine.step_fn

    def recording(step, cache):
        sampled_rows.update(row.seq.seq_id for row in step.plan.rows if row.sample)
        device_inputs.append(int((step.token_src >= 0).sum()))
        return real_step(step, cache)

    engine.step_fn = recording
    events = {name: [] for name in PROMPTS}

    def stopper(event):
        events["stopper"].append(event)
        if len(events["stopper"]) == 2:
            engine.abort("stopper")

    limits = {"eos": 8, "length": 3, "stopper": 8, "aborted": 8}
    for name, text in PROMPTS.items():
        callback = stopper if name == "stopper" else events[name].append
        engine.submit(name, tokenizer.encode(text), None, SamplingParams(limits[name]), callback)
    for _ in range(3):
        engine.step()
    engine.abort("aborted")
    engine.run_until_idle()

    tokens = {name: [e.token for e in got if e.token is not None] for name, got in events.items()}
    for got in events.values():  # one finish event, the last one
        assert [e.finish_reason is not None for e in got].count(True) == 1 and got[-1].finish_reason is not None
    assert tokens["eos"] == ref["eos"][: k + 1] and events["eos"][-1].finish_reason == "stop"
    assert sampled_rows["eos"] == k + 2  # the row launched before the EOS was read: computed, never delivered
    assert tokens["length"] == ref["length"][:3] and events["length"][-1].finish_reason == "length"
    assert sampled_rows["length"] == 3  # never scheduled past max_tokens
    assert tokens["stopper"] == ref["stopper"][:2] and events["stopper"][-1].finish_reason == "abort"
    assert tokens["aborted"] == ref["aborted"][: len(tokens["aborted"])] and len(tokens["aborted"]) < 8
    assert events["aborted"][-1].finish_reason == "abort"
    assert sum(device_inputs) > 0  # decode rows took the previous step's tokens on the device
    assert engine.free_pages == SMALL_ENGINE["num_pages"] and not engine.scheduler.has_work()
    assert not any(engine.scheduler.slots.pinned(key) for key in engine.scheduler.slots.resident())
