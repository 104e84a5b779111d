"""Task heads (V-LoRA §4.2.2): a linear layer over the final norm's output of the last token that
answers a classification task in one forward, no decoding. A head belongs to an adapter: it is
trained with the adapter's LoRA (`train.heads`) and saved beside the PEFT files in the adapter
folder:

  - `head_config.json`: {"format": "jaxlora-task-head", "labels": [...], "hidden_size": d,
    "pooling": "last"} (the label of logit i is labels[i]);
  - `head.safetensors`: `score.weight` [num_labels, d] and `score.bias` [num_labels] float32
    (the layout of transformers' `*ForSequenceClassification.score`, plus a bias).

PEFT and vLLM ignore both files, so the folder stays a plain LoRA adapter for them."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxlora.jsonfile import read_json_file
from jaxlora.lora.adapter_config import AdapterError

HEAD_CONFIG_FILE = "head_config.json"
HEAD_WEIGHTS_FILE = "head.safetensors"
HEAD_FORMAT = "jaxlora-task-head"
MAX_LABELS = 4096
MAX_LABEL_CHARS = 256


@dataclasses.dataclass(frozen=True)
class TaskHead:
    """labels: the classes, in logit order; weight [num_labels, d] and bias [num_labels] float32."""

    labels: tuple[str, ...]
    weight: np.ndarray
    bias: np.ndarray

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def probs(self, features: np.ndarray) -> np.ndarray:
        """features [N, d] (the final norm's output of each text's last token) -> probabilities
        [N, num_labels] float32 (softmax of `head_logits`)."""
        logits = head_logits(np.asarray(features, np.float32), self.weight, self.bias)
        logits = logits - logits.max(axis=-1, keepdims=True)
        exp = np.exp(logits)
        return (exp / exp.sum(axis=-1, keepdims=True)).astype(np.float32)


def head_logits(features, weight, bias):
    """features [..., d] @ weight [L, d].T + bias [L] -> [..., L] (numpy or jax arrays alike)."""
    return features @ weight.T + bias


def check_labels(labels, where: str) -> tuple[str, ...]:
    """The labels as a tuple; AdapterError naming `where` unless they are 2..MAX_LABELS distinct
    non-empty strings of at most MAX_LABEL_CHARS characters."""
    if not isinstance(labels, (list, tuple)) or not 2 <= len(labels) <= MAX_LABELS:
        raise AdapterError(f"{where}: labels must be a list of 2 to {MAX_LABELS} strings")
    if any(not isinstance(label, str) or not 0 < len(label) <= MAX_LABEL_CHARS for label in labels):
        raise AdapterError(f"{where}: each label must be a non-empty string of at most {MAX_LABEL_CHARS} characters")
    if len(set(labels)) != len(labels):
        raise AdapterError(f"{where}: labels must be distinct")
    return tuple(labels)


def has_head(path: str) -> bool:
    """Whether the adapter folder `path` carries a task head (its head_config.json exists)."""
    return os.path.isfile(os.path.join(path, HEAD_CONFIG_FILE))


def save_head(head: TaskHead, path: str) -> None:
    """Writes `head`'s two files into the adapter folder `path` (created if missing)."""
    os.makedirs(path, exist_ok=True)
    config = {"format": HEAD_FORMAT, "labels": list(head.labels), "hidden_size": int(head.weight.shape[1]),
              "pooling": "last"}
    with open(os.path.join(path, HEAD_CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {"score.weight": np.ascontiguousarray(head.weight, np.float32),
               "score.bias": np.ascontiguousarray(head.bias, np.float32)}
    save_file(tensors, os.path.join(path, HEAD_WEIGHTS_FILE), metadata={"format": "pt"})


def load_head(path: str, hidden_size: int) -> TaskHead | None:
    """The task head of the adapter folder `path`, None if it has none; AdapterError naming the
    file if it is malformed or does not fit a model of `hidden_size`."""
    if not has_head(path):
        return None
    file = os.path.join(path, HEAD_CONFIG_FILE)
    raw = read_json_file(file, AdapterError, "a task head's config")
    if not isinstance(raw, dict) or raw.get("format") != HEAD_FORMAT:
        raise AdapterError(f"{file}: expected a JSON object with \"format\": \"{HEAD_FORMAT}\"")
    if raw.get("pooling", "last") != "last":
        raise AdapterError(f"{file}: pooling {raw['pooling']!r} is not supported (only \"last\")")
    labels = check_labels(raw.get("labels"), file)
    if raw.get("hidden_size") != hidden_size:
        raise AdapterError(f"{file}: hidden_size {raw.get('hidden_size')!r} does not fit the base model's {hidden_size}")
    weight, bias = _read_score(os.path.join(path, HEAD_WEIGHTS_FILE))
    if weight.shape != (len(labels), hidden_size) or bias.shape != (len(labels),):
        raise AdapterError(f"{path}: head weights {weight.shape}/{bias.shape} do not fit {len(labels)} labels and "
                           f"hidden size {hidden_size}")
    if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
        raise AdapterError(f"{path}: the head's weights are not all finite")
    return TaskHead(labels, weight, bias)


def _read_score(file: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with safe_open(file, framework="numpy") as handle:
            keys = set(handle.keys())
            if keys != {"score.weight", "score.bias"}:
                raise AdapterError(f"{file}: expected tensors score.weight and score.bias, found {sorted(keys)}")
            return (handle.get_tensor("score.weight").astype(np.float32),
                    handle.get_tensor("score.bias").astype(np.float32))
    except AdapterError:
        raise
    except Exception as err:
        raise AdapterError(f"{file}: cannot read safetensors (missing, truncated or corrupt?): {err}") from err
