"""The weights' dtype a server or trainer runs in: `--dtype auto` resolved once, at start-up, from
the platform and what the checkpoint says (light: no jax import, for the command-line parsers)."""

from __future__ import annotations

import json
import os

DTYPES = ("auto", "float32", "bfloat16")  # what --dtype accepts


def checkpoint_dtype(path: str) -> str | None:
    """The dtype a HF checkpoint directory says its weights are in (config.json's `torch_dtype`,
    or `dtype` in newer transformers), e.g. "bfloat16"; None for a GGUF file or when not stated."""
    if path in ("default", "", None):
        return None  # the embedded GGUF
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    value = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


def choose_dtype(requested: str, platform: str, checkpoint: str | None) -> tuple[str, str]:
    """(the weights' dtype, why) for --dtype `requested` on `platform` ("cpu", "gpu", "tpu"):
    an explicit float32/bfloat16 is kept; "auto" (vLLM's default) serves bfloat16 on a GPU or TPU
    (a bfloat16 checkpoint as it is, a float32 or float16 one cast: bfloat16 keeps float32's
    exponent range) and float32 on a CPU (its bfloat16 matmuls are slow). ValueError for another
    value."""
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    stored = f"checkpoint {checkpoint}" if checkpoint else "checkpoint dtype not stated"
    if requested != "auto":
        return requested, f"--dtype {requested} ({stored})"
    if platform in ("gpu", "tpu"):
        return "bfloat16", f"auto: bfloat16 on {platform} ({stored})"
    return "float32", f"auto: float32 on {platform} ({stored})"
