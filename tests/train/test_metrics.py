"""Metrics people read: per-job loss and learning rate, per-step tokens/s, MFU and step time in
metrics.jsonl, and the same scalars in TensorBoard event files that TensorBoard's reader loads."""

import dataclasses
import json
import os

import pytest

from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.models import presets
from tests.train.tiny_jobs import write_tiny_jobs
from train.config import load_train_config
from train.flops import attention_flops, base_flops_per_token, lora_flops_per_token, peak_tflops, sample_flops
from train.trainer import Trainer


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_flops_of_a_small_model_by_hand():
    config = dataclasses.replace(presets.TINY, vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2,
                                 num_heads=2, num_kv_heads=1, head_dim=2)
    # q 4x4, k 4x2, v 4x2, o 4x4, gate/up 4x6, down 6x4 = 16+8+8+16+24+24+24 = 120 per layer; head 4x10
    assert base_flops_per_token(config) == 4 * (2 * 120 + 40)
    assert attention_flops(config, 3) == 3 * (4 * 2 * 2 * 6) * 2  # 6 causal pairs, 2 layers
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=("q_proj", "down_proj"))
    assert lora_flops_per_token(config, lora) == 6 * 2 * (2 * (4 + 4) + 2 * (6 + 4))
    assert sample_flops(config, lora, 3) == 3 * (4 * 280 + 432) + attention_flops(config, 3)
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("cpu") is None


def test_metrics_jsonl_and_tensorboard_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    jobs = write_tiny_jobs(str(tmp_path))
    config = load_train_config(jobs, ["peak_tflops=0.5"])
    losses = Trainer(config).run()
    out = config.output_dir
    steps = _jsonl(os.path.join(out, "metrics.jsonl"))
    assert steps and all(s["tokens_per_s"] > 0 and s["step_time_s"] > 0 for s in steps)
    assert all(0 < s["mfu"] < 1 and s["model_tflops_per_s"] > 0 for s in steps)
    assert sum(s["tokens"] for s in steps) == sum(r["tokens"] for job in config.jobs
                                                   for r in _jsonl(os.path.join(out, job.name, "metrics.jsonl")))
    cosine = _jsonl(os.path.join(out, "repeat_twice", "metrics.jsonl"))
    assert [r["learning_rate"] for r in cosine][0] == pytest.approx(1e-3)
    assert cosine[-1]["learning_rate"] < cosine[0]["learning_rate"]  # cosine decay

    (events_dir,) = [os.path.join(out, "tensorboard")]
    accumulator = EventAccumulator(events_dir)
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"last_word/loss", "last_word/learning_rate", "throughput/tokens_per_s", "throughput/mfu",
            "throughput/step_time_s"} <= tags
    logged = [event.value for event in accumulator.Scalars("repeat_twice/loss")]
    assert logged == pytest.approx(losses["repeat_twice"], rel=1e-6)
    assert len(accumulator.Scalars("throughput/mfu")) == len(steps)
