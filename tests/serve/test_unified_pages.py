"""Unified paging (jaxlora/scheduler/serving/unified.py): KV blocks and adapters of different ranks
in one page budget. A randomized sequence of allocations, frees, adapter loads, uses and removals is
checked against a model after every operation (every page owned by exactly one of free / KV /
one adapter, nothing leaked, success exactly when the model says it fits, no adapter in use ever
evicted); rank 8 takes a quarter of rank 32's pages; idle adapters go before KV runs short."""

import random

import pytest

from jaxlora.scheduler.serving.unified import UnifiedPages, adapter_pages

PAGE_BYTES = 4096
RANK_ROW_BYTES = 1024  # one rank's A and B rows over every module and layer: 4 ranks fill a page


def _pages(rank: int) -> int:
    return adapter_pages(rank * RANK_ROW_BYTES, PAGE_BYTES)


def test_rank_8_takes_a_quarter_of_rank_32():
    assert (_pages(8), _pages(32)) == (2, 8)
    pool = UnifiedPages(16, page_size=16)
    assert len(pool.add_adapter("r8", _pages(8))) * 4 == len(pool.add_adapter("r32", _pages(32)))
    assert pool.adapter_pages_used == 10 and pool.num_free == 6
    assert adapter_pages(1, PAGE_BYTES) == 1 and adapter_pages(PAGE_BYTES + 1, PAGE_BYTES) == 2


def test_kv_evicts_idle_adapters_first_and_never_one_in_use():
    used = {"busy"}
    pool = UnifiedPages(10, page_size=16, in_use=lambda key: key in used)
    pool.add_adapter("old", 3)
    pool.add_adapter("busy", 3)
    pool.add_adapter("new", 2)
    assert pool.num_free == 2 and pool.can_allocate(7) and not pool.can_allocate(8)
    kv = pool.allocate(5)  # needs 3 more: "old" (least recently used, idle) goes, not "busy"
    assert pool.evicted == ["old"] and pool.holds("busy") and pool.holds("new") and len(kv) == 5
    with pytest.raises(ValueError, match="pages requested"):
        pool.allocate(4)  # 0 free + "new"'s 2: not enough; nothing changes
    assert pool.holds("new") and pool.kv_pages == 5
    assert pool.add_adapter("wide", 4) is None  # would need "busy"'s pages
    with pytest.raises(ValueError, match="in use"):
        pool.remove_adapter("busy")
    used.clear()
    assert len(pool.add_adapter("wide", 4)) == 4 and pool.evicted == ["old", "busy", "new"]
    pool.free(kv)
    assert pool.num_free == 6 and pool.kv_pages == 0


def _check(pool: UnifiedPages, model: dict, num_pages: int, in_use: set) -> None:
    """Every page and every row in exactly one place; the pool's view equals the model's."""
    row_owners = {row: "free" for row in pool._free_rows}
    for key, rows in pool._rows.items():
        assert not set(rows) & set(row_owners) and len(set(rows)) == len(rows)
        row_owners.update(dict.fromkeys(rows, key))
    assert sorted(row_owners) == list(range(pool.num_rows))
    assert {key: len(rows) for key, rows in pool._rows.items() if rows} == model["rows"]
    owners = {}
    for page in pool._free:
        assert page not in owners
        owners[page] = "free"
    for page in pool._kv:
        assert page not in owners
        owners[page] = "kv"
    for key, pages in pool._adapters.items():
        for page in pages:
            assert page not in owners
            owners[page] = key
    assert sorted(owners) == list(range(num_pages))
    assert {key: len(pages) for key, pages in pool._adapters.items()} == model["adapters"]
    assert sorted(p for pages in model["seqs"].values() for p in pages) == sorted(pool._kv)
    assert in_use <= set(model["adapters"])


