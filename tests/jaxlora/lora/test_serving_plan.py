"""The serving plan: rows ordered once on the host (prefill chunks grouped by adapter, then
one-token rows), and the `pallas` backend on it (SGMV + BGMV, no gathers) gives the delta of the
old path (`LoraPlan`: gather into adapter order, SGMV, scatter back) and of the XLA reference."""

import zlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.lora import backends
from jaxlora.lora.plan import build_plan, build_serving_plan, serving_order
from tests.jaxlora.hf_checkpoints import relative_error

IN_DIM, OUT_DIM, MAX_RANK = 64, 48, 16

# Steps as (slot, tokens) rows in the scheduler's order; -1: base model.
STEPS = {
    "mixed": [(2, 5), (0, 3), (-1, 4), (1, 1), (2, 1), (-1, 1), (0, 1), (5, 7)],
    "decode_only": [(s, 1) for s in (3, 0, 7, 7, -1, 9, 1, 4, 6, 2, 8, 5)],
    "single_decode": [(4, 1)],
    "single_prefill": [(4, 9)],
    "base_only": [(-1, 6), (-1, 1)],
    # 3 prefill adapters fit 4 segments; 8 distinct adapters in all do not, and need not
    "more_adapters_than_segments": [(0, 2), (1, 3), (2, 2)] + [(s, 1) for s in range(3, 11)],
}


def lora_delta(x, module_pool, plan, backend: str):
    return backends.get(backend).delta(x, module_pool, plan)


def random_pool(rng, num_slots=12):
    """A module pool {a, b, scale, rank} with mixed ranks, zero beyond each slot's rank."""
    rank = rng.choice([4, 8, 16], num_slots).astype(np.int32)
    a = rng.normal(0, IN_DIM**-0.5, (num_slots, IN_DIM, MAX_RANK)).astype(np.float32)
    b = rng.normal(0, 0.5, (num_slots, MAX_RANK, OUT_DIM)).astype(np.float32)
    beyond = np.arange(MAX_RANK)[None, :] >= rank[:, None]
    a[beyond[:, None, :].repeat(IN_DIM, 1)] = 0.0
    b[beyond[:, :, None].repeat(OUT_DIM, 2)] = 0.0
    scale = rng.uniform(0.5, 2.0, num_slots).astype(np.float32)
    return {"a": jnp.asarray(a), "b": jnp.asarray(b), "scale": jnp.asarray(scale), "rank": jnp.asarray(rank)}


def ordered_tokens(rows, num_tokens):
    """(token_slot [num_tokens], one_token [num_tokens]) of `rows` in `serving_order`, padded."""
    order = serving_order([s for s, _ in rows], [c for _, c in rows])
    token_slot = np.full(num_tokens, -1, np.int32)
    one_token = np.zeros(num_tokens, bool)
    offset = 0
    for slot, count in (rows[i] for i in order):
        token_slot[offset: offset + count] = slot
        one_token[offset: offset + count] = count == 1
        offset += count
    return token_slot, one_token


def step_plan(rows, num_tokens=32, num_segments=4):
    token_slot, one_token = ordered_tokens(rows, num_tokens)
    segments = num_segments if any(count > 1 for _, count in rows) else 0
    return token_slot, build_serving_plan(token_slot, one_token, segments)


def test_serving_order_puts_prefill_chunks_first_grouped_by_slot():
    rows = STEPS["mixed"]
    order = serving_order([s for s, _ in rows], [c for _, c in rows])
    assert [rows[i] for i in order] == [(0, 3), (2, 5), (5, 7), (0, 1), (1, 1), (2, 1), (-1, 4), (-1, 1)]


def test_serving_plan_segments_cover_the_prefill_prefix_only():
    token_slot, plan = step_plan(STEPS["mixed"], num_segments=8)
    assert list(plan.seg_slot) == [0, 2, 5, -1, -1, -1, -1, -1]
    assert list(plan.seg_starts) == [0, 3, 8, 15, 15, 15, 15, 15, 15]
    assert list(plan.decode_slot[15:24]) == [0, 1, 2, -1, -1, -1, -1, -1, -1]
    assert np.all(plan.decode_slot[:15] == -1) and np.array_equal(plan.token_slot, token_slot)


