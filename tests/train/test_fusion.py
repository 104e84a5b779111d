"""Knowledge fusion's greedy packing (`train.fusion`) with scripted accuracies, and its `fusion:`
configuration; no model (the end-to-end run on SmolLM2: test_fusion_smollm2.py)."""

import pytest

from train.config import ConfigError, load_train_config
from train.demo_tasks import make_examples, write_jsonl
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


class _Characters:
    """A stand-in tokenizer: one id per character."""

    eos_token_ids = (0,)

    def encode(self, text, add_bos=True):
        return [ord(c) for c in text]


def _fusion_files(tmp_path, job_b="    steps: 2\n"):
    for name, count in (("a", 6), ("b", 10)):
        write_jsonl(str(tmp_path / f"{name}.jsonl"), make_examples("last_word", count, seed=0))
        write_jsonl(str(tmp_path / f"{name}_eval.jsonl"), make_examples("last_word", 3, seed=1))
    text = FUSION_JOBS.replace("/data/b_eval.jsonl", "b_eval.jsonl").replace("    steps: 2\n", "global_batch_size: 2\n", 1)
    text = text.replace("global_batch_size: 2\n", "    global_batch_size: 2\n    steps: 3\n")
    head, tail = text.rsplit("    steps: 2\n", 1)
    (tmp_path / "jobs.yaml").write_text(head + job_b + tail)
    return str(tmp_path / "jobs.yaml")


def test_candidate_job_is_the_union_for_the_sum_of_samples(tmp_path):
    from train.fusion_run import TrainerBackend, read_task_data

    config = load_train_config(_fusion_files(tmp_path, "    epochs: 2\n    global_batch_size: 4\n"))
    backend = TrainerBackend(config, None, _Characters(), read_task_data(config))
    assert backend.eval_sets["a"].answers == [e["completion"] for e in make_examples("last_word", 3, seed=1)]
    job = backend._candidate_job(["a", "b"], str(tmp_path / "candidate"))
    # a: 3 steps x 2; b: 2 epochs of 10 in whole batches of 4 = 20; batch 2 (a's) -> 13 steps.
    assert (job.steps, job.epochs, job.global_batch_size, job.lora, job.name) == (13, None, 2, config.jobs[0].lora, "candidate")
    with open(job.dataset) as f:
        assert len(f.readlines()) == 16


def test_bad_fusion_input_is_refused_before_training(tmp_path, capsys):
    from train.cli import main
    from train.fusion_run import read_task_data

    path = _fusion_files(tmp_path)
    assert main([path, "--resume"]) == 2
    assert "--resume does not apply to knowledge fusion" in capsys.readouterr().err
    (tmp_path / "b_eval.jsonl").write_text('{"prompt": "x", "completion": "y"}\n{"text": "no answer"}\n')
    with pytest.raises(ConfigError, match=r"b_eval\.jsonl:2: an evaluation record needs 'prompt' and 'completion'"):
        read_task_data(load_train_config(path))
    (tmp_path / "b_eval.jsonl").unlink()
    assert main([path]) == 2
    assert "b_eval.jsonl: cannot read dataset" in capsys.readouterr().err
