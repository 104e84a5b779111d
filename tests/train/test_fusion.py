"""Knowledge fusion's greedy packing (`train.fusion`) with scripted accuracies, and its `fusion:`
configuration; no model (the end-to-end run on SmolLM2: test_fusion_smollm2.py)."""

import pytest

from train.config import ConfigError, load_train_config
from train.fusion import Fit, FusionTask, format_table, format_trial, fusion_order, pack, packing_report


class ScriptedBackend:
    """Accuracy of task t in an adapter trained on `tasks`: `script[frozenset(tasks)][t]`, else 0.9."""

    def __init__(self, script=None):
        self.script = {frozenset(k): v for k, v in (script or {}).items()}
        self.calls = []

    def fit(self, tasks):
        names = tuple(t.name for t in tasks)
        self.calls.append(names)
        scripted = self.script.get(frozenset(names), {})
        return Fit({name: scripted.get(name, 0.9) for name in names}, adapter=names)


def _tasks(*names, required=0.8):
    return [FusionTask(name, required) for name in names]


def _groups(packing):
    return [tuple(t.name for t in adapter.tasks) for adapter in packing.adapters]


def test_everything_fits_one_adapter():
    backend = ScriptedBackend()
    packing = pack(_tasks("a", "b", "c"), backend)
    assert _groups(packing) == [("a", "b", "c")]
    assert backend.calls == [("a",), ("a", "b"), ("a", "b", "c")]
    assert packing.adapters[0].fit.adapter == ("a", "b", "c")  # the last accepted fit is kept


def test_a_task_that_breaks_an_earlier_task_starts_a_new_adapter():
    # Adding c drops a (trained earlier) below its requirement, c itself is fine: c goes alone,
    # adapter 1 keeps its {a, b} fit; d then joins the newest adapter (next fit).
    backend = ScriptedBackend({("a", "b", "c"): {"a": 0.7, "c": 1.0}, ("a",): {"a": 0.95}})
    packing = pack(_tasks("a", "b", "c", "d"), backend)
    assert _groups(packing) == [("a", "b"), ("c", "d")]
    assert backend.calls == [("a",), ("a", "b"), ("a", "b", "c"), ("c",), ("c", "d")]
    assert packing.adapters[0].fit.accuracy == {"a": 0.9, "b": 0.9}
    assert [t.accepted for t in packing.trials] == [True, True, False, True, True]
    report = packing_report(packing)
    assert report["num_adapters"] == 2 and report["all_met"]
    assert report["trials"][2] == {"adapter": "adapter_1", "tasks": ["a", "b", "c"],
                                   "accuracy": {"a": 0.7, "b": 0.9, "c": 1.0}, "accepted": False}


def test_next_fit_never_returns_to_a_closed_adapter():
    backend = ScriptedBackend({("a", "b"): {"b": 0.5}, ("b", "c"): {"c": 0.1}})
    packing = pack(_tasks("a", "b", "c"), backend, policy="next_fit")
    assert _groups(packing) == [("a",), ("b",), ("c",)]
    assert ("a", "c") not in backend.calls


def test_first_fit_a_task_that_fits_no_existing_adapter():
    # c breaks both adapters (itself in {a, c}, b in {b, c}): a third adapter; d then fits the oldest.
    backend = ScriptedBackend({("a", "b"): {"b": 0.5}, ("a", "c"): {"c": 0.2}, ("b", "c"): {"b": 0.79}})
    packing = pack(_tasks("a", "b", "c", "d"), backend, policy="first_fit")
    assert _groups(packing) == [("a", "d"), ("b",), ("c",)]
    assert backend.calls == [("a",), ("a", "b"), ("b",), ("a", "c"), ("b", "c"), ("c",), ("a", "d")]
    assert [(t.adapter, t.accepted) for t in packing.trials] == [
        (0, True), (0, False), (1, True), (0, False), (1, False), (2, True), (0, True)]


