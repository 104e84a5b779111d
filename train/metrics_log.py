"""What a training run reports, written by process 0 only:

  * `output_dir/<job>/metrics.jsonl`: one record per optimizer step of the job (step, microbatch,
    loss, learning rate, the job's tokens, elapsed seconds);
  * `output_dir/metrics.jsonl`: one record per training step (or pipeline segment): step time,
    tokens/s, model TFLOP/s, MFU (`train.flops`; null when the device's peak is unknown and no
    `peak_tflops` is set), device memory in use and its peak (GB; null where the runtime does not
    say, e.g. on a CPU);
  * the same scalars as TensorBoard event files in `output_dir/tensorboard/` (tensorboardX).

On resume, records after the checkpoint's microbatch are dropped, so the files read as one run."""

from __future__ import annotations

import json
import os
import time

import jax

from train.config import TrainConfig


def device_memory_gb() -> tuple[float | None, float | None]:
    """(bytes in use, peak bytes in use) in GB, the largest over this process's devices."""
    stats = [device.memory_stats() for device in jax.local_devices()]
    if not all(stats) or not all("bytes_in_use" in s for s in stats):
        return None, None
    in_use = max(s["bytes_in_use"] for s in stats) / 1e9
    peak = max(s.get("peak_bytes_in_use", s["bytes_in_use"]) for s in stats) / 1e9
    return round(in_use, 3), round(peak, 3)


def _significant(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _restart_jsonl(path: str, start: int) -> list[dict]:
    """Keeps the records of microbatches before `start` (none for a fresh run); returns them."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    kept = [r for r in _read_jsonl(path) if r["microbatch"] < start] if start else []
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    return kept


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class MetricsLog:
    """Per-job step records and per-step throughput records (see the module docstring)."""

    def __init__(self, config: TrainConfig, start: int, peak_tflops: float | None, num_devices: int,
                 writer: bool = True):
        self.writer = writer
        self.started = time.time()
        self.peak_flops = None if peak_tflops is None else peak_tflops * 1e12 * num_devices
        self.names = [job.name for job in config.jobs]
        self.paths = [os.path.join(config.output_dir, name, "metrics.jsonl") for name in self.names]
        self.run_path = os.path.join(config.output_dir, "metrics.jsonl")
        self.records = [_restart_jsonl(p, start) if writer else [] for p in self.paths]
        if writer:
            _restart_jsonl(self.run_path, start)
        self.tensorboard = None
        if writer and config.tensorboard:
            from tensorboardX import SummaryWriter

            self.tensorboard = SummaryWriter(os.path.join(config.output_dir, "tensorboard"))
        self.last_throughput = 0.0

    def log_job(self, slot: int, step: int, microbatch: int, loss: float, learning_rate: float, tokens: int) -> None:
        record = {"step": step, "microbatch": microbatch, "loss": loss, "learning_rate": learning_rate,
                  "tokens": tokens, "elapsed_s": round(time.time() - self.started, 3)}
        self.records[slot].append(record)
        if not self.writer:
            return
        _append(self.paths[slot], record)
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(f"{self.names[slot]}/loss", loss, step)
            self.tensorboard.add_scalar(f"{self.names[slot]}/learning_rate", learning_rate, step)

    def log_step(self, microbatch: int, seconds: float, tokens: int, flops: float) -> dict:
        """A training step (or pipeline segment) ending at `microbatch` took `seconds`."""
        in_use, peak = device_memory_gb()
        self.last_throughput = tokens / max(seconds, 1e-9)
        record = {"microbatch": microbatch, "step_time_s": round(seconds, 6), "tokens": tokens,
                  "tokens_per_s": round(self.last_throughput, 2), "model_tflops_per_s": _significant(flops / seconds / 1e12),
                  "mfu": None if self.peak_flops is None else _significant(flops / seconds / self.peak_flops),
                  "memory_gb": in_use, "peak_memory_gb": peak}
        if self.writer:
            _append(self.run_path, record)
            if self.tensorboard is not None:
                for key in ("step_time_s", "tokens_per_s", "model_tflops_per_s", "mfu", "memory_gb", "peak_memory_gb"):
                    if record[key] is not None:
                        self.tensorboard.add_scalar(f"throughput/{key}", record[key], microbatch)
        return record

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

    def losses(self) -> dict[str, list[float]]:
        return {name: [r["loss"] for r in records] for name, records in zip(self.names, self.records)}
