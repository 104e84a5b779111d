"""Bad training input gets a clear error naming the file and the line."""

import json
import re

import pytest

from jaxlora.tokenizer import Tokenizer
from train.config import ConfigError, load_train_config
from train.data import load_job_samples, read_jsonl

GOOD = """\
output_dir: out
capacity: 256
jobs:
  - name: a
    dataset: a.jsonl
    lora: {r: 4, alpha: 8}
    steps: 2
  - name: b
    dataset: b.jsonl
    epochs: 1
"""


def _write(tmp_path, text, name="jobs.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_good_config_and_overrides(tmp_path):
    config = load_train_config(_write(tmp_path, GOOD), ["capacity=512", "jobs.1.learning_rate=0.01"])
    assert config.capacity == 512 and config.jobs[1].learning_rate == 0.01
    assert config.jobs[0].lora.r == 4 and config.jobs[0].steps == 2 and config.jobs[0].epochs is None
    assert config.jobs[0].dataset == str(tmp_path / "a.jsonl")


@pytest.mark.parametrize("text, expected", [
    ("jobs: [\n  - name: a\n", r"jobs\.yaml:2: malformed YAML"),
    (GOOD.replace("capacity: 256", "capcity: 256"), r"jobs\.yaml:2: unknown key 'capcity'"),
    (GOOD.replace("    epochs: 1", "    epochs: 1\n    learning_rat: 3"), r"jobs\.yaml:11: unknown job key 'learning_rat'"),
    (GOOD.replace("lora: {r: 4, alpha: 8}", "lora: {r: 4, rank: 8}"), r"jobs\.yaml:6: unknown lora key 'rank'"),
    (GOOD.replace("name: b", "name: a"), r"jobs\.yaml:8: duplicate job name 'a'"),
    (GOOD.replace("capacity: 256", "capacity: -3"), r"jobs\.yaml:2: capacity must be a positive integer"),
    (GOOD.replace("steps: 2", "steps: 2\n    schedule: sideways"), r"jobs\.yaml:8: schedule='sideways'"),
    ("output_dir: out\n", r"jobs\.yaml:1: 'jobs' must be a non-empty list"),
    (GOOD.replace("steps: 2", "steps: 2\n    learning_rate: 2e-3"), r"jobs\.yaml:8: learning_rate must be a number"),
])
def test_bad_configs(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_train_config(_write(tmp_path, text))


def test_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="no such key"):
        load_train_config(_write(tmp_path, GOOD), ["jobs.7.learning_rate=1"])


@pytest.mark.parametrize("lines, expected", [
    (['{"prompt": "a", "completion": "b"}', '{"prompt": "a", "completion": '], r"data\.jsonl:2: not valid JSON"),
    (['{"prompt": "a", "completion": 3}'], r"data\.jsonl:1: expected 'text', 'prompt'\+'completion'"),
    (['', '   '], r"data\.jsonl: the dataset is empty"),
    (['{"messages": [{"role": "user", "content": "hi"}]}'], r"data\.jsonl:1: 'messages' has no assistant turn"),
])
def test_bad_datasets(tmp_path, lines, expected):
    path = _write(tmp_path, "\n".join(lines) + "\n", "data.jsonl")
    with pytest.raises(ConfigError, match=expected):
        read_jsonl(path)


def test_overlong_samples_truncate_or_refuse(tmp_path, smollm2):
    _, tokenizer = smollm2
    path = _write(tmp_path, json.dumps({"text": "word " * 40}) + "\n"
                  + json.dumps({"prompt": "short", "completion": " ok"}) + "\n", "data.jsonl")
    config = load_train_config(_write(tmp_path, GOOD.replace("a.jsonl", "data.jsonl")))
    job = config.jobs[0]
    with pytest.raises(ConfigError, match=r"data\.jsonl:1: sample has \d+ tokens, more than the limit of 16"):
        load_job_samples(job, tokenizer, max_len=16, overlong="refuse")
    samples = load_job_samples(job, tokenizer, max_len=16, overlong="truncate")
    assert len(samples[0].tokens) == 16 and len(samples[1].tokens) < 16


def test_every_error_is_reported_at_once(tmp_path):
    text = (GOOD.replace("capacity: 256", "capcity: 256\ncheckpoint_every: 0")
            .replace("lora: {r: 4, alpha: 8}", "lora: {r: 4, rank: 8}\n    schedule: sideways")
            .replace("    epochs: 1", "    epochs: 1\n    learning_rat: 3\n    global_batch_size: 0"))
    with pytest.raises(ConfigError) as err:
        load_train_config(_write(tmp_path, text), ["jobs.0.learning_rate=-1", "nope.x=1"])
    message = str(err.value)
    expected = [r"jobs\.yaml: 8 errors:", r"override 'nope\.x=1': no such key", r"jobs\.yaml:2: unknown key 'capcity'",
                r"jobs\.yaml:3: checkpoint_every must be a positive integer",
                r"jobs\.yaml:5: learning_rate must be a number > 0, not -1",  # an override: the job's line
                r"jobs\.yaml:7: unknown lora key 'rank'", r"jobs\.yaml:8: schedule='sideways'",
                r"jobs\.yaml:13: unknown job key 'learning_rat'", r"jobs\.yaml:14: global_batch_size must be >= 1"]
    for pattern in expected:
        assert re.search(pattern, message), (pattern, message)
    assert len(message.splitlines()) == 9


@pytest.mark.parametrize("text, overrides", [
    (GOOD.replace("steps: 2", "steps: 2\n    epochs: 3"), []),
    (GOOD, ["jobs.1.steps=5"]),
])
def test_steps_with_epochs_is_an_error_naming_both(tmp_path, text, overrides):
    with pytest.raises(ConfigError, match=r"jobs\.yaml:\d+: give 'steps' or 'epochs', not both \(steps=\d, epochs=\d"):
        load_train_config(_write(tmp_path, text), overrides)


def test_an_override_may_replace_epochs_with_steps(tmp_path):
    config = load_train_config(_write(tmp_path, GOOD), ["jobs.1.steps=5", "jobs.1.epochs=null"])
    assert (config.jobs[1].steps, config.jobs[1].epochs) == (5, None)


def test_dataset_files_are_checked_with_the_config(tmp_path):
    path = _write(tmp_path, GOOD.replace("    epochs: 1", "    epochs: 1\n    eval_dataset: b_eval.jsonl"))
    (tmp_path / "a.jsonl").mkdir()
    assert load_train_config(path).jobs[0].dataset == str(tmp_path / "a.jsonl")  # not checked unless asked
    with pytest.raises(ConfigError) as err:
        load_train_config(path, ["capacity=0", "jobs.1.schedule=sideways"], check_files=True)
    message = str(err.value)
    for pattern in (r"jobs\.yaml: 5 errors:", r"jobs\.yaml:2: capacity must be a positive integer",
                    r"jobs\.yaml:8: schedule='sideways'",
                    r"jobs\.yaml:5: dataset .*a\.jsonl: cannot read dataset: a directory",
                    r"jobs\.yaml:9: dataset .*b\.jsonl: cannot read dataset: no such file",
                    r"jobs\.yaml:11: eval_dataset .*b_eval\.jsonl: cannot read dataset: no such file"):
        assert re.search(pattern, message), (pattern, message)


def test_cli_reports_missing_datasets_before_loading_the_model(tmp_path, monkeypatch, capsys):
    import train.base_model
    import train.trainer
    from train.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the datasets were checked")

    monkeypatch.setattr(train.trainer, "Trainer", no_model)
    monkeypatch.setattr(train.base_model, "load_base_model", no_model)
    assert main([_write(tmp_path, GOOD)]) == 2
    err = capsys.readouterr().err
    assert "2 errors" in err and "a.jsonl: cannot read dataset" in err and "b.jsonl: cannot read dataset" in err


def test_dtype_auto_is_the_default_and_resolves_per_platform(tmp_path, monkeypatch):
    """A config without `dtype` means auto (issue 35, like jaxlora-serve): float32 on a CPU, bfloat16
    on a GPU (platform mocked); an explicit dtype is kept; an unknown one lists the choices."""
    import jax

    path = _write(tmp_path, GOOD)
    assert load_train_config(path).dtype == "float32"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert load_train_config(path).dtype == "bfloat16"
    assert load_train_config(path, ["dtype=float32"]).dtype == "float32"
    with pytest.raises(ConfigError, match=r"dtype='fp8'.*auto, float32, bfloat16"):
        load_train_config(path, ["dtype=fp8"])