def test_a_task_that_misses_its_requirement_alone_closes_its_adapter():
    backend = ScriptedBackend({("a", "b"): {"b": 0.4}, ("b",): {"b": 0.3}})
    packing = pack(_tasks("a", "b", "c"), backend, policy="first_fit")
    assert _groups(packing) == [("a", "c"), ("b",)]  # nothing is tried with b's adapter
    assert ("b", "c") not in backend.calls
    report = packing_report(packing)
    assert not report["all_met"]
    assert [(r["task"], r["adapter"], r["met"]) for r in report["tasks"]] == [
        ("a", "adapter_1", True), ("c", "adapter_1", True), ("b", "adapter_2", False)]
    assert "NO" in format_table(report) and "some requirements NOT met" in format_table(report)


def test_per_task_requirements():
    tasks = [FusionTask("a", 0.95), FusionTask("b", 0.5)]
    backend = ScriptedBackend({("a",): {"a": 0.96}, ("a", "b"): {"a": 0.94, "b": 0.6}})
    assert _groups(pack(tasks, backend)) == [("a",), ("b",)]
    tasks[0] = FusionTask("a", 0.94)
    assert _groups(pack(tasks, backend)) == [("a", "b")]


def test_order():
    tasks = _tasks(*"abcdefgh")
    assert fusion_order(tasks, "given", 0) == tasks
    shuffled = fusion_order(tasks, "random", 0)
    assert sorted(t.name for t in shuffled) == list("abcdefgh") and shuffled != tasks
    assert fusion_order(tasks, "random", 0) == shuffled and fusion_order(tasks, "random", 1) != shuffled


def test_bad_input():
    with pytest.raises(ValueError, match="unique"):
        pack(_tasks("a", "a"), ScriptedBackend())
    with pytest.raises(ValueError, match="policy 'best_fit'"):
        pack(_tasks("a"), ScriptedBackend(), policy="best_fit")

    class Forgetful:
        def fit(self, tasks):
            return Fit({})

    with pytest.raises(ValueError, match=r"no accuracy for \['a'\]"):
        pack(_tasks("a"), Forgetful())


FUSION_JOBS = """\
output_dir: out
fusion: {order: given, policy: first_fit}
jobs:
  - name: a
    dataset: a.jsonl
    eval_dataset: a_eval.jsonl
    min_accuracy: 0.9
    steps: 2
  - name: b
    dataset: b.jsonl
    eval_dataset: /data/b_eval.jsonl
    min_accuracy: 1
    steps: 2
"""


def test_fusion_config(tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text(FUSION_JOBS)
    config = load_train_config(str(path))
    assert config.fusion.order == "given" and config.fusion.policy == "first_fit" and config.fusion.seed == 0
    assert config.jobs[0].eval_dataset == str(tmp_path / "a_eval.jsonl") and config.jobs[0].min_accuracy == 0.9
    assert config.jobs[1].eval_dataset == "/data/b_eval.jsonl"
    path.write_text(FUSION_JOBS.replace("fusion: {order: given, policy: first_fit}\n", ""))
    assert load_train_config(str(path)).fusion is None


@pytest.mark.parametrize("old, new, expected", [
    ("policy: first_fit", "policy: worst_fit", r"jobs\.yaml:2: policy='worst_fit' is not one of"),
    ("policy: first_fit", "polcy: next_fit", r"jobs\.yaml:2: unknown fusion key 'polcy'"),
    ("{order: given, policy: first_fit}", "[given]", r"jobs\.yaml:2: 'fusion' must be a mapping"),
    ("policy: first_fit", "max_new_tokens: 0", r"jobs\.yaml:2: max_new_tokens must be a positive integer"),
    ("    min_accuracy: 0.9\n", "", r"jobs\.yaml:4: job 'a' needs 'eval_dataset' and 'min_accuracy'"),
    ("min_accuracy: 1\n", "min_accuracy: 90\n", r"jobs\.yaml:12: min_accuracy must be a number in \[0, 1\]"),
])
def test_bad_fusion_config(tmp_path, old, new, expected):
    path = tmp_path / "jobs.yaml"
    path.write_text(FUSION_JOBS.replace(old, new))
    with pytest.raises(ConfigError, match=expected):
        load_train_config(str(path))


def test_progress_lines():
    lines = []
    pack(_tasks("a", "b"), ScriptedBackend({("a", "b"): {"a": 0.5}}), on_trial=lambda t: lines.append(format_trial(t)))
    assert lines == ["adapter_1 <- a: a 90%: kept", "adapter_1 <- b: a 50%, b 90%: rolled back", "adapter_2 <- b: b 90%: kept"]
