"""The engine's inference modes (serve/modes.py, V-LoRA): merged, mixed (deLoRA) and auto serve
every request of a mix of adapters and the base model with the greedy tokens of unmerged serving
(float32, tiny random model, random adapters and prompts), also when the mode and the merged
adapter switch while requests run; unmerging restores the base kernels bit for bit; bad
configurations are refused."""

import numpy as np
import pytest
from flax import nnx

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.plan import build_window_plan
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.llama import Llama
from jaxlora.sampling import SamplingParams
from jaxlora.scheduler.serving import ModePolicy
from serve.cli import build_parser
from serve.engine import Engine, EngineConfig
from serve.metrics import Metrics
from tests.serve.test_lora_step import CONFIG

ENGINE = dict(page_size=4, num_pages=96, max_model_len=64, max_num_seqs=8, token_budget=32, prefill_chunk=8,
              max_lora_rank=8, max_adapters_on_device=3, adapter_window=3)
MAX_TOKENS = 6
# Requests by adapter: a0 dominates, a1 and a2 and the base model are the others.
NAMES = ["a0", "a0", "a1", "a0", None, "a0", "a2", "a0", "a1", "a0"]


@pytest.fixture(scope="module")
def model_and_adapters():
    model = Llama(CONFIG, rngs=nnx.Rngs(1))
    targets = [PROJECTIONS, ("q_proj", "v_proj", "down_proj"), ("k_proj", "o_proj", "gate_proj", "up_proj")]
    adapters = {f"a{i}": random_adapter(f"a{i}", CONFIG, LoraConfig(r=(8, 4, 8)[i], lora_alpha=16,
                                                                    target_modules=targets[i]), seed=20 + i, b_std=0.3)
                for i in range(3)}
    return model, adapters


def requests(seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, CONFIG.vocab_size, int(rng.integers(3, 12))).tolist(), name) for name in NAMES]


def serve(engine, batch, between_steps=None, late=()):
    """Greedy tokens of each request of `batch` (then of `late`, submitted after 3 steps);
    between_steps(engine, step index) runs before each step."""
    got = {}

    def submit(i, prompt, name):
        got[i] = []
        engine.submit(i, prompt, name, SamplingParams(MAX_TOKENS), lambda e, i=i: got[i].append(e))

    for i, (prompt, name) in enumerate(batch):
        submit(i, prompt, name)
    for step in range(10_000):
        if step == 3:
            for i, (prompt, name) in enumerate(late, start=len(batch)):
                submit(i, prompt, name)
        if between_steps is not None:
            between_steps(engine, step)
        if not engine.step() and not engine._commands:
            break
    assert all(events[-1].finish_reason == "length" for events in got.values())
    return [[e.token for e in got[i] if e.token is not None] for i in sorted(got)]


@pytest.fixture(scope="module")
def unmerged(model_and_adapters):
    model, adapters = model_and_adapters
    engine = Engine(model, (), EngineConfig(**ENGINE), adapters)
    batch, late = requests(0), requests(1)[:4]
    outputs = serve(engine, batch, late=late)
    assert len({tuple(o) for o in outputs}) > 8  # the adapters change the outputs
    return batch, late, outputs


@pytest.mark.parametrize("mode", ["merged", "mixed", "auto"])
def test_modes_give_the_tokens_of_unmerged_serving(model_and_adapters, unmerged, mode):
    model, adapters = model_and_adapters
    batch, late, outputs = unmerged
    policy = ModePolicy(merge_share=0.5, starve_s=0.0, theta=1, max_batch=8)  # others starve at once: mixed
    engine = Engine(model, (), EngineConfig(inference_mode=mode, mode_policy=policy, **ENGINE), adapters)
    assert serve(engine, batch, late=late) == outputs
    steps = engine.modes.mode_steps
    assert steps[{"auto": "mixed"}.get(mode, mode)] > 0 and engine.modes.switches >= 1
    if mode == "mixed":
        assert any(kind.startswith("window") for kind in engine.stats.kind_steps)  # the -ΔW branch ran
        text = Metrics(engine).render().decode()
        assert f"jaxlora_inference_mode_switches {float(engine.modes.switches)}" in text
        assert 'jaxlora_inference_mode_steps{mode="mixed"} ' in text


