"""The engine's "auto" mode with the cost-based policy (jaxlora.scheduler.serving.CostPolicy, the
default): on the tiny CPU model it serves the greedy tokens of unmerged serving while it switches
the weights, and it learns the step costs from the engine's own timings (serve/modes.py
`EngineModes.observe`)."""

from jaxlora.scheduler.serving import CostModes, CostPolicy, ModePolicy
from serve.engine import Engine, EngineConfig
from tests.serve.test_inference_modes import ENGINE, model_and_adapters, serve, unmerged  # noqa: F401 (fixtures)


def test_auto_with_measured_costs_gives_the_tokens_of_unmerged_serving(model_and_adapters, unmerged):  # noqa: F811
    model, adapters = model_and_adapters
    batch, late, outputs = unmerged
    # priors that favour merging and no hysteresis, so that it switches on this short trace
    policy = CostPolicy(max_batch=8, merged_ratio=0.2, mixed_ratio=0.3, min_dwell=1, confirm=1)
    engine = Engine(model, (), EngineConfig(inference_mode="auto", mode_policy=policy, **ENGINE), adapters)
    decider = engine.modes.decider
    assert isinstance(decider, CostModes) and decider.policy is policy
    assert serve(engine, batch, late=late) == outputs
    assert engine.modes.switches >= 1 and engine.modes.mode_steps["unmerged"] > 0
    assert engine.modes.mode_steps["merged"] + engine.modes.mode_steps["mixed"] > 0
    assert decider.costs.samples["merged"] + decider.costs.samples["mixed"] > 0  # the engine's timings came back
    assert not engine.modes._launched  # every launched step was observed
    assert engine.snapshot()["mode_policy"]["samples"] == dict(decider.costs.samples)


def test_the_default_auto_policy_is_the_cost_policy(model_and_adapters):  # noqa: F811
    model, adapters = model_and_adapters
    engine = Engine(model, (), EngineConfig(inference_mode="auto", **ENGINE), adapters)
    assert engine.modes.policy == CostPolicy(max_batch=ENGINE["max_num_seqs"])
    credit = Engine(model, (), EngineConfig(inference_mode="auto", mode_policy=ModePolicy(), **ENGINE), adapters)
    assert type(credit.modes.decider).__name__ == "CreditModes"
