"""Task heads (jaxlora/lora/head.py): saved and read back exactly, probabilities against a float64
softmax, and every malformed head folder refused with the file named."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxlora.lora.adapter_config import AdapterError
from jaxlora.lora.head import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE, TaskHead, has_head, load_head, save_head

HIDDEN = 16


def _head(labels=("a", "b", "c"), seed=0) -> TaskHead:
    rng = np.random.default_rng(seed)
    return TaskHead(tuple(labels), rng.normal(size=(len(labels), HIDDEN)).astype(np.float32),
                    rng.normal(size=len(labels)).astype(np.float32))


def test_save_and_load_round_trip(tmp_path):
    head = _head()
    assert not has_head(str(tmp_path)) and load_head(str(tmp_path), HIDDEN) is None
    save_head(head, str(tmp_path))
    loaded = load_head(str(tmp_path), HIDDEN)
    assert loaded.labels == head.labels
    assert np.array_equal(loaded.weight, head.weight) and np.array_equal(loaded.bias, head.bias)


def test_probs_are_the_softmax_of_the_logits():
    head = _head(seed=1)
    features = np.random.default_rng(2).normal(size=(5, HIDDEN)).astype(np.float32) * 4
    logits = features.astype(np.float64) @ head.weight.T.astype(np.float64) + head.bias
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    got = head.probs(features)
    assert got.dtype == np.float32 and np.linalg.norm(got - expected) <= 1e-5 * np.linalg.norm(expected)


def _broken(tmp_path, config=None, tensors=None):
    save_head(_head(), str(tmp_path))
    if config is not None:
        (tmp_path / HEAD_CONFIG_FILE).write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(tmp_path / HEAD_WEIGHTS_FILE))
    return str(tmp_path)


GOOD = {"format": "jaxlora-task-head", "labels": ["a", "b", "c"], "hidden_size": HIDDEN, "pooling": "last"}


@pytest.mark.parametrize("config, tensors, expected", [
    ('{"format": ', None, "head_config.json: not valid JSON"),
    ({**GOOD, "format": "other"}, None, "expected a JSON object with"),
    ({**GOOD, "pooling": "mean"}, None, "pooling 'mean' is not supported"),
    ({**GOOD, "labels": ["a", "a", "c"]}, None, "labels must be distinct"),
    ({**GOOD, "hidden_size": 32}, None, "does not fit the base model's 16"),
    ({**GOOD, "labels": ["a", "b"]}, None, "do not fit 2 labels"),
    (None, {"score.weight": np.ones((3, HIDDEN), np.float32)}, "expected tensors score.weight and score.bias"),
    (None, {"score.weight": np.full((3, HIDDEN), np.nan, np.float32), "score.bias": np.zeros(3, np.float32)},
     "not all finite"),
])
def test_malformed_heads_are_refused(tmp_path, config, tensors, expected):
    with pytest.raises(AdapterError, match=expected):
        load_head(_broken(tmp_path, config, tensors), HIDDEN)


def test_missing_or_corrupt_weights_are_refused(tmp_path):
    path = _broken(tmp_path)
    (tmp_path / HEAD_WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match="head.safetensors: cannot read"):
        load_head(path, HIDDEN)
    (tmp_path / HEAD_WEIGHTS_FILE).unlink()
    with pytest.raises(AdapterError, match="head.safetensors: cannot read"):
        load_head(path, HIDDEN)
