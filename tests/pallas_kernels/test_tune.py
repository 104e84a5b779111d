"""The offline tile profiler's plumbing on CPU (kernels in interpret mode, tiny shapes)."""

import dataclasses

import jax
import pytest

from pallas_kernels import tune
from pallas_kernels.tiles import get_tile_config, heuristic_tiles


@pytest.mark.parametrize("op", tune.OPS)
def test_candidates_are_legal_and_distinct(op):
    bucket = tune.Bucket(op, 64, 4096, 16)
    seeds = tune.seed_candidates(bucket)
    assert seeds[0] == tune.legal(bucket, heuristic_tiles(op, *bucket.dims, "gpu"))
    assert len(set(seeds)) == len(seeds) >= 4
    for cfg in seeds + tune.neighbor_candidates(bucket, seeds[0]):
        assert cfg == tune.legal(bucket, cfg)  # fitting is idempotent
        assert cfg.rank_chunk <= 16 and cfg.block_k <= 4096
        if not op.endswith("shrink"):
            assert cfg.k_splits == 1
    neighbors = tune.neighbor_candidates(bucket, seeds[0])
    assert neighbors and seeds[0] not in neighbors
    assert all(sum(getattr(n, f.name) != getattr(seeds[0], f.name)
                   for f in dataclasses.fields(n)) <= 2 for n in neighbors)


def test_default_plan_covers_the_bench_shapes():
    keys = {(b.op, b.key) for b in tune.default_plan(4096)}
    assert ("sgmv_shrink", "4096x4096x16") in keys and ("sgmv_expand", "8192x64x4096") in keys
    assert ("bgmv_shrink", "64x4096x16") in keys and ("bgmv_expand", "1x16x4096") in keys


def test_tune_writes_winners_keyed_by_device(tmp_path):
    plan = [tune.Bucket("sgmv_shrink", 32, 64, 16), tune.Bucket("sgmv_expand", 32, 64, 16),
            tune.Bucket("bgmv_shrink", 2, 64, 16), tune.Bucket("bgmv_expand", 2, 64, 16)]
    table = {"Other GPU": {"sgmv_shrink": {"1x1x1": {"block_rows": 16}}}}
    log = []
    table = tune.tune(plan, table, time_budget=1e4, jobs=1, log=log, max_candidates=2,
                      trials=1, sets=2, steps=4)
    kind = jax.devices()[0].device_kind
    assert table["Other GPU"] == {"sgmv_shrink": {"1x1x1": {"block_rows": 16}}}  # kept
    for bucket in plan:
        entry = table[kind][bucket.op][bucket.key]
        assert entry["us"] > 0
        cfg = get_tile_config(kind, bucket.op, *bucket.dims, "gpu", table)
        assert cfg == tune.legal(bucket, cfg)
    assert log and not [e for e in log if "error" in e], log
    path = tmp_path / "table.json"
    tune.write_table(table, path)
    assert path.read_text().startswith("{")
