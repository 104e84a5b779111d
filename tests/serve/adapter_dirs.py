"""Directories of many small random PEFT adapters (ranks and dtypes mixed) for the adapter-tier tests,
and the jaxlora-serve options of a small CPU server over the tiny random model."""

from __future__ import annotations

import dataclasses
import os

import ml_dtypes

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.peft_io import save_peft_adapter

RANKS = (4, 8, 16, 32)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A small engine: every step program is compiled at warm-up in seconds on a CPU.
SERVER_OPTIONS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--prefill-chunk", "32",
                  "--max-model-len", "64", "--page-size", "8", "--num-kv-pages", "80", "--max-lora-rank", "32",
                  "--max-adapters-on-device", "4", "--max-tokens-limit", "16"]


def adapter_name(index: int) -> str:
    return f"task-{index:04d}"


def write_adapter(root: str, base, index: int) -> str:
    """Adapter `index`: rank RANKS[index % 4] on every projection, B large enough (0.3) to change
    greedy outputs, stored in float32 (even index) or bfloat16 (odd); returns its folder."""
    adapter = random_adapter(adapter_name(index), base, LoraConfig(r=RANKS[index % len(RANKS)], lora_alpha=32,
                                                                    target_modules=TARGETS),
                             seed=1000 + index, b_std=0.3)
    if index % 2:
        for module, weights in adapter.modules.items():
            adapter.modules[module] = dataclasses.replace(weights, a=weights.a.astype(ml_dtypes.bfloat16),
                                                          b=weights.b.astype(ml_dtypes.bfloat16))
    path = os.path.join(root, adapter_name(index))
    save_peft_adapter(adapter, path)
    return path


def write_adapters(root: str, base, count: int) -> int:
    """Writes adapters 0..count-1 under `root`; returns their total bytes on disk."""
    os.makedirs(root, exist_ok=True)
    total = 0
    for index in range(count):
        path = write_adapter(root, base, index)
        total += sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return total
