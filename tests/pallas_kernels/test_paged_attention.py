"""Paged attention (GPU and TPU kernels in interpret mode) against the pure-jnp reference, and the
reference against dense causal attention on contiguous K/V.

Every step mixes the cases the serving engine produces: decode rows (one token), prefill chunks
starting at position 0 and chunks of rows with earlier context (chunked prefill), empty rows,
padding tokens, partly filled last pages; pages are a random permutation of the pool, unused
pages, unwritten slots and block-table entries past a row's pages point at NaN pages, so any
read of them shows. GQA ratios 1/4/8, f32 and bf16, one layer's pages and the stacked cache with
a traced layer index (the other layers all NaN).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.paged_attention_gpu import PagedBlocks, paged_attention_gpu, tile_work_list
from tests.pallas_kernels.cases import TOL, rel_err

HEAD_DIM, PAGE_SIZE, PAGES_PER_ROW = 16, 8, 8
# (tokens in the step, context before the step) per row: decode rows, a chunk with earlier
# context, an empty row, a fresh prefill chunk, a chunk ending mid-page.
ROWS = [(1, 5), (37, 20), (0, 0), (1, 40), (23, 0), (1, 0), (9, 7)]
PADDING = 7


@dataclasses.dataclass
class Step:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    tables: jax.Array
    starts: jax.Array
    positions: jax.Array
    rows: list  # (tokens, context) per row
    contiguous: list  # per row: (k, v) [context + tokens, Hkv, Dh] float32 in position order


def make_step(seed, rows, heads, kv_heads, dtype, padding=PADDING, layers=None, layer=0):
    """A random step over a NaN-poisoned pool (see the module docstring)."""
    rng = np.random.default_rng(seed)
    lengths = [n for n, _ in rows]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = int(starts[-1]) + padding
    needed = [-(-(c + n) // PAGE_SIZE) if n else 0 for n, c in rows]
    num_pages = sum(needed) + 5
    order = rng.permutation(num_pages)
    poisoned = order[sum(needed):]  # never used by any row
    pool_shape = (num_pages, PAGE_SIZE, kv_heads, HEAD_DIM)
    k = np.full(pool_shape, np.nan, np.float32)
    v = np.full(pool_shape, np.nan, np.float32)
    tables = rng.choice(poisoned, (len(rows), PAGES_PER_ROW)).astype(np.int32)
    positions = rng.integers(0, 10_000, tokens).astype(np.int32)  # padding: any value
    contiguous, used = [], 0
    for r, (n, context) in enumerate(rows):
        tables[r, :needed[r]] = order[used:used + needed[r]]
        used += needed[r]
        positions[starts[r]:starts[r + 1]] = context + np.arange(n)
        row_k = rng.standard_normal((context + n, kv_heads, HEAD_DIM)).astype(np.float32)
        row_v = rng.standard_normal((context + n, kv_heads, HEAD_DIM)).astype(np.float32)
        row_k, row_v = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (row_k, row_v))
        for p in range(context + n):
            k[tables[r, p // PAGE_SIZE], p % PAGE_SIZE] = row_k[p]
            v[tables[r, p // PAGE_SIZE], p % PAGE_SIZE] = row_v[p]
        contiguous.append((row_k, row_v))
    q = jax.random.normal(jax.random.key(seed), (tokens, heads, HEAD_DIM), dtype)
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    if layers is not None:
        poison = jnp.full((layers, *pool_shape), jnp.nan, dtype)
        k, v = poison.at[layer].set(k), poison.at[layer].set(v)
    return Step(q, k, v, jnp.asarray(tables), jnp.asarray(starts), jnp.asarray(positions), rows, contiguous)


def dense_attention(step, sm_scale, softcap=None, window=None):
    """Float64 numpy causal attention per row on contiguous K/V (no pages), zeros for padding;
    scores soft-capped and keys limited to the last `window` positions if given."""
    q = np.asarray(step.q.astype(jnp.float32), np.float64)
    tokens, heads, _ = q.shape
    out = np.zeros_like(q)
    starts = np.asarray(step.starts)
    for r, ((n, context), (row_k, row_v)) in enumerate(zip(step.rows, step.contiguous)):
        group = heads // row_k.shape[1]
        keys, values = np.repeat(row_k, group, axis=1), np.repeat(row_v, group, axis=1)  # [S, H, D]
        for i in range(n):
            t, seen = starts[r] + i, context + i + 1
            first = 0 if window is None else max(0, seen - window)
            scores = np.full((heads, seen), -np.inf)
            scores[:, first:] = np.einsum("hd,shd->hs", q[t], keys[first:seen]) * sm_scale
            if softcap is not None:
                scores[:, first:] = softcap * np.tanh(scores[:, first:] / softcap)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[t] = np.einsum("hs,shd->hd", probs, values[:seen])
    return out


def run(step, kernel, layer=None, **kw):
    fn = jax.jit(lambda *a: paged_attention(*a, layer=layer, kernel=kernel, **kw)) if layer is None else \
        jax.jit(lambda *a, layer: paged_attention(*a, layer=layer, kernel=kernel, **kw))
    args = (step.q, step.k, step.v, step.tables, step.starts, step.positions)
    return fn(*args) if layer is None else fn(*args, layer=jnp.int32(layer))


@pytest.mark.parametrize("kv_heads,group", [(4, 1), (2, 4)])
def test_reference_matches_dense_attention(kv_heads, group):
    step = make_step(11, ROWS, kv_heads * group, kv_heads, jnp.float32)
    out = paged_attention_reference(step.q, step.k, step.v, step.tables, step.starts, step.positions)
    expected = dense_attention(step, HEAD_DIM**-0.5)
    assert np.all(np.isfinite(np.asarray(out)))
    assert rel_err(out, expected) < 1e-5
    assert np.all(np.asarray(out)[int(step.starts[-1]):] == 0)


def test_reference_window_softcap_and_scale_match_dense_attention():
    """Gemma/Mistral options: a sliding window shorter than the rows' contexts, soft-capped scores
    and a non-default scale."""
    step = make_step(12, ROWS, 8, 2, jnp.float32)
    options = dict(sm_scale=0.3, softcap=5.0, window=9)
    out = paged_attention_reference(step.q, step.k, step.v, step.tables, step.starts, step.positions, **options)
    assert rel_err(out, dense_attention(step, **options)) < 1e-5
    assert rel_err(out, dense_attention(step, 0.3, 5.0)) > 1e-2  # the window matters


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_kernel_window_and_softcap_match_reference(kernel):
    """A traced window (as a layer scan passes it) and a soft-cap, in each kernel."""
    step = make_step(13, ROWS, 8, 2, jnp.float32, layers=2, layer=1)
    args = (step.q, step.k[1], step.v[1], step.tables, step.starts, step.positions)
    fn = jax.jit(lambda *a, window: paged_attention(*a, layer=jnp.int32(1), kernel=kernel, softcap=5.0,
                                                    window=window, sm_scale=0.3))
    out = fn(step.q, step.k, step.v, *args[3:], window=jnp.int32(9))
    expected = paged_attention_reference(*args, sm_scale=0.3, softcap=5.0, window=9)
    assert rel_err(out, expected) <= 1e-5


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kv_heads,group", [(4, 1), (2, 4), (1, 8)])
def test_kernel_matches_reference(kernel, dtype, kv_heads, group):
    step = make_step(kv_heads + group, ROWS, kv_heads * group, kv_heads, dtype)
    out = run(step, kernel)
    expected = paged_attention_reference(step.q, step.k, step.v, step.tables, step.starts, step.positions)
    assert out.dtype == dtype and out.shape == step.q.shape
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert rel_err(out, expected) <= TOL[dtype]
    assert np.all(np.asarray(out, np.float32)[int(step.starts[-1]):] == 0)  # padding tokens


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_stacked_cache_reads_only_its_layer(kernel):
    """Layer 2 of a 4-layer stack, the index traced; every other layer is NaN."""
    step = make_step(5, ROWS, 8, 2, jnp.bfloat16, layers=4, layer=2)
    out = run(step, kernel, layer=2)
    expected = paged_attention_reference(step.q, step.k[2], step.v[2], step.tables, step.starts, step.positions)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert rel_err(out, expected) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("blocks", [
    PagedBlocks(block_kv=16, num_splits=1),  # one split: the kernel writes the output
    PagedBlocks(block_kv=16, num_splits=3),  # KV splits merged outside
    PagedBlocks(block_kv=16, num_splits=2, merge="kernel", prefetch_pages=False),  # merged by the last split
    PagedBlocks(block_kv=32, block_q=4, block_q_small=4, num_splits=2),  # one tile size
])
def test_gpu_tiles_and_splits(blocks):
    step = make_step(3, ROWS, 8, 2, jnp.float32)
    out = paged_attention_gpu(step.q, step.k, step.v, step.tables, step.starts, step.positions,
                              interpret=True, blocks=blocks)
    expected = paged_attention_reference(step.q, step.k, step.v, step.tables, step.starts, step.positions)
    assert rel_err(out, expected) <= 1e-5


@pytest.mark.parametrize("num_splits,merge", [(3, "xla"), (2, "kernel")])
def test_gpu_window_skips_keys_across_splits(num_splits, merge):
    """With KV splits, a split wholly before every window start reads nothing and merges as empty."""
    step = make_step(14, ROWS, 8, 2, jnp.float32)
    blocks = PagedBlocks(block_kv=16, num_splits=num_splits, merge=merge)
    out = paged_attention_gpu(step.q, step.k, step.v, step.tables, step.starts, step.positions,
                              interpret=True, blocks=blocks, window=5)
    expected = paged_attention_reference(step.q, step.k, step.v, step.tables, step.starts, step.positions, window=5)
    assert rel_err(out, expected) <= 1e-5


def test_decode_only_step_without_padding():
    rows = [(1, c) for c in (0, 3, 17, 40, 63)]
    step = make_step(9, rows, 8, 2, jnp.float32, padding=0)
    expected = dense_attention(step, HEAD_DIM**-0.5)
    for kernel in ("gpu", "tpu"):
        assert rel_err(run(step, kernel), expected) <= 1e-5


def test_step_of_padding_only():
    step = make_step(4, [(0, 0), (0, 0)], 8, 2, jnp.float32, padding=16)
    for kernel in ("gpu", "tpu", "reference"):
        assert np.all(np.asarray(run(step, kernel)) == 0)


def test_auto_is_the_reference_on_cpu_and_sm_scale_is_used():
    step = make_step(6, ROWS[:3], 8, 2, jnp.float32)
    expected = dense_attention(step, 0.3)
    assert rel_err(run(step, "auto", sm_scale=0.3), expected) <= 1e-5
    assert rel_err(run(step, "gpu", sm_scale=0.3), expected) <= 1e-5
    with pytest.raises(ValueError):
        run(step, "cuda")


@pytest.mark.parametrize("seed", range(4))
def test_work_list_covers_every_long_row_token_once(seed):
    """Each token of a row longer than the small tile (and of the padding pseudo-row) lies in
    exactly one large tile; no tile starts past its row's end."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice([0, 1, 2, 3, 5, 17, 40], rng.integers(1, 12))
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = int(starts[-1]) + int(rng.integers(0, 9))
    small, large = 2, 8
    item_row, item_tile, bounds = map(np.asarray, tile_work_list(jnp.asarray(starts), tokens, small, large))
    covered = np.zeros(tokens, int)
    for row, tile in zip(item_row, item_tile):
        if row >= 0:
            begin = bounds[row] + tile * large
            assert begin < bounds[row + 1]
            covered[begin:min(begin + large, bounds[row + 1])] += 1
    row_of = np.searchsorted(bounds, np.arange(tokens), side="right") - 1
    long_token = (bounds[row_of + 1] - bounds[row_of]) > small
    assert np.array_equal(covered, long_token.astype(int))


