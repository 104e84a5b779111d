"""The one-read safetensors reader (`jaxlora.lora.safetensors_io`) and the vectorised PEFT placement
over it (`jaxlora.lora.peft_io`): the same tensors as the safetensors library, refusals of
malformed files, the finite check's sum, and adapters placed exactly as one layer at a time would
(uniform and per-layer ranks, a cast to a narrower host dtype). Fresh random inputs every run."""

import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxlora.lora import peft_io, safetensors_io
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import AdapterError, LoraConfig
from jaxlora.lora.safetensors_io import SafetensorsError
from tests.jaxlora.test_merge import CONFIG

DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.uint8, np.float64)


def _random_tensors(rng, count=7):
    tensors = {}
    for i in range(count):
        shape = tuple(int(n) for n in rng.integers(0, 9, int(rng.integers(0, 4))))
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        values = rng.standard_normal(shape) * 10 if np.dtype(dtype).kind != "u" else rng.integers(0, 255, shape)
        tensors[f"t{i}.{rng.integers(1 << 20)}"] = np.asarray(values).astype(dtype)
    return tensors


def test_tensors_equal_the_safetensors_library(tmp_path):
    rng = np.random.default_rng()
    file = str(tmp_path / "t.safetensors")
    save_file(_random_tensors(rng), file, metadata={"format": "pt"})
    expected, read = load_file(file), safetensors_io.load(file)
    got = read.tensors()
    assert list(got) == list(read.entries) and set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape
        np.testing.assert_array_equal(got[key], value)
        assert np.shares_memory(got[key], read.buffer) or got[key].size == 0  # views, not copies


def _corrupt(tmp_path, edit):
    file = str(tmp_path / "c.safetensors")
    save_file({"a": np.random.default_rng().standard_normal((3, 5)).astype(np.float32),
               "b": np.arange(4, dtype=np.int32)}, file)
    data = bytearray(open(file, "rb").read())
    with open(file, "wb") as f:
        f.write(edit(data))
    return file


def _header(data, replace):
    length = int.from_bytes(data[:8], "little")
    header = bytes(data[8:8 + length]).decode()
    for old, new in replace:
        header = header.replace(old, new)
    header = header.encode()
    return len(header).to_bytes(8, "little") + header + bytes(data[8 + length:])


@pytest.mark.parametrize("edit, words", [
    (lambda d: d[:len(d) - 7], "truncated"),  # data cut short
    (lambda d: d[:5], "shorter than"),
    (lambda d: (10 ** 9).to_bytes(8, "little") + d[8:], "does not fit"),
    (lambda d: d[:8] + b"x" + d[9:], "not valid JSON"),
    (lambda d: (3).to_bytes(8, "little") + b"[1]" + d[8 + int.from_bytes(d[:8], "little"):], "not a JSON object"),
    (lambda d: _header(d, [('"F32"', '"Q7"')]), "unsupported dtype"),
    (lambda d: _header(d, [('[3,5]', '[3,6]')]), "do not hold"),
    (lambda d: _header(d, [('"shape":[3,5]', '"shape":"x"')]), "bad shape"),
])
def test_malformed_files_are_refused(tmp_path, edit, words):
    with pytest.raises(SafetensorsError, match=words):
        safetensors_io.load(_corrupt(tmp_path, edit))


def test_overlapping_or_gapped_offsets_are_refused():
    rng = np.random.default_rng()
    a, b = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    for offsets in ([[0, 4 * a], [4 * a - 4, 4 * a - 4 + 4 * b]], [[0, 4 * a], [4 * a + 4, 4 * a + 4 + 4 * b]]):
        header = ('{"x":{"dtype":"F32","shape":[%d],"data_offsets":%s},"y":{"dtype":"F32","shape":[%d],'
                  '"data_offsets":%s}}' % (a, offsets[0], b, offsets[1])).encode()
        data = np.zeros(offsets[1][1], np.uint8)
        buffer = np.frombuffer(len(header).to_bytes(8, "little") + header + data.tobytes(), np.uint8)
        with pytest.raises(SafetensorsError, match="not contiguous"):
            safetensors_io.parse(buffer)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