def test_tail_segments_cover_the_one_token_rows_by_runs():
    """`tail_segments`: the prefill chunks' segments, then one per slot of the one-token rows
    (sorted by `serving_order`), up to the last adapter token; no BGMV rows."""
    token_slot, one_token = ordered_tokens(STEPS["mixed"] + [(2, 1), (7, 1)], 32)
    plan = build_serving_plan(token_slot, one_token, 8, bgmv_rows=16, tail_segments=True)
    assert list(plan.seg_slot) == [0, 2, 5, 0, 1, 2, 7, -1]
    assert list(plan.seg_starts) == [0, 3, 8, 15, 16, 17, 19, 20, 20]
    assert plan.decode_slot is None and plan.decode_rows is None
    assert np.array_equal(plan.token_slot, token_slot)
    # a prefill chunk and a one-token row of one adapter next to each other: one run
    token_slot, one_token = ordered_tokens([(3, 4), (3, 1), (-1, 2), (4, 1)], 16)
    plan = build_serving_plan(token_slot, one_token, 4, tail_segments=True)
    assert list(plan.seg_slot) == [3, 4, -1, -1] and list(plan.seg_starts) == [0, 5, 6, 6, 6]
    with pytest.raises(ValueError, match="runs of one adapter"):
        build_serving_plan(*ordered_tokens(STEPS["mixed"], 32), 4, tail_segments=True)
    # without adapter tokens (a padding step of the mixed program): no segment
    empty = build_serving_plan(np.full(8, -1), np.zeros(8, bool), 4, tail_segments=True)
    assert list(empty.seg_starts) == [0] * 5 and list(empty.seg_slot) == [-1] * 4


def test_decode_only_step_has_no_segments_and_any_number_of_adapters():
    _, plan = step_plan(STEPS["decode_only"])
    assert plan.seg_starts is None and plan.seg_slot is None
    assert sorted(set(plan.decode_slot[plan.decode_slot >= 0])) == list(range(10))


def test_serving_plan_refuses_rows_out_of_order_and_too_many_segments():
    token_slot, one_token = ordered_tokens(STEPS["mixed"], 32)
    with pytest.raises(ValueError, match="come first"):
        build_serving_plan(token_slot[::-1], one_token[::-1], 4)
    with pytest.raises(ValueError, match="do not fit"):
        build_serving_plan(token_slot, one_token, 2)
    with pytest.raises(ValueError, match="do not fit"):
        build_serving_plan(token_slot, one_token, 0)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_serving_plan_delta_equals_the_gathering_path(step, impl):
    rng = np.random.default_rng(zlib.crc32(f"{step} {impl}".encode()))
    pool = random_pool(rng)
    token_slot, plan = step_plan(STEPS[step])
    x = rng.normal(size=(token_slot.size, IN_DIM)).astype(np.float32)
    new = np.asarray(lora_delta(x, pool, plan, impl))
    old = np.asarray(lora_delta(x, pool, build_plan(token_slot, num_segments=16), impl))
    reference = np.asarray(lora_delta(x, pool, build_plan(token_slot), "gather"))
    assert np.all(new[token_slot < 0] == 0.0)
    if step == "base_only":
        assert np.all(new == 0.0)
        return
    assert np.abs(reference).max() > 0.1  # the adapters contribute
    assert relative_error(new, old) <= 1e-5
    assert relative_error(new, reference) <= 1e-5


def _row_gathers(fn, x):
    """The gather/scatter equations of fn's jaxpr (top level) that move whole rows of x or of the delta."""
    row_shapes = {(x.shape[0], IN_DIM), (x.shape[0], OUT_DIM)}
    eqns = jax.make_jaxpr(fn)(x).eqns
    return [e for e in eqns if e.primitive.name in ("gather", "scatter", "scatter-add")
            and any(getattr(v.aval, "shape", None) in row_shapes for v in list(e.invars) + list(e.outvars))]