def test_cli_takes_the_inference_mode():
    assert build_parser().parse_args([]).inference_mode == "unmerged"
    assert build_parser().parse_args(["--inference-mode", "auto"]).inference_mode == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--inference-mode", "fast"])


@pytest.mark.parametrize("mode", ["merged", "auto"])
def test_modes_finish_every_request_when_kv_pages_are_scarce(model_and_adapters, unmerged, mode):
    """16 pages (3 requests at a time): the merged target's queued requests wait for pages that
    running requests of other adapters hold; those run first, nothing waits forever."""
    model, adapters = model_and_adapters
    batch, late, outputs = unmerged
    config = EngineConfig(inference_mode=mode, **{**ENGINE, "num_pages": 16})
    assert serve(Engine(model, (), config, adapters), batch, late=late) == outputs


def test_switching_modes_while_requests_run_changes_no_tokens(model_and_adapters, unmerged):
    """The configured mode changes every few steps (merged, mixed, auto, unmerged-like auto):
    the weights switch under running requests, and no request's tokens change."""
    model, adapters = model_and_adapters
    batch, late, outputs = unmerged
    engine = Engine(model, (), EngineConfig(inference_mode="mixed", **ENGINE), adapters)
    targets = engine.modes.layout.targets

    def base_columns():  # the base columns of every targeted projection (not the window's)
        weights = engine._state["weights"]
        return {name: np.asarray(weights[key][...])[:, :, offset: offset + width]
                for name, key, offset, width in targets}

    before = base_columns()
    cycle = ["mixed", "merged", "mixed", "auto"]
    merged_adapters = set()

    def switch(engine, step):
        engine.modes.name = cycle[(step // 2) % len(cycle)]
        if engine.modes.merged is not None:
            merged_adapters.add(engine.modes.merged[0])

    assert serve(engine, batch, switch, late) == outputs
    assert engine.modes.switches >= 3 and len(merged_adapters) >= 2
    # back to unmerged: the base kernels bit for bit
    engine.modes.switch(engine, None)
    after = base_columns()
    for name, value in before.items():
        assert after[name].tobytes() == value.tobytes(), name


def test_bad_mode_configurations_are_refused(model_and_adapters):
    model, _ = model_and_adapters
    with pytest.raises(ValueError, match="inference_mode must be one of"):
        EngineConfig(inference_mode="fast")
    with pytest.raises(ValueError, match="adapter window"):
        Engine(model, (), EngineConfig(**{**ENGINE, "adapter_window": 2, "inference_mode": "mixed"}))
    engine = Engine(model, (), EngineConfig(**{**ENGINE, "adapter_window": 0, "inference_mode": "merged"}))
    assert engine.modes is not None and engine.window is None  # merged-only needs no window
    engine.modes.warmup(engine)  # compiles the switch, changes nothing
    assert engine.modes._program is not None and engine.modes.merged is None and engine.modes.switches == 0


def test_window_plan_checks_the_extra_slots():
    plan = build_window_plan(np.array([0, -1, 1]), 3, 4, np.array([2, 2, -1]))
    assert plan.token_extra.tolist() == [2, 2, -1]
    assert build_window_plan(np.array([0, 1]), 3, 4).token_extra.tolist() == [-1, -1]
    with pytest.raises(ValueError, match="window slots"):
        build_window_plan(np.array([0, 1]), 3, 4, np.array([3, -1]))
    with pytest.raises(ValueError, match="must match"):
        build_window_plan(np.array([0, 1]), 3, 4, np.array([2]))


def test_skew_traces_give_the_hot_adapter_its_share():
    """bench/serve.py --modes-skew: adapter 0 on exactly the share, the others over 1..n-1, the
    arrivals and lengths of the base trace kept."""
    from bench.serve import Case, make_trace, skew_trace

    base = make_trace(Case("punica", "replay", 40, 4.0, 1.0, popularity="identical"), 0, 4, 24, 8)
    for share in (0.5, 0.8, 1.0):
        trace = skew_trace(base, share, 8, 0)
        assert (trace.adapters == 0).sum() == round(share * 40)
        assert set(trace.adapters[trace.adapters != 0].tolist()) <= set(range(1, 8))
        assert trace.base_key() == base.base_key()
    assert len(set(skew_trace(base, 0.5, 8, 0).adapters.tolist())) > 4