def test_maybe_nonfinite_sees_nan_and_inf(tmp_path, dtype, bad):
    rng = np.random.default_rng()
    tensors = {f"w{i}": (rng.standard_normal(int(rng.integers(1, 300))) * 0.1).astype(dtype) for i in range(4)}
    tensors["ids"] = rng.integers(0, 1000, 17).astype(np.int64)  # not a float: never looked at
    if bad is not None:
        key = f"w{int(rng.integers(4))}"
        tensors[key][int(rng.integers(tensors[key].size))] = bad
    file = str(tmp_path / "f.safetensors")
    save_file(tensors, file)
    assert safetensors_io.load(file).maybe_nonfinite() == (bad is not None)


def _per_layer(adapter_path, host_dtype=None):
    """The adapter as one layer at a time places it: the tensors as separate arrays (no shared buffer)."""
    tensors = {k: np.array(v) for k, v in load_file(os.path.join(adapter_path, peft_io.WEIGHTS_FILE)).items()}
    config = peft_io.read_adapter_config(adapter_path, CONFIG)
    return peft_io.adapter_from_peft(config, tensors, CONFIG, "x", adapter_path, host_dtype=host_dtype)


@pytest.mark.parametrize("pattern", [False, True])
@pytest.mark.parametrize("stored", [np.float32, ml_dtypes.bfloat16])
def test_vectorised_placement_equals_per_layer(tmp_path, pattern, stored, monkeypatch):
    rng = np.random.default_rng()
    stacked, original = [], peft_io._stacked
    monkeypatch.setattr(peft_io, "_stacked", lambda arrays: stacked.append(original(arrays)) or stacked[-1])
    r = int(rng.integers(1, 9))
    ranks = {f"layers.{int(rng.integers(CONFIG.num_layers))}.self_attn.v_proj": int(rng.integers(1, 9))} if pattern else {}
    lora = LoraConfig(r=r, lora_alpha=float(rng.integers(1, 32)), target_modules=("q_proj", "v_proj", "down_proj"),
                      rank_pattern=ranks)
    adapter = random_adapter("x", CONFIG, lora, seed=int(rng.integers(1 << 30)), b_std=0.3)
    for weights in adapter.modules.values():
        weights.a, weights.b = weights.a.astype(stored), weights.b.astype(stored)
    path = str(tmp_path / "adapter")
    peft_io.save_peft_adapter(adapter, path)
    for host_dtype in (None, lambda s: np.dtype(ml_dtypes.bfloat16)):
        stacked.clear()
        peft_io._PLANS.clear()  # the layout worked out afresh (`_make_plan`), not the plan of the last pass
        fast = peft_io.load_peft_adapter(path, CONFIG, keep_dtype=True, host_dtype=host_dtype)
        assert any(view is not None and len(view[1]) > 1 for view in stacked)  # one assignment for many layers
        slow = _per_layer(path, host_dtype) if host_dtype else peft_io.adapter_from_peft(
            peft_io.read_adapter_config(path, CONFIG), {k: np.array(v) for k, v in load_file(
                os.path.join(path, peft_io.WEIGHTS_FILE)).items()}, CONFIG, "x", path, keep_dtype=True)
        for module, weights in slow.modules.items():
            for part in ("a", "b", "rank", "scale"):
                want, got = getattr(weights, part), getattr(fast.modules[module], part)
                assert got.dtype == want.dtype
                np.testing.assert_array_equal(got, want)
            assert np.asarray(weights.a, np.float32).any()
        expect = np.dtype(ml_dtypes.bfloat16) if host_dtype else np.dtype(stored)
        assert fast.modules["q_proj"].a.dtype == expect
        np.testing.assert_array_equal(fast.modules["down_proj"].b.astype(np.float32),
                                      adapter.modules["down_proj"].b.astype(expect).astype(np.float32))


def test_stacked_view_needs_one_buffer_at_equal_steps():
    rng = np.random.default_rng()
    buffer = rng.standard_normal(200).astype(np.float32)
    step = int(rng.integers(6, 20))
    views = [buffer[i * step:i * step + 6].reshape(2, 3) for i in rng.permutation(5)]
    view, order = peft_io._stacked(views)
    for position, index in enumerate(order):
        np.testing.assert_array_equal(view[position], views[index])
    assert peft_io._stacked([np.array(v) for v in views]) is None  # separate arrays
    uneven = [buffer[0:6].reshape(2, 3), buffer[step:step + 6].reshape(2, 3), buffer[3 * step:3 * step + 6].reshape(2, 3)]
    assert peft_io._stacked(uneven) is None


