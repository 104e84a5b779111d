"""`jaxlora.weights.hf.load_hf_weights` (headers parsed here, tensors read by threads into one host
buffer per weight: `safetensors_file`, `parallel_read`) gives the arrays of the safetensors
library's reader through `layout.stack_weights` (the loader before) bit for bit, on the host path
and on the accelerators' device path, for float32 and bfloat16 files and weights; bad files are
errors naming the file."""

import json
import os
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import jaxlora.weights.layout as layout
import jaxlora.weights.parallel_read as parallel_read
from jaxlora.weights import WeightsError
from jaxlora.weights.hf import load_hf_weights, read_hf_config, safetensors_files
from jaxlora.weights.safetensors_file import read_header
from tests.jaxlora.hf_checkpoints import save_random_model, tiny_llama_config, tiny_phi3_config, tiny_qwen2_config

CONFIGS = {"llama": tiny_llama_config, "phi3": tiny_phi3_config, "qwen2": tiny_qwen2_config}


def library_weights(directory: str, dtype) -> dict:
    """The loader before this one: `stack_weights` over the safetensors library's `get_tensor`."""
    config = read_hf_config(directory)
    handles = [safe_open(file, framework="numpy") for file in safetensors_files(directory)]
    owner = {name: handle for handle in handles for name in handle.keys()}
    return layout.stack_weights(config, sorted(owner), lambda name: owner[name].get_tensor(name), dtype, directory)


def cast_file(directory: str, dtype, only: str | None = None) -> None:
    """Rewrites model.safetensors with its tensors (or only the tensor `only`) in `dtype`."""
    file = os.path.join(directory, "model.safetensors")
    tensors = load_file(file)
    save_file({name: t.astype(dtype) if only in (None, name) else t for name, t in tensors.items()}, file,
              metadata={"format": "pt"})


def assert_same(ours: dict, reference: dict) -> None:
    assert set(ours) == set(reference)
    for name in reference:
        assert ours[name].dtype == reference[name].dtype, name
        assert ours[name].shape == reference[name].shape, name
        np.testing.assert_array_equal(np.asarray(ours[name]).view(np.uint8),
                                      np.asarray(reference[name]).view(np.uint8), err_msg=name)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("file_dtype", ["float32", "bfloat16"])
def test_the_same_weights_as_the_library_reader_on_both_paths(tmp_path, monkeypatch, family, file_dtype):
    directory = str(tmp_path / "model")
    save_random_model(CONFIGS[family](), directory)
    if file_dtype == "bfloat16":
        cast_file(directory, ml_dtypes.bfloat16)
    monkeypatch.setattr(parallel_read, "CHUNK_BYTES", 1000)  # many chunks a tensor, split mid-row
    config = read_hf_config(directory)
    for dtype in (jnp.float32, jnp.bfloat16):
        reference = library_weights(directory, dtype)
        assert_same(load_hf_weights(directory, config, dtype), reference)
        with monkeypatch.context() as device:
            device.setattr(layout.jax, "default_backend", lambda: "gpu")  # the accelerators' path
            assert_same(load_hf_weights(directory, config, dtype), reference)


def test_a_layer_in_another_dtype_is_widened_like_the_library_reader(tmp_path, monkeypatch):
    directory = str(tmp_path / "model")
    save_random_model(tiny_llama_config(), directory)
    cast_file(directory, np.float16, only="model.layers.1.mlp.up_proj.weight")
    config = read_hf_config(directory)
    for dtype in (jnp.float32, jnp.bfloat16):
        assert_same(load_hf_weights(directory, config, dtype), library_weights(directory, dtype))
        with monkeypatch.context() as device:
            device.setattr(layout.jax, "default_backend", lambda: "gpu")
            assert_same(load_hf_weights(directory, config, dtype), library_weights(directory, dtype))


def test_the_read_window_is_bounded_and_every_byte_read(tmp_path):
    directory = str(tmp_path / "model")
    save_random_model(tiny_llama_config(), directory)
    config = read_hf_config(directory)
    refs = read_header(os.path.join(directory, "model.safetensors"))
    plan = layout.plan_weights(config, sorted(refs), refs.__getitem__, directory)
    with parallel_read.BufferReader(plan, threads=3, chunk_bytes=333, ahead_bytes=0) as reader:
        for name, buffer in reader:
            assert len(reader._pending) <= 1  # ahead 0: one weight's reads at a time beyond this one
            pieces = plan[name].pieces
            expected = np.stack([p.read() for p in pieces]) if plan[name].stacked else pieces[0].read()
            np.testing.assert_array_equal(buffer, expected, err_msg=name)
    assert reader.bytes == sum(r.nbytes for r in refs.values() if r.name != "lm_head.weight" or
                               not config.tie_word_embeddings)


def write_raw(path: str, header: bytes, data: bytes = b"") -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("case, message", [
    ("length", "header length"), ("json", "Expecting"), ("dtype", "dtype 'Q4'"), ("span", "spans bytes")])
def test_a_corrupt_header_names_the_file(tmp_path, case, message):
    path = str(tmp_path / "bad.safetensors")
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    if case == "length":
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", 1 << 40) + b"{}")
    elif case == "json":
        write_raw(path, b"{not json", bytes(16))
    elif case == "dtype":
        write_raw(path, json.dumps({"w": {**entry, "dtype": "Q4"}}).encode(), bytes(16))
    else:  # a tensor past the end of the file
        write_raw(path, json.dumps({"w": {**entry, "data_offsets": [0, 16]}}).encode(), bytes(8))
    with pytest.raises(WeightsError, match=rf"bad\.safetensors: cannot read safetensors \(truncated or corrupt\?\).*"
                                           rf"{message}"):
        read_header(path)


def test_a_row_slice_reads_the_rows(tmp_path):
    path = str(tmp_path / "t.safetensors")
    values = np.arange(24, dtype=np.float32).reshape(6, 4)
    save_file({"w": values}, path)
    ref = read_header(path)["w"]
    np.testing.assert_array_equal(ref[2:5].read(), values[2:5])
    with pytest.raises(ValueError, match="contiguous rows"):
        ref[::2]