@pytest.mark.parametrize("seed,num_rows", [(seed, 0) for seed in range(5)] + [(seed, 48) for seed in range(5)])
def test_randomized_allocations_match_the_model(seed, num_rows):
    """num_rows > 0: adapters also take their rank in device rows (jaxlora.lora.rows), a second
    constraint that evicts idle adapters on its own."""
    rng = random.Random(seed)
    num_pages = 64
    in_use: set = set()
    pool = UnifiedPages(num_pages, page_size=16, in_use=lambda key: key in in_use, num_rows=num_rows)
    model = {"seqs": {}, "adapters": {}, "lru": [], "rows": {}}  # lru: resident adapter keys, least recent first
    ops = {"kv": 0, "kv_refused": 0, "adapter": 0, "adapter_refused": 0, "evicted": 0}

    def idle(keep=(), kind="adapters"):
        return sum(n for key, n in model[kind].items() if key not in in_use and key not in keep)

    def free_rows():
        return num_rows - sum(model["rows"].values())

    def evict_for(count, rows=0):
        free = num_pages - sum(model["adapters"].values()) - sum(len(p) for p in model["seqs"].values())
        rows_free = free_rows()
        gone = []
        for key in list(model["lru"]):
            if free >= count and rows_free >= rows:
                break
            if key not in in_use:
                free += model["adapters"].pop(key)
                rows_free += model["rows"].pop(key, 0)
                model["lru"].remove(key)
                gone.append(key)
        return gone

    for step in range(600):
        free = num_pages - sum(model["adapters"].values()) - sum(len(p) for p in model["seqs"].values())
        op = rng.random()
        pool.evicted.clear()
        if op < 0.3:  # a sequence's KV pages
            count = rng.randint(1, 12)
            fits = count <= free + idle()
            assert pool.can_allocate(count) == fits
            if fits:
                gone = evict_for(count)
                model["seqs"][step] = pool.allocate(count)
                assert pool.evicted == gone and len(model["seqs"][step]) == count
                ops["kv"] += 1
                ops["evicted"] += len(gone)
            else:
                with pytest.raises(ValueError):
                    pool.allocate(count)
                ops["kv_refused"] += 1
        elif op < 0.5 and model["seqs"]:  # a sequence finishes
            pool.free(model["seqs"].pop(rng.choice(sorted(model["seqs"]))))
        elif op < 0.75:  # an adapter of rank 8, 16 or 32 is loaded (or used again)
            key = rng.randrange(12)
            rank = {0: 8, 1: 16, 2: 32}[key % 3]  # an adapter keeps its rank
            count, rows = _pages(rank), rank if num_rows else 0
            if key in model["adapters"]:
                assert pool.add_adapter(key, count, rows) is not None
                model["lru"].remove(key)
                model["lru"].append(key)
            elif count <= free + idle(keep=(key,)) and rows <= free_rows() + idle((key,), "rows"):
                gone = evict_for(count, rows)
                assert len(pool.add_adapter(key, count, rows)) == count and pool.evicted == gone
                assert len(pool.rows_of(key)) == rows
                model["adapters"][key] = count
                if rows:
                    model["rows"][key] = rows
                model["lru"].append(key)
                ops["adapter"] += 1
                ops["evicted"] += len(gone)
            else:
                assert pool.add_adapter(key, count, rows) is None
                ops["adapter_refused"] += 1
        elif op < 0.9 and model["adapters"]:  # a request starts or stops using an adapter
            key = rng.choice(sorted(model["adapters"]))
            in_use.symmetric_difference_update({key})
        elif model["adapters"]:  # an idle adapter is unloaded
            key = rng.choice(sorted(model["adapters"]))
            if key in in_use:
                with pytest.raises(ValueError):
                    pool.remove_adapter(key)
            else:
                pool.remove_adapter(key)
                del model["adapters"][key]
                model["rows"].pop(key, None)
                model["lru"].remove(key)
        _check(pool, model, num_pages, in_use)
    assert min(ops.values()) > 0, ops  # every path was taken
    for pages in model["seqs"].values():
        pool.free(pages)
    in_use.clear()
    for key in list(model["adapters"]):
        pool.remove_adapter(key)
    assert pool.num_free == num_pages and pool.num_free_rows == num_rows  # nothing leaked


