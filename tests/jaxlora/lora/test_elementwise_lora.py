"""The LoRA in elementwise form (`jaxlora.lora.ops.elementwise_*`, hybrid_xla's decode route): each
row's delta equals the plain reference over a stacked pool at a layer's offset, for one projection,
a group (ranks side by side in one shrink) and outputs packed side by side, and over a paged pool
(rows through its table, unified paging); base rows (slot -1) unchanged; float32 and bfloat16; no
dot in the program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.lora import ops
from jaxlora.lora.plan import ServingPlan
from tests.jaxlora.hf_checkpoints import relative_error
from tests.jaxlora.lora.test_serving_plan import IN_DIM, OUT_DIM, paged_module_pool, random_pool

LAYERS, SLOTS, K, RANKS, WIDTHS = 3, 5, 37, (4, 8), (23, 9)  # odd sizes; two projections of ranks 4 and 8


def _stacked(rng, width: int, rank: int, dtype) -> ops.StackedModulePool:
    """A stacked pool [LAYERS, SLOTS, ...] at layer 1 with random A, B and scales (zeros past `rank`
    of a wider pool are not needed: each projection's pool has its own rank)."""
    cast = lambda v: jnp.asarray(v, dtype)
    return ops.StackedModulePool(cast(rng.normal(0, K**-0.5, (LAYERS, SLOTS, K, rank))),
                                 cast(rng.normal(0, 0.5, (LAYERS, SLOTS, rank, width))),
                                 jnp.asarray(rng.uniform(0.5, 2.0, (LAYERS, SLOTS)), jnp.float32),
                                 jnp.full((LAYERS, SLOTS), rank, jnp.int32), jnp.int32(1))


def _reference(x, pool: ops.StackedModulePool, token_slot):
    """x's LoRA for each row (float64): scale * x A B of its slot at the pool's layer; 0 for slot -1."""
    layer, slot = int(pool.layer), np.maximum(token_slot, 0)
    a, b = np.asarray(pool.a[layer], np.float64)[slot], np.asarray(pool.b[layer], np.float64)[slot]
    scale = np.asarray(pool.scale[layer], np.float64)[slot]
    delta = scale[:, None] * np.einsum("nr,nrm->nm", np.einsum("nk,nkr->nr", np.asarray(x, np.float64), a), b)
    return np.where(token_slot[:, None] >= 0, delta, 0.0)


@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 11])
def test_elementwise_lora_matches_the_reference(dtype, bound, rows):
    rng = np.random.default_rng(rows)
    pools = [_stacked(rng, width, rank, dtype) for width, rank in zip(WIDTHS, RANKS)]
    token_slot = rng.integers(-1, SLOTS, rows).astype(np.int32)
    token_slot[0] = 2  # at least one adapter row
    plan = ServingPlan(jnp.asarray(token_slot), jnp.asarray(token_slot), None, None)
    x = jnp.asarray(rng.normal(size=(rows, K)), dtype)
    ys = [jnp.asarray(rng.normal(size=(rows, w)), dtype) for w in WIDTHS]
    refs = [np.asarray(y, np.float64) + _reference(x, pool, token_slot) for y, pool in zip(ys, pools)]

    one = ops.elementwise_accumulate(ys[0], x, pools[0], plan)
    assert one.dtype == dtype and relative_error(one, refs[0]) <= bound
    group = ops.elementwise_accumulate_group(ys, x, pools, plan)
    assert all(relative_error(got, ref) <= bound for got, ref in zip(group, refs))
    packed = ops.elementwise_accumulate_packed(jnp.concatenate(ys, -1), WIDTHS, x, pools, plan)
    assert relative_error(packed, np.concatenate(refs, -1)) <= bound
    base_rows = token_slot < 0
    np.testing.assert_array_equal(np.asarray(one)[base_rows], np.asarray(ys[0])[base_rows])  # slot -1: untouched


def test_elementwise_lora_computes_no_dot():
    rng = np.random.default_rng(0)
    pools = [_stacked(rng, width, rank, jnp.float32) for width, rank in zip(WIDTHS, RANKS)]
    plan = ServingPlan(jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32), None, None)
    y, x = jnp.zeros((4, sum(WIDTHS))), jnp.ones((4, K))
    jaxpr = str(jax.make_jaxpr(lambda y, x: ops.elementwise_accumulate_packed(y, WIDTHS, x, pools, plan))(y, x))
    assert "dot_general" not in jaxpr and "reduce_sum" in jaxpr


def test_elementwise_lora_reads_a_paged_pool_through_its_table():
    rng = np.random.default_rng(7)
    pool = random_pool(rng)  # padded slots with mixed ranks (zeros past each)
    paged = paged_module_pool(pool, rng)
    token_slot = rng.integers(-1, pool["a"].shape[0], 13).astype(np.int32)
    token_slot[0] = 1
    plan = ServingPlan(jnp.asarray(token_slot), jnp.asarray(token_slot), None, None)
    x = jnp.asarray(rng.normal(size=(13, IN_DIM)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(13, OUT_DIM)), jnp.float32)
    stacked = ops.StackedModulePool(*(jnp.asarray(pool[key])[None] for key in ("a", "b", "scale", "rank")),
                                    jnp.int32(0))
    expected = np.asarray(y, np.float64) + _reference(x, stacked, token_slot)
    assert relative_error(ops.elementwise_accumulate(y, x, paged, plan), expected) <= 1e-5