def test_missing_weights_file_and_a_bin_file(tmp_path):
    path = tmp_path / "adapter"
    peft_io.save_peft_adapter(random_adapter("x", CONFIG, LoraConfig(r=2, target_modules=("q_proj",)),
                                             seed=int(np.random.default_rng().integers(1 << 30))), str(path))
    os.rename(path / peft_io.WEIGHTS_FILE, path / "adapter_model.bin")
    with pytest.raises(AdapterError, match="only safetensors is read"):
        peft_io.load_peft_adapter(str(path), CONFIG)


def test_one_layout_planned_once(tmp_path, monkeypatch):
    """Adapters with equal file headers (one training config) share one checked placement plan; each
    is placed from its own bytes, equal to the per-layer placement; a file of another layout (another
    rank) gets a plan of its own."""
    rng = np.random.default_rng()
    made, original = [], peft_io._make_plan
    monkeypatch.setattr(peft_io, "_make_plan", lambda *a: made.append(1) or original(*a))
    peft_io._PLANS.clear()
    lora = LoraConfig(r=int(rng.integers(2, 9)), lora_alpha=16.0, target_modules=("q_proj", "v_proj"))
    paths = []
    for i in range(3):
        adapter = random_adapter(f"a{i}", CONFIG, lora, seed=int(rng.integers(1 << 30)), b_std=0.3)
        paths.append(str(tmp_path / f"a{i}"))
        peft_io.save_peft_adapter(adapter, paths[-1])
    for path in paths:
        got = peft_io.load_peft_adapter(path, CONFIG, keep_dtype=True)
        want = _per_layer(path, lambda s: np.dtype(np.float32))
        for module, weights in want.modules.items():
            np.testing.assert_array_equal(got.modules[module].a, weights.a)
            np.testing.assert_array_equal(got.modules[module].b, weights.b)
    assert len(made) == 1
    other = LoraConfig(r=lora.r + 1, lora_alpha=16.0, target_modules=("q_proj", "v_proj"))
    peft_io.save_peft_adapter(random_adapter("b", CONFIG, other, seed=1, b_std=0.3), str(tmp_path / "b"))
    assert peft_io.load_peft_adapter(str(tmp_path / "b"), CONFIG).modules["q_proj"].a.shape[2] == other.r
    assert len(made) == 2


def test_planned_layout_still_checks_values(tmp_path):
    """A file whose layout was planned before but whose values are not finite is refused (the plan
    covers the layout's checks, not the values)."""
    peft_io._PLANS.clear()
    lora = LoraConfig(r=4, lora_alpha=8.0, target_modules=("q_proj",))
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    adapter = random_adapter("g", CONFIG, lora, seed=3, b_std=0.3)
    peft_io.save_peft_adapter(adapter, good)
    adapter.modules["q_proj"].b[1, 0, 0] = np.nan
    peft_io.save_peft_adapter(adapter, bad)
    peft_io.load_peft_adapter(good, CONFIG)
    with pytest.raises(AdapterError, match="finite|NaN|nan"):
        peft_io.load_peft_adapter(bad, CONFIG)


def test_large_headers_are_not_kept(tmp_path, monkeypatch):
    """A header above `KEPT_HEADER_BYTES` (not an adapter's usual size) is parsed and planned on each
    read and kept nowhere: the caches hold only small headers."""
    monkeypatch.setattr(safetensors_io, "KEPT_HEADER_BYTES", 16)
    peft_io._PLANS.clear()
    safetensors_io._kept_entries.cache_clear()
    path = str(tmp_path / "a")
    peft_io.save_peft_adapter(random_adapter("a", CONFIG, LoraConfig(r=2, lora_alpha=4.0, target_modules=("v_proj",)),
                                             seed=5, b_std=0.3), path)
    first = peft_io.load_peft_adapter(path, CONFIG)
    second = peft_io.load_peft_adapter(path, CONFIG)
    np.testing.assert_array_equal(first.modules["v_proj"].b, second.modules["v_proj"].b)
    assert not peft_io._PLANS and safetensors_io._kept_entries.cache_info().currsize == 0