def test_serving_plan_moves_no_rows():
    """The old path gathers x into adapter order and the delta back; the serving plan does neither."""
    pool = random_pool(np.random.default_rng(1))
    token_slot, plan = step_plan(STEPS["mixed"])
    x = np.zeros((token_slot.size, IN_DIM), np.float32)
    assert len(_row_gathers(lambda x: lora_delta(x, pool, build_plan(token_slot, 8), "pallas_gpu"), x)) == 2
    assert _row_gathers(lambda x: lora_delta(x, pool, plan, "pallas_gpu"), x) == []


def test_ragged_dot_refuses_a_serving_plan():
    pool = random_pool(np.random.default_rng(0))
    token_slot, plan = step_plan(STEPS["mixed"])
    with pytest.raises(ValueError, match="LoraPlan"):
        lora_delta(np.zeros((token_slot.size, IN_DIM), np.float32), pool, plan, "ragged_dot")


# Mixed steps for hybrid's segment GEMM: (rows, segment bucket); with the window at 4 segments
# (`small_window`) 4 go through the GEMM, any further ones (and every one-token row) through BGMV.
HYBRID_STEPS = {
    "several_segments_with_base_rows": ([(2, 5), (-1, 3), (0, 3), (7, 2), (1, 1), (-1, 1), (9, 1), (2, 1)], 8),
    "empty_segments": ([(3, 4), (5, 1), (6, 1)], 8),  # one prefill segment, 7 empty padding ones
    "one_segment_no_decode_rows": ([(4, 9)], 1),
    "prefill_only_full_window": ([(0, 2), (1, 3), (2, 4), (3, 2)], 4),
    "more_segments_than_the_window": ([(s, 2 + s % 3) for s in range(7)] + [(8, 1), (-1, 2), (9, 1)], 8),
}


def _pool_dots(fn, x, num_slots):
    """dot_general equations of fn's jaxpr (any depth) with an operand as large as a whole layer's
    pool of one projection (num_slots x IN_DIM x MAX_RANK): GEMMs against every slot."""
    whole = num_slots * IN_DIM * MAX_RANK

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and any(np.prod(v.aval.shape) >= whole for v in eqn.invars):
                yield eqn
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        yield from walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(x).jaxpr))


@pytest.fixture
def small_window(monkeypatch):
    """The segment window at 4 segments (the engine's is larger), so these small steps overflow it."""
    from jaxlora.lora import ops

    monkeypatch.setattr(ops, "SEGMENT_WINDOW", 4)


@pytest.mark.parametrize("step", sorted(HYBRID_STEPS) + ["mixed", "decode_only", "single_prefill"])
def test_hybrid_delta_equals_the_reference_without_gemms_over_the_pool(step, small_window):
    """hybrid on a ServingPlan: BGMV for one-token rows (and prefill rows beyond the segment
    window), the segment GEMM for the first prefill segments; the reference's delta, zero for base
    rows, and no GEMM against every slot of the pool (the one-hot route's)."""
    rows, segments = HYBRID_STEPS.get(step, (STEPS.get(step), 4))
    rng = np.random.default_rng(zlib.crc32(f"hybrid {step}".encode()))
    pool = random_pool(rng)
    token_slot, plan = step_plan(rows, num_segments=segments)
    x = rng.normal(size=(token_slot.size, IN_DIM)).astype(np.float32)
    hybrid = np.asarray(lora_delta(x, pool, plan, "hybrid"))
    reference = np.asarray(lora_delta(x, pool, build_plan(token_slot), "gather"))
    assert np.abs(reference).max() > 0.1
    assert np.all(hybrid[token_slot < 0] == 0.0)
    assert relative_error(hybrid, reference) <= 1e-5
    fn = lambda x: lora_delta(x, pool, plan, "hybrid")
    primitives = {e.primitive.name for e in jax.make_jaxpr(fn)(x).eqns}
    assert "pallas_call" in primitives  # BGMV on every ServingPlan
    assert _pool_dots(fn, x, pool["a"].shape[0]) == []
    assert _pool_dots(lambda x: lora_delta(x, pool, plan, "onehot"), x, pool["a"].shape[0])  # the check bites


