"""LoRA over paged adapter rows (pallas_kernels/paged_lora.py): the GPU-style kernels in interpret
mode against the pure-jnp reference, and the reference against the padded-slot reference on the
same adapters. Mixed ranks {4, 8, 16, 32}, rows scattered over the pool (as after frees), odd k/n,
empty and slot -1 segments, a single row, a stacked two-layer pool read at layer 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference as ref
from pallas_kernels.paged_lora import bgmv_lora_paged, sgmv_lora_paged
from tests.pallas_kernels.cases import TOL, rel_err

RANKS = (4, 8, 16, 32, 8)  # slot s's rank (slot 4: a second rank-8 adapter)
LAYERS, ROWS, WIDTH = 2, 96, 32  # rows per layer's pool, table width (the pool's max rank)


def paged_pool(seed, k, n, dtype):
    """A stacked two-layer pool: (a_rows [L*P, k], b_rows [L*P, n], table [L*slots, w], rank
    [L*slots], scale [L*slots], padded A [L*slots, k, w], padded B [L*slots, w, n]): each slot's
    rows drawn without replacement from a shuffled free list (non-contiguous), rows past a slot's
    rank in the table pointing at other adapters' rows (they must be masked)."""
    rng = np.random.default_rng(seed)
    ka, kb = jax.random.split(jax.random.PRNGKey(seed))
    a_rows = (jax.random.normal(ka, (LAYERS * ROWS, k)) / np.sqrt(k)).astype(dtype)
    b_rows = (jax.random.normal(kb, (LAYERS * ROWS, n)) / np.sqrt(WIDTH)).astype(dtype)
    free = list(rng.permutation(ROWS))
    table = np.zeros((len(RANKS), WIDTH), np.int32)
    for slot, rank in enumerate(RANKS):
        table[slot, :rank] = [free.pop() for _ in range(rank)]
        table[slot, rank:] = rng.integers(0, ROWS, WIDTH - rank)  # garbage: masked by the rank
    table = np.tile(table, (LAYERS, 1))
    rank = np.tile(np.asarray(RANKS, np.int32), LAYERS)
    scale = rng.uniform(0.5, 2.0, LAYERS * len(RANKS)).astype(np.float32)
    rows = table + np.repeat(np.arange(LAYERS) * ROWS, len(RANKS))[:, None]
    live = np.arange(WIDTH)[None, :] < rank[:, None]
    a_pad = jnp.where(live[:, None, :], jnp.swapaxes(a_rows[rows], 1, 2), 0)
    b_pad = jnp.where(live[:, :, None], b_rows[rows], 0)
    return a_rows, b_rows, jnp.asarray(table), jnp.asarray(rank), jnp.asarray(scale), a_pad, b_pad


def _inputs(seed, rows, k, n, dtype):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed + 100))
    return jax.random.normal(kx, (rows, k)).astype(dtype), jax.random.normal(ky, (rows, n)).astype(dtype)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_bgmv_paged_mixed_ranks(dtype):
    k, n = 40, 24  # not multiples of the blocks: padded by the dispatcher
    a_rows, b_rows, table, rank, scale, a_pad, b_pad = paged_pool(0, k, n, dtype)
    row_slot = jnp.asarray([3, -1, 0, 1, 2, 4, 0, -1, 3], jnp.int32)
    x, y = _inputs(0, row_slot.shape[0], k, n, dtype)
    layer = 1
    args = (y, x, a_rows, b_rows, row_slot, table, rank, scale, layer * ROWS, layer * len(RANKS))
    expected = ref.bgmv_paged_ref(*args)
    out = bgmv_lora_paged(*args, impl="gpu")
    assert out.dtype == dtype and rel_err(out - y, expected - y) <= TOL[dtype]
    untouched = np.asarray(row_slot) < 0
    np.testing.assert_array_equal(np.asarray(out)[untouched], np.asarray(y)[untouched])
    # the reference equals the padded-slot reference on the same adapters
    entry = jnp.where(row_slot >= 0, row_slot + layer * len(RANKS), -1)
    entry_rank = jnp.where(entry >= 0, rank[jnp.maximum(entry, 0)], 0)
    entry_scale = scale[jnp.maximum(entry, 0)]
    v = ref.bgmv_shrink_ref(x.astype(jnp.float32), a_pad.astype(jnp.float32), entry, entry_rank)
    padded = ref.bgmv_expand_ref(y.astype(jnp.float32), v, b_pad.astype(jnp.float32), entry, entry_rank,
                                 entry_scale)
    assert rel_err(expected.astype(jnp.float32) - y, padded - y.astype(jnp.float32)) <= TOL[dtype]