@pytest.mark.gpu_only
@pytest.mark.parametrize("blocks", [PagedBlocks(num_splits=1), PagedBlocks(num_splits=4),
                                    PagedBlocks(num_splits=4, merge="kernel"), PagedBlocks(block_q=16)])
def test_gpu_kernel_on_gpu_llama_shape(blocks):
    """The compiled Triton kernel (bf16, H=32, Hkv=8, Dh=128, page_size 16) on a mixed step."""
    rows = [(1, int(c)) for c in np.random.default_rng(0).integers(8, 1000, 24)] + [(100, 300), (64, 0)]
    rng = np.random.default_rng(1)
    lengths = [n for n, _ in rows]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens, num_pages, per_row = int(starts[-1]) + 5, 2048, 64
    tables = rng.permutation(num_pages)[:len(rows) * per_row].reshape(len(rows), per_row).astype(np.int32)
    positions = np.zeros(tokens, np.int32)
    for r, (n, c) in enumerate(rows):
        positions[starts[r]:starts[r + 1]] = c + np.arange(n)
    keys = jax.random.split(jax.random.key(0), 3)
    k = jax.random.normal(keys[0], (3, num_pages, 16, 8, 128), jnp.bfloat16)
    v = jax.random.normal(keys[1], k.shape, jnp.bfloat16)
    q = jax.random.normal(keys[2], (tokens, 32, 128), jnp.bfloat16)
    args = (q, k, v, jnp.asarray(tables), jnp.asarray(starts), jnp.asarray(positions))
    out = jax.jit(lambda *a: paged_attention_gpu(*a, layer=jnp.int32(1), blocks=blocks))(*args)
    expected = paged_attention_reference(q, k[1], v[1], *args[3:])
    assert rel_err(out, expected) <= 1e-2