def test_hybrid_grouped_projections_of_a_stacked_pool_equal_the_reference(small_window):
    """The engine's call: q/k/v-like projections of one input with a `StackedModulePool` (every
    layer's stack and a layer index) on a mixed plan whose prefill segments overflow the window."""
    from jaxlora.lora.ops import StackedModulePool

    rng = np.random.default_rng(7)
    rows, segments = HYBRID_STEPS["more_segments_than_the_window"]
    token_slot, plan = step_plan(rows, num_segments=segments)
    x = jnp.asarray(rng.normal(size=(token_slot.size, IN_DIM)), jnp.float32)
    layers, layer = 3, 1
    stacks = [[random_pool(rng) for _ in range(layers)] for _ in range(3)]
    pools = [StackedModulePool(*(jnp.stack([p[key] for p in stack]) for key in ("a", "b", "scale", "rank")),
                               layer=jnp.int32(layer)) for stack in stacks]
    ys = [jnp.asarray(rng.normal(size=(token_slot.size, OUT_DIM)), jnp.float32) for _ in stacks]
    got = jax.jit(lambda ys, x: backends.get("hybrid").accumulate_group(ys, x, pools, plan))(ys, x)
    for y, out, stack in zip(ys, got, stacks):
        expected = np.asarray(y) + np.asarray(lora_delta(x, stack[layer], build_plan(token_slot), "gather"))
        assert relative_error(out, expected) <= 1e-5


def test_mixed_plan_lists_its_one_token_adapter_rows_within_the_bound():
    token_slot, one_token = ordered_tokens(STEPS["mixed"], 32)
    plan = build_serving_plan(token_slot, one_token, 4, bgmv_rows=6)
    assert list(plan.decode_rows) == [15, 16, 17, 32, 32, 32]  # the decode_slot >= 0 rows, then N
    assert np.array_equal(np.flatnonzero(plan.decode_slot >= 0), plan.decode_rows[:3])
    with pytest.raises(ValueError, match="exceed the step's bound of 2"):
        build_serving_plan(token_slot, one_token, 4, bgmv_rows=2)
    decode_slot, decode_one = ordered_tokens(STEPS["decode_only"], 32)
    assert build_serving_plan(decode_slot, decode_one, 0, bgmv_rows=6).decode_rows is None  # all rows: BGMV's


@pytest.mark.parametrize("backend", ["hybrid", "pallas_gpu"])
@pytest.mark.parametrize("step", ["mixed", "several_segments_with_base_rows", "empty_segments",
                                  "one_segment_no_decode_rows"])
def test_bgmv_over_the_listed_rows_equals_the_reference(step, backend):
    """A mixed plan with `decode_rows` (the engine's when a step has more tokens than rows): BGMV
    runs on those rows only, gathered and written back; hybrid's window holds every segment."""
    rows, segments = HYBRID_STEPS.get(step, (STEPS.get(step), 4))
    rng = np.random.default_rng(zlib.crc32(f"listed {step} {backend}".encode()))
    pool = random_pool(rng)
    token_slot, one_token = ordered_tokens(rows, 40)
    plan = build_serving_plan(token_slot, one_token, segments, bgmv_rows=8)
    x = rng.normal(size=(token_slot.size, IN_DIM)).astype(np.float32)
    got = np.asarray(lora_delta(x, pool, plan, backend))
    reference = np.asarray(lora_delta(x, pool, build_plan(token_slot), "gather"))
    assert np.abs(reference).max() > 0.1
    assert np.all(got[token_slot < 0] == 0.0)
    assert relative_error(got, reference) <= 1e-5