def test_bgmv_paged_single_row():
    a_rows, b_rows, table, rank, scale, _, _ = paged_pool(1, 32, 32, jnp.float32)
    x, y = _inputs(1, 1, 32, 32, jnp.float32)
    args = (y, x, a_rows, b_rows, jnp.asarray([2], jnp.int32), table, rank, scale)
    expected = ref.bgmv_paged_ref(*args)
    assert rel_err(bgmv_lora_paged(*args, impl="gpu") - y, expected - y) <= 1e-5


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_sgmv_paged_segments(dtype):
    k, n = 37, 20  # odd sizes
    a_rows, b_rows, table, rank, scale, a_pad, b_pad = paged_pool(2, k, n, dtype)
    sizes, slots = [5, 0, 9, 13, 1, 7, 0], [1, 2, -1, 3, 0, 4, -1]  # empty, slot -1, one-row segments
    starts = jnp.asarray(np.r_[0, np.cumsum(sizes)], jnp.int32)
    seg_slot = jnp.asarray(slots, jnp.int32)
    num_rows = int(np.sum(sizes)) + 3  # 3 padding rows after the last segment
    x, y = _inputs(2, num_rows, k, n, dtype)
    args = (y, x, a_rows, b_rows, starts, seg_slot, table, rank, scale, ROWS, len(RANKS))
    expected = ref.sgmv_paged_ref(*args)
    out = sgmv_lora_paged(*args, impl="gpu")
    assert out.dtype == dtype and rel_err(out - y, expected - y) <= TOL[dtype]
    untouched = np.r_[5:14, 35:38]  # the slot -1 segment and the padding rows
    np.testing.assert_array_equal(np.asarray(out)[untouched], np.asarray(y)[untouched])
    # against the padded-slot SGMV reference
    entry = jnp.where(seg_slot >= 0, seg_slot + len(RANKS), -1)
    seg_rank = jnp.where(entry >= 0, rank[jnp.maximum(entry, 0)], 0)
    v = ref.sgmv_shrink_ref(x.astype(jnp.float32), a_pad.astype(jnp.float32), starts, entry, seg_rank)
    padded = ref.sgmv_expand_ref(y.astype(jnp.float32), v, b_pad.astype(jnp.float32), starts, entry, seg_rank,
                                 scale[jnp.maximum(entry, 0)])
    assert rel_err(expected.astype(jnp.float32) - y, padded - y.astype(jnp.float32)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_sgmv_paged_one_row_segments(dtype):
    """A mixed step's plan over paged pools (`tail_segments`): prefill segments, then a run of one-
    row segments (decode rows, up to 16 segments in one row tile, each a work item of its own)
    with a slot -1 run among them; rows of no active segment keep y."""
    k, n = 64, 40
    a_rows, b_rows, table, rank, scale, _, _ = paged_pool(5, k, n, dtype)
    sizes = [11, 6] + [1] * 19 + [3] + [1] * 4
    slots = [2, 0] + [s % len(RANKS) for s in range(19)] + [-1] + [1, 3, 4, 0]
    starts = jnp.asarray(np.r_[0, np.cumsum(sizes)], jnp.int32)
    num_rows = int(np.sum(sizes)) + 5
    x, y = _inputs(5, num_rows, k, n, dtype)
    args = (y, x, a_rows, b_rows, starts, jnp.asarray(slots, jnp.int32), table, rank, scale, ROWS, len(RANKS))
    expected = ref.sgmv_paged_ref(*args)
    out = sgmv_lora_paged(*args, impl="gpu")
    assert out.dtype == dtype and rel_err(out - y, expected - y) <= TOL[dtype]
    assert float(jnp.abs((expected - y).astype(jnp.float32)).max()) > 0.1  # the adapters contribute
    untouched = np.r_[36:39, 43:48]  # the slot -1 run and the padding rows
    np.testing.assert_array_equal(np.asarray(out)[untouched], np.asarray(y)[untouched])


def test_sgmv_paged_split_k_with_empty_splits():
    """k = 200: 13 k blocks of 16 over 8 split-K programs a row tile (the last takes none)."""
    k, n = 200, 48
    a_rows, b_rows, table, rank, scale, _, _ = paged_pool(4, k, n, jnp.float32)
    sizes, slots = [17, 3, 12], [3, -1, 0]
    starts = jnp.asarray(np.r_[0, np.cumsum(sizes)], jnp.int32)
    x, y = _inputs(4, int(np.sum(sizes)), k, n, jnp.float32)
    args = (y, x, a_rows, b_rows, starts, jnp.asarray(slots, jnp.int32), table, rank, scale)
    assert rel_err(sgmv_lora_paged(*args, impl="gpu") - y, ref.sgmv_paged_ref(*args) - y) <= 1e-5


def test_sgmv_paged_single_segment_and_no_segments():
    a_rows, b_rows, table, rank, scale, _, _ = paged_pool(3, 32, 32, jnp.float32)
    x, y = _inputs(3, 16, 32, 32, jnp.float32)
    one = (jnp.asarray([0, 16], jnp.int32), jnp.asarray([3], jnp.int32))
    args = (y, x, a_rows, b_rows, *one, table, rank, scale)
    assert rel_err(sgmv_lora_paged(*args, impl="gpu") - y, ref.sgmv_paged_ref(*args) - y) <= 1e-5
    empty = (jnp.zeros(3, jnp.int32), jnp.asarray([0, 1], jnp.int32))  # two empty segments
    out = sgmv_lora_paged(y, x, a_rows, b_rows, *empty, table, rank, scale, impl="gpu")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(y))