def test_rank_8_takes_a_quarter_of_rank_32s_rows_and_rows_free_exactly():
    """Device rows: exactly the rank (no max-rank padding); freed rows are reused, so a later adapter's
    rows are scattered (not contiguous); an adapter in use keeps its rows."""
    used = set()
    pool = UnifiedPages(64, page_size=16, in_use=lambda key: key in used, num_rows=48)
    pool.add_adapter("r8", _pages(8), rows=8)
    pool.add_adapter("r32", _pages(32), rows=32)
    assert len(pool.rows_of("r8")) * 4 == len(pool.rows_of("r32")) and pool.num_free_rows == 8
    pool.add_adapter("r4", _pages(4), rows=4)
    pool.remove_adapter("r8")  # its 8 rows free, between r4's and the never-used ones
    used.add("r32")
    pool.add_adapter("r16", _pages(16), rows=16)  # 8 + 4 free rows + idle "r4"'s 4: evicts "r4", not "r32"
    rows = pool.rows_of("r16")
    assert pool.evicted == ["r4"] and pool.holds("r32") and sorted(rows) != list(range(min(rows), min(rows) + 16))
    assert not set(rows) & set(pool.rows_of("r32")) and pool.num_free_rows == 0
    used.add("r16")  # every row now held by adapters in use: no room, nothing changes
    assert not pool.can_add("r8b", 1, 8) and pool.add_adapter("r8b", 1, rows=8) is None
    used.discard("r16")  # idle again: evicted for the newcomer, which gets rows from it
    assert set(pool.add_adapter("r8b", 1, rows=8) and pool.rows_of("r8b")) <= set(rows)
    with pytest.raises(ValueError, match="rows"):
        pool.add_adapter("huge", 1, rows=64)


def _finish_all(scheduler, seqs):
    for seq in seqs:
        scheduler.finish(seq, "stop")


def test_scheduler_admits_kv_and_adapters_from_one_budget():
    """The serving scheduler with unified paging: an adapter's pages count against KV room; a request
    that needs room evicts idle adapters (slots dropped with them), never one a running request uses,
    and waits when that is not enough."""
    from jaxlora.scheduler.serving import SchedulerConfig, Sequence, ServingScheduler

    scheduler = ServingScheduler(SchedulerConfig(num_pages=11, page_size=4, num_adapter_slots=3, max_num_seqs=8,
                                                 token_budget=64, prefill_chunk=16, unified_paging=True))
    scheduler.adapter_pages = {"r8": 2, "r32": 8, "r16": 4}.__getitem__
    first = Sequence("a", [1] * 4, 4, adapter="r8")  # 2 KV pages + 2 adapter pages
    second = Sequence("b", [1] * 4, 4, adapter="r32")  # 2 + 8 > 7 free while "a" runs
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [row.seq.seq_id for row in plan.rows] == ["a"] and scheduler.page_split() == {"kv": 2, "adapters": 2,
                                                                                         "free": 7}
    _finish_all(scheduler, [first])  # "r8" idle now: evicted to make room for "b"'s KV
    plan = scheduler.schedule()
    assert [row.seq.seq_id for row in plan.rows] == ["b"] and scheduler.slots.slot_of("r8") is None
    assert scheduler.page_split() == {"kv": 2, "adapters": 8, "free": 1}
    third = Sequence("c", [1] * 12, 4, adapter=None)  # 4 KV pages: 1 free and "r32" is in use
    scheduler.add(third)
    assert [row.seq.seq_id for row in scheduler.schedule().rows] == ["b"] and third in scheduler.waiting
    _finish_all(scheduler, [second])
    assert [row.seq.seq_id for row in scheduler.schedule().rows] == ["c"]  # KV evicted the idle "r32"
    assert scheduler.page_split() == {"kv": 4, "adapters": 0, "free": 7} and scheduler.slots.resident() == []