def test_hybrid_adds_in_the_outputs_dtype():
    """hybrid on a mixed and on a decode-only plan leaves bfloat16 projection outputs in bfloat16
    (the LoRA added in it, as PEFT does) within bf16 rounding of the float32 sum; float32 outputs
    stay float32."""
    rng = np.random.default_rng(11)
    rows, segments = HYBRID_STEPS["several_segments_with_base_rows"]
    token_slot, one_token = ordered_tokens(rows, 40)
    plan = build_serving_plan(token_slot, one_token, segments, bgmv_rows=8)
    pool = random_pool(rng)
    x = jnp.asarray(rng.normal(size=(token_slot.size, IN_DIM)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(token_slot.size, OUT_DIM)), jnp.float32)
    expected = np.asarray(y) + np.asarray(lora_delta(x, pool, build_plan(token_slot), "gather"))
    hybrid = backends.get("hybrid")
    out32 = hybrid.accumulate(y, x, pool, plan)
    out16 = hybrid.accumulate(y.astype(jnp.bfloat16), x, pool, plan)
    assert out32.dtype == jnp.float32 and relative_error(out32, expected) <= 1e-5
    assert out16.dtype == jnp.bfloat16 and relative_error(out16.astype(jnp.float32), expected) <= 1e-2
    decode = build_serving_plan(token_slot[token_slot >= 0][-4:], np.ones(4, bool), 0)
    y4 = y[:4].astype(jnp.bfloat16)
    decode16 = hybrid.accumulate(y4, x[:4], pool, decode)
    expected4 = np.asarray(y[:4]) + np.asarray(lora_delta(x[:4], pool, build_plan(decode.token_slot), "gather"))
    assert decode16.dtype == jnp.bfloat16 and relative_error(decode16.astype(jnp.float32), expected4) <= 1e-2
    assert hybrid.for_plan(plan).adds_in_input_dtype and hybrid.for_plan(decode).adds_in_input_dtype
    assert not backends.get("pallas").adds_in_input_dtype  # a training backend adds in float32


def paged_module_pool(pool, rng):
    """The padded pool `pool` as a one-layer `PagedModulePool`: each slot's rank rows at shuffled
    rows of the row pools (as after frees), table entries past the rank pointing anywhere."""
    from jaxlora.lora.paged_ops import PagedModulePool

    a, b, rank = np.asarray(pool["a"]), np.asarray(pool["b"]), np.asarray(pool["rank"])
    slots = a.shape[0]
    order = rng.permutation(slots * MAX_RANK)
    table = order.reshape(slots, MAX_RANK).astype(np.int32)
    a_rows = np.zeros((slots * MAX_RANK, IN_DIM), np.float32)
    b_rows = np.zeros((slots * MAX_RANK, OUT_DIM), np.float32)
    for s in range(slots):
        a_rows[table[s]] = a[s].T
        b_rows[table[s]] = b[s]
        table[s, rank[s]:] = rng.integers(0, slots * MAX_RANK, MAX_RANK - rank[s])
    return PagedModulePool(jnp.asarray(a_rows)[None], jnp.asarray(b_rows)[None], jnp.asarray(table)[None],
                           jnp.asarray(rank)[None], pool["scale"][None], jnp.int32(0))


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("step", ["mixed", "single_prefill", "single_decode", "base_only",
                                  "more_adapters_than_segments"])
def test_tail_segments_over_a_paged_pool_equal_the_reference(step, impl):
    """The engine's unified-paging plan: the paged SGMV pair alone (2 kernels, none of BGMV's)
    gives the reference's result, as the plan with BGMV rows does with its 4."""
    rng = np.random.default_rng(zlib.crc32(f"tail {step} {impl}".encode()))
    pool = random_pool(rng)
    paged = paged_module_pool(pool, rng)
    token_slot, one_token = ordered_tokens(STEPS[step], 40)
    tail = build_serving_plan(token_slot, one_token, 32, bgmv_rows=16, tail_segments=True)
    bgmv = build_serving_plan(token_slot, one_token, 4, bgmv_rows=16)
    x = jnp.asarray(rng.normal(size=(token_slot.size, IN_DIM)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(token_slot.size, OUT_DIM)), jnp.float32)
    expected = np.asarray(y) + np.asarray(lora_delta(x, pool, build_plan(token_slot), "gather"))
    backend = backends.get(impl)
    assert backend.tail_segments and not backends.get("hybrid").tail_segments
    got = np.asarray(backend.accumulate(y, x, paged, tail))
    assert relative_error(got, expected) <= 1e-5
    np.testing.assert_array_equal(got[token_slot < 0], np.asarray(y)[token_slot < 0])
    if impl == "pallas_gpu" and step != "base_only":
        kernels = lambda plan: sum(e.primitive.name == "pallas_call" for e in jax.make_jaxpr(
            lambda y, x: backend.accumulate(y, x, paged, plan))(y, x).eqns)
        assert (kernels(tail), kernels(bgmv)) == (2, 4)