def test_kernels_lower_to_triton_for_cuda(monkeypatch):
    """The four kernels lower through Pallas' Triton lowering for a CUDA sm_90 target (an H100/H200),
    without a GPU: jax.export for platform "cuda", the GPU query replaced by a fixed sm_90 (the
    lowering asks the local device otherwise). Catches what interpret mode accepts and Triton's
    lowering does not (block shapes, gathers, dot shapes); Triton's own compile runs on a GPU only."""
    from jax import export
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    from pallas_kernels import paged_lora_gpu as gpu
    from pallas_kernels.routing import make_routing

    sm90 = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: sm90)
    spec = jax.ShapeDtypeStruct
    i32, f32, bf16 = jnp.int32, jnp.float32, jnp.bfloat16
    rows, k, n, entries, width, batch, tokens = 64, 256, 256, 10, 32, 8, 32
    table = (spec((entries, width), i32), spec((entries,), i32))
    routed = lambda starts: make_routing(starts, tokens, 16)
    kernels = {
        "bgmv_shrink": (lambda x, a, s, t, r, o: gpu.bgmv_paged_shrink_gpu(x, a, s, t, r, o, block_k=128, k_splits=2,
                                                                             interpret=False),
                        (spec((batch, k), bf16), spec((rows, k), bf16), spec((batch,), i32), *table, spec((2,), i32))),
        "bgmv_expand": (lambda y, v, b, s, t, r, c, o: gpu.bgmv_paged_expand_gpu(y, v, b, s, t, r, c, o, block_n=128,
                                                                                   interpret=False),
                        (spec((batch, n), f32), spec((2, batch, width), f32), spec((rows, n), bf16),
                         spec((batch,), i32), *table, spec((entries,), f32), spec((2,), i32))),
        "sgmv_shrink": (lambda x, a, st, s, t, r, o: gpu.sgmv_paged_shrink_gpu(
            x, a, st, s, t, r, o, routed(st), block_rows=16, block_k=128, k_splits=2, interpret=False),
                        (spec((tokens, k), bf16), spec((rows, k), bf16), spec((5,), i32), spec((4,), i32), *table,
                         spec((2,), i32))),
        "sgmv_expand": (lambda y, v, b, st, s, t, r, c, o: gpu.sgmv_paged_expand_gpu(
            y, v, b, st, s, t, r, c, o, routed(st), block_rows=16, block_n=128, interpret=False),
                        (spec((tokens, n), f32), spec((1, tokens, width), f32), spec((rows, n), bf16),
                         spec((5,), i32), spec((4,), i32), *table, spec((entries,), f32), spec((2,), i32))),
    }
    triton_call = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for name, (kernel, args) in kernels.items():
        exported = export.export(jax.jit(kernel), platforms=["cuda"], disabled_checks=[triton_call])(*args)
        assert "xla.gpu.triton" in exported.mlir_module(), name