def test_engine_with_unified_paging_gives_the_same_answers(tiny_model_dir):
    """The engine over the tiny model, 6 adapters and a page budget too small for all of them and
    the KV at once: with unified paging idle adapters are evicted for KV (and loaded again), every
    request gets the same greedy tokens as with separate pools, and no page leaks."""
    from jaxlora.lora.adapter import random_adapter
    from jaxlora.lora.adapter_config import LoraConfig
    from jaxlora.sampling import SamplingParams
    from jaxlora.weights import load_model
    from serve.engine import Engine, EngineConfig

    model, tokenizer = load_model(tiny_model_dir)
    adapters = {f"u{i}": random_adapter(f"u{i}", model.config, LoraConfig(r=(4, 8)[i % 2], target_modules=(
        "q_proj", "v_proj")), seed=i, b_std=0.5) for i in range(6)}
    requests = [(tokenizer.encode(f"Request number {i} says"), f"u{i % 6}") for i in range(18)]
    answers = {}
    for unified in (False, True):
        config = EngineConfig(max_adapters_on_device=4, page_size=8, num_pages=12, max_model_len=64, max_num_seqs=8,
                              token_budget=32, prefill_chunk=16, max_lora_rank=8, unified_paging=unified,
                              lora_target_modules=("q_proj", "v_proj"))
        engine = Engine(model, tokenizer.eos_token_ids, config, adapters)
        evicted = []
        drop = engine.scheduler.slots.drop
        engine.scheduler.slots.drop = lambda key: evicted.append(key) or drop(key)
        got = {i: [] for i in range(len(requests))}
        for i, (prompt, name) in enumerate(requests):
            engine.submit(i, prompt, name, SamplingParams(6), lambda e, i=i: got[i].append(e.token))
        engine.run_until_idle()
        answers[unified] = [[t for t in got[i] if t is not None] for i in range(len(requests))]
        split = engine.scheduler.page_split()
        assert split["kv"] == 0 and split["free"] + split["adapters"] == 12
        if unified:
            assert evicted and split["adapters"] > 0  # KV made room by evicting idle adapters
    assert answers[True] == answers[False] and len({tuple(a) for a in answers[True]}) > 6


def test_resident_adapter_is_not_sized_again():
    """A request for an adapter already on the device reuses its pages: its size is not asked for
    (its host copy may be gone by then)."""
    from jaxlora.scheduler.serving import SchedulerConfig, Sequence, ServingScheduler

    scheduler = ServingScheduler(SchedulerConfig(num_pages=16, page_size=4, num_adapter_slots=2, max_num_seqs=4,
                                                 token_budget=64, prefill_chunk=16, unified_paging=True))
    asked = []
    scheduler.adapter_pages = lambda key: asked.append(key) or 3
    scheduler.add(Sequence("a", [1] * 4, 4, adapter="x"))
    scheduler.schedule()
    sized = len(asked)
    scheduler.add(Sequence("b", [1] * 4, 4, adapter="x"))
    assert len(scheduler.schedule().rows) == 2
    assert sized >= 1 and len(asked) == sized and scheduler.page_split()["adapters"] == 3


def _mixed_rank_adapters(config):
    """8 adapters of ranks 4, 8, 16, 32 (each twice), half on q/v only, half on every projection."""
    from jaxlora.lora.adapter import random_adapter
    from jaxlora.lora.adapter_config import LoraConfig
    from jaxlora.nn.model_config import PROJECTIONS

    return {f"m{i}": random_adapter(f"m{i}", config, LoraConfig(r=(4, 8, 16, 32)[i % 4], target_modules=(
        ("q_proj", "v_proj") if i < 4 else PROJECTIONS)), seed=10 + i, b_std=0.5) for i in range(8)}


def _serve(model, tokenizer, adapters, requests, **config):
    from jaxlora.sampling import SamplingParams
    from serve.engine import Engine, EngineConfig

    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(
        max_adapters_on_device=4, page_size=8, num_pages=96, max_model_len=64, max_num_seqs=8, token_budget=32,
        prefill_chunk=16, max_lora_rank=32, adapter_window=0, **config), adapters)
    got = {i: [] for i in range(len(requests))}
    for i, (prompt, name) in enumerate(requests):
        engine.submit(i, prompt, name, SamplingParams(5), lambda e, i=i: got[i].append(e))
    engine.run_until_idle()
    assert all(events[-1].finish_reason in ("length", "stop") for events in got.values())
    return engine, [[e.token for e in got[i] if e.token is not None] for i in range(len(requests))]


def test_adapters_in_device_rows_give_the_padded_pools_answers(tiny_model_dir):
    """Unified paging on the device (jaxlora.lora.rows): 8 adapters of ranks {4, 8, 16, 32} through
    48 device rows (a padded pool of 4 slots would need 128), so rows are evicted, freed and handed
    out again scattered; the greedy tokens (float32) equal the padded slots' with unified paging
    off. gather: the XLA delta over the rows gathered into slots; hybrid: the paged BGMV kernel
    (interpret mode) on one-token rows and the segment GEMM over rows gathered for prefill; pallas:
    the paged SGMV kernel on prefill chunks, paged BGMV on one-token rows; hybrid_xla: decode-only
    steps' LoRA in elementwise form over the rows read through the table."""
    from jaxlora.weights import load_model

    model, tokenizer = load_model(tiny_model_dir)
    adapters = _mixed_rank_adapters(model.config)
    requests = [(tokenizer.encode(f"Request {i} of the rows test"), f"m{(3 * i) % 8}") for i in range(10)]
    _, padded = _serve(model, tokenizer, adapters, requests, lora_backend="gather")
    assert len({tuple(a) for a in padded}) > 6
    for backend in ("gather", "hybrid", "pallas", "hybrid_xla"):
        engine, paged = _serve(model, tokenizer, adapters, requests, lora_backend=backend, unified_paging=True,
                               adapter_rows=48)
        assert paged == padded, backend
        _check_rows(engine)


def _check_rows(engine) -> None:
    """Resident adapters hold exactly their rank in rows; no row leaked; the row arrays are R rows."""
    pages = engine.scheduler.pages
    for name, rank in (("m0", 4), ("m1", 8), ("m2", 16), ("m3", 32)):  # resident ones hold exactly their rank
        uid = engine.adapters.resolve(name).uid
        if pages.holds(uid):
            assert len(pages.rows_of(uid)) == rank
    assert pages.num_free_rows + pages.adapter_rows_used == 48 and pages.adapter_rows_used <= 48
    assert engine.snapshot()["adapter_rows"] == {"used": pages.adapter_rows_used, "total": 48}  # /metrics
    assert engine.pool.row_bytes * 48 == sum(a.nbytes for m in engine.pool.arrays.values()
                                             for a in (m["a_rows"], m["b_rows"]))


def test_scheduler_places_adapters_by_rows_and_never_evicts_one_in_use():
    """With device rows (SchedulerConfig.adapter_rows) an adapter is placed only when its rank in rows
    is free or held by idle adapters: a rank-16 adapter waits while a running rank-32 one holds 32 of
    40 rows, and takes the rows once that one is idle; a rank-8 one fits beside the rank-32 one."""
    from jaxlora.scheduler.serving import SchedulerConfig, Sequence, ServingScheduler

    scheduler = ServingScheduler(SchedulerConfig(num_pages=64, page_size=4, num_adapter_slots=4, max_num_seqs=8,
                                                 token_budget=64, prefill_chunk=16, unified_paging=True,
                                                 adapter_rows=40))
    ranks = {"r32": 32, "r16": 16, "r8": 8}
    scheduler.adapter_pages = lambda key: 1
    scheduler.adapter_rows = ranks.__getitem__
    first, second, third = (Sequence(name, [1] * 4, 4, adapter=name) for name in ("r32", "r16", "r8"))
    for seq in (first, second, third):
        scheduler.add(seq)
    running = [row.seq.seq_id for row in scheduler.schedule().rows]
    assert running == ["r32", "r8"] and second in scheduler.waiting  # 32 + 16 > 40; 32 + 8 fits
    pages = scheduler.pages
    assert len(pages.rows_of("r32")) == 32 and len(pages.rows_of("r8")) == 8 and pages.num_free_rows == 0
    _finish_all(scheduler, [first])  # "r32" idle now: its rows go to "r16"
    assert "r16" in [row.seq.seq_id for row in scheduler.schedule().rows]
    assert not pages.holds("r32") and scheduler.slots.slot_of("r32") is None and pages.holds("r8")
    assert len(pages.rows_of("r16")) == 16 and pages.adapter_rows_used == 24


def test_engine_config_refuses_rows_it_cannot_serve():
    from serve.engine import EngineConfig

    for bad in ({"adapter_rows": 64}, {"unified_paging": True, "adapter_rows": 8, "max_lora_rank": 16},
                {"unified_paging": True, "inference_mode": "merged"},
                {"lora_target_modules": ("q_proj",), "inference_mode": "mixed"},
                {"lora_target_modules": ("qkv",)}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    EngineConfig(unified_paging=True, adapter_rows=16, max_lora_rank=16, lora_target_modules=("q_proj", "v_proj"))
