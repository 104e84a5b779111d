"""Prefix caching (issue 36; jaxlora.scheduler.serving.prefix): the policy alone (hits, roots,
reference counts, LRU eviction, unified paging), then a tiny random model's engine: greedy tokens
equal with the cache on and off (shared prefixes over mixed adapters, eviction under a small KV
budget, unified paging, a merged inference mode), no page shared across adapters or with an
adapter registered again with other weights, hits after an adapter comes back from the host or disk
tier, prompt log-probabilities computed in full, and the hit rate in the stats and /metrics."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.peft_io import save_peft_adapter
from jaxlora.models.llama import Llama
from jaxlora.models.presets import TINY
from jaxlora.sampling import SamplingParams
from jaxlora.scheduler.serving import PageAllocator, PrefixCache, SchedulerConfig, Sequence, ServingScheduler
from serve.engine import Engine, EngineConfig

PAGE = 8
SYSTEM = 3 * PAGE + 5  # a shared "system prompt" of three full blocks and a part


# ---- the policy alone -------------------------------------------------------------------------------
def _scheduler(**kw):
    config = dict(num_pages=16, page_size=4, num_adapter_slots=2, max_num_seqs=4, token_budget=32, prefill_chunk=32,
                  prefix_caching=True)
    config.update(kw)
    return ServingScheduler(SchedulerConfig(**config))


def _serve(scheduler, seq):
    """Runs `seq` alone to its end (token 1 sampled every step); returns its first row (start, count)."""
    scheduler.add(seq)
    first = None
    while seq.finish_reason is None:
        plan = scheduler.schedule()
        row = next(r for r in plan.rows if r.seq is seq)
        first = first or (row.start, row.count)
        scheduler.complete(plan, {r.seq.seq_id: 1 for r in plan.rows if r.sample})
    return first


def test_a_request_starts_after_its_cached_blocks_and_computes_its_last_token():
    s = _scheduler()
    prompt = list(range(10, 22))  # 12 tokens: three full blocks
    assert _serve(s, Sequence("a", prompt, 2)) == (0, 12)
    assert _serve(s, Sequence("b", prompt, 2)) == (8, 4)  # two blocks reused; the third holds the last token
    assert _serve(s, Sequence("c", prompt + [5], 2)) == (12, 1)  # all three reused
    assert _serve(s, Sequence("d", [9] + prompt[1:], 2)) == (0, 12)  # another first block: nothing
    stats = s.prefix.stats
    assert (stats.queries, stats.hits, stats.requests, stats.hit_requests) == (12 + 12 + 13 + 12, 8 + 12, 4, 2)
    assert s.pages.num_free == 16 and not s.running  # cached pages count as free


def test_a_finished_request_caches_its_output_blocks():
    """A chat's next turn (prompt + answer + more) reuses the answer's blocks too: those whose
    positions were computed (the last sampled token's is not)."""
    s = _scheduler()
    first = Sequence("a", [3, 1, 4, 1, 5, 9], 10)
    _serve(s, first)
    assert len(first.output) == 10 and s.prefix.num_registered == 3  # 15 positions computed: 3 blocks
    assert _serve(s, Sequence("b", first.prompt + first.output + [2, 6], 2)) == (12, 6)


def test_other_adapters_the_base_model_and_cache_prefix_false_never_hit():
    s = _scheduler()
    prompt = list(range(20, 33))
    _serve(s, Sequence("x", prompt, 1, adapter="x"))
    assert _serve(s, Sequence("y", prompt, 1, adapter="y")) == (0, 13)
    assert _serve(s, Sequence("base", prompt, 1)) == (0, 13)
    assert _serve(s, Sequence("scored", prompt, 1, adapter="x", cache_prefix=False)) == (0, 13)
    assert _serve(s, Sequence("x2", prompt, 1, adapter="x")) == (12, 1)
    s.prefix_root = lambda key: (key, "merged")  # another numerics tag: another chain
    assert _serve(s, Sequence("x3", prompt, 1, adapter="x")) == (0, 13)


def test_shared_pages_are_counted_and_the_least_recently_used_evicted_first():
    cache = PrefixCache(PageAllocator(6, 4), 4)
    a, b = cache.allocate(2), cache.allocate(2)
    assert cache.register(a[0], b"a0") and cache.register(a[1], b"a1") and cache.register(b[0], b"b0")
    assert not cache.register(b[1], b"a0")  # one page per digest: b[1] stays private
    cache.acquire(cache.lookup([b"a0", b"a1", b"zz"]))  # a second holder of a's two pages
    cache.free(a)
    assert cache.num_cached == 0 and cache.num_free == 2  # still held by the second sequence
    cache.free(b)  # b[0] cached (unreferenced), b[1] back to the pool
    cache.free(a)  # the second holder lets go: a[1] then a[0] join the LRU (a chain's tail first)
    assert cache.num_cached == 3 and cache.num_free == 6
    assert not cache.can_allocate(6, keep=[a[0]]) and cache.can_allocate(5, keep=[a[0]])
    taken = cache.allocate(5, keep=[a[0]])  # 3 free + b[0], a[1] evicted (oldest first); a[0] kept
    assert b[0] in taken and a[1] in taken and cache.lookup([b"a0", b"a1"]) == [a[0]] and cache.stats.evictions == 2
    cache.acquire([a[0]])
    cache.forget()  # a held page is detached: freed when its holder lets go
    assert cache.lookup([b"a0"]) == [] and cache.num_free == 0
    cache.free([a[0]] + taken)
    assert cache.num_free == 6 and cache.pool.num_free == 6


def test_unified_paging_evicts_cached_blocks_before_idle_adapters_and_for_an_adapter():
    s = _scheduler(num_pages=10, unified_paging=True, num_adapter_slots=4)
    s.adapter_pages = lambda key: 3
    _serve(s, Sequence("a", list(range(40, 52)), 1, adapter="x"))  # 3 KV pages + 3 of adapter x
    assert s.pages.num_cached == 3 and s.pages.holds("x")
    _serve(s, Sequence("b", list(range(60, 64)), 1))  # 2 pages: free ones, nothing evicted
    assert s.pages.num_cached == 4 and s.pages.holds("x") and s.prefix.stats.evictions == 0
    _serve(s, Sequence("c", list(range(70, 83)), 4))  # 5 pages: 3 free + 2 cached; adapter x stays
    assert s.prefix.stats.evictions == 2 and s.pages.holds("x") and s.pages.num_cached == 6
    s.adapter_pages = lambda key: 6
    _serve(s, Sequence("d", [1, 2], 1, adapter="y"))  # y's 6 + 1 KV page: 1 free + 6 cached; idle x stays
    assert s.pages.holds("y") and s.pages.holds("x") and s.pages.num_cached == 0
    s.adapter_pages = lambda key: 2
    _serve(s, Sequence("e", [1, 2], 1, adapter="z"))  # z's 2 + 1 KV page: 1 free, then idle x (LRU)
    assert s.pages.holds("z") and not s.pages.holds("x") and s.pages.num_cached == 0


# ---- the engine on a tiny random model ---------------------------------------------------------------
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def tiny():
    """(model, {name: adapter}): the tiny Llama shape in float32, random weights; 4 adapters whose
    B is large enough to change greedy tokens."""
    model = Llama(TINY, rngs=nnx.Rngs(0), dtype=jnp.float32)
    return model, {f"a{i}": _adapter(f"a{i}", i) for i in range(4)}


def _adapter(name, seed):
    return random_adapter(name, TINY, LORA, seed=seed, b_std=0.5)


def _prompts(count, adapters, seed=0, system=SYSTEM):
    """(prompt, adapter) pairs: a system prompt per adapter (the base model: None) and a short tail."""
    rng = np.random.default_rng(seed)
    systems = {name: rng.integers(1, TINY.vocab_size, system).tolist() for name in adapters}
    return [(systems[name] + rng.integers(1, TINY.vocab_size, int(rng.integers(1, 12))).tolist(), name)
            for name in (adapters[i % len(adapters)] for i in range(count))]


def _engine(model, adapters, prefix=True, **kw):
    config = dict(page_size=PAGE, num_pages=64, max_model_len=96, max_num_seqs=8, token_budget=64,
                  prefill_chunk=16, max_lora_rank=4, prefix_caching=prefix)
    config.update(kw)
    return Engine(model, (), EngineConfig(**config), adapters)


def _serve_waves(engine, requests, waves=2, sampling=SamplingParams(6)):
    """Greedy tokens of each request, submitted in `waves` waves (each run to idle)."""
    got = {i: [] for i in range(len(requests))}
    size = -(-len(requests) // waves)
    for start in range(0, len(requests), size):
        for i in range(start, min(start + size, len(requests))):
            prompt, name = requests[i]
            engine.submit(i, prompt, name, sampling, lambda e, i=i: got[i].append(e))
        engine.run_until_idle()
    for events in got.values():
        assert events[-1].finish_reason == "length", events[-1]
    return [[e.token for e in got[i] if e.token is not None] for i in range(len(requests))]


def _on_and_off(model, adapters, requests, **kw):
    """(tokens with the cache off, tokens with it on, the cache-on engine's prefix counts)."""
    off = _serve_waves(_engine(model, adapters, prefix=False, **kw), requests)
    engine = _engine(model, adapters, **kw)
    on = _serve_waves(engine, requests)
    return off, on, engine.snapshot()["prefix_cache"]


def test_shared_prefixes_over_mixed_adapters_give_the_same_tokens(tiny):
    model, adapters = tiny
    requests = _prompts(20, ["a0", "a1", None, "a2"])
    off, on, cache = _on_and_off(model, adapters, requests)
    assert on == off and len({tuple(t) for t in off}) > 10  # adapters and tails change the tokens
    assert cache["hit_requests"] >= 15 and cache["hit_rate"] > 0.5 and cache["evictions"] == 0


def test_a_second_turn_reuses_the_first_answer(tiny):
    """Turn two's prompt is turn one's prompt, its answer and a new tail: the answer's blocks
    (computed by decode steps) are reused, and the tokens equal the cache-off engine's."""
    model, adapters = tiny
    first = _prompts(2, ["a1", None], seed=11)

    def turns(engine):
        answers = _serve_waves(engine, first, waves=1, sampling=SamplingParams(20))
        second = [(prompt + answer + [7, 8, 9], name) for (prompt, name), answer in zip(first, answers)]
        return answers, _serve_waves(engine, second, waves=1, sampling=SamplingParams(20))

    engine = _engine(model, adapters)
    assert turns(engine) == turns(_engine(model, adapters, prefix=False))
    blocks = sum((len(prompt) + 19) // PAGE for prompt, _ in first)  # prompt + 19 computed answer positions
    assert engine.stats.prefix_cache_hits == blocks * PAGE


@pytest.mark.parametrize("grow", [False, True])
def test_eviction_under_a_small_kv_budget_gives_the_same_tokens(tiny, grow):
    """A pool of 14 pages (two sequences): cached blocks are evicted for new ones; with pages that
    grow with the output (`reserve_output_kv=False`) running requests are preempted too, and
    recomputed after their own cached blocks."""
    model, adapters = tiny
    requests = _prompts(16, ["a0", "a1", "a2", "a3"], seed=1)
    sizes = dict(num_pages=14, max_num_seqs=4 if grow else 2, reserve_output_kv=not grow)
    off, on, cache = _on_and_off(model, adapters, requests, **sizes)
    assert on == off and cache["evictions"] > 0 and cache["hits"] > 0
    assert cache["requests"] == len(requests) + grow  # grown: one request preempted and admitted again


def test_unified_paging_with_the_cache_gives_the_same_tokens(tiny):
    model, adapters = tiny
    requests = _prompts(12, ["a0", "a1", "a2"], seed=2)
    off, on, cache = _on_and_off(model, adapters, requests, num_pages=36, unified_paging=True,
                                 max_adapters_on_device=2)  # 8 pages an adapter: KV, cache and adapters trade
    assert on == off and cache["hits"] > 0 and cache["evictions"] > 0


def test_a_prefix_cached_under_another_adapter_is_recomputed(tiny):
    model, adapters = tiny
    prompt = _prompts(1, ["a0"], seed=3)[0][0]
    requests = [(prompt, "a0"), (prompt, "a1"), (prompt, None), (prompt, "a0")]
    engine = _engine(model, adapters)
    on = _serve_waves(engine, requests, waves=4)
    assert on == _serve_waves(_engine(model, adapters, prefix=False), requests, waves=4)
    assert on[0] == on[3] and len({tuple(t) for t in on[:3]}) == 3
    blocks = (len(prompt) - 1) // PAGE * PAGE
    assert engine.stats.prefix_cache_hits == blocks and engine.snapshot()["prefix_cache"]["hit_requests"] == 1


def test_an_adapter_registered_again_with_new_weights_is_recomputed(tiny):
    """a0 is removed and registered again with other weights while a request of the old one still
    runs (its cached blocks are kept until it ends): a request of the new a0 reuses none of them."""
    model, adapters = tiny
    prompt = _prompts(1, ["a0"], seed=4)[0][0]
    engine = _engine(model, {"a0": adapters["a0"]})
    old = []
    engine.submit("old", prompt, "a0", SamplingParams(12), old.append)
    for _ in range(4):  # its prompt (three chunks) is computed and its blocks cached
        engine.step()
    assert engine.snapshot()["prefix_cache"]["cached_pages"] == len(prompt) // PAGE and old
    engine.remove_adapter("a0")
    fresh = _adapter("a0", 99)
    engine.add_adapter("a0", fresh)
    new = _serve_waves(engine, [(prompt, "a0")], waves=1)
    assert engine.stats.prefix_cache_hits == 0 and old[-1].finish_reason == "length"
    assert new[0] != [e.token for e in old][:6]
    assert new == _serve_waves(_engine(model, {"a0": fresh}, prefix=False), [(prompt, "a0")], waves=1)


def test_an_adapter_evicted_from_the_device_and_host_still_hits(tiny, tmp_path):
    """One device slot and one host copy: a0, a1, a0 from the adapter directory reads a0 from disk
    twice; its blocks are keyed by its registration, so the third request reuses them."""
    model, adapters = tiny
    for name in ("a0", "a1"):
        save_peft_adapter(adapters[name], str(tmp_path / name))
    prompt = _prompts(1, ["a0"], seed=5)[0][0]
    requests = [(prompt, "a0"), (prompt, "a1"), (prompt, "a0")]
    engine = _engine(model, {}, adapter_dir=str(tmp_path), max_adapters_on_device=1, max_host_adapters=1)
    on = _serve_waves(engine, requests, waves=3)
    assert engine.adapters.stats.disk_reads == 3 and engine.stats.adapter_loads == 3
    assert engine.snapshot()["prefix_cache"]["hit_requests"] == 1 and on[0] == on[2]
    off = _engine(model, {}, prefix=False, adapter_dir=str(tmp_path), max_adapters_on_device=1, max_host_adapters=1)
    assert on == _serve_waves(off, requests, waves=3)


def test_prompt_logprobs_compute_every_position(tiny):
    """A request asking for prompt log-probabilities reuses nothing (each position's logits are
    computed); its entries equal those of an engine without the cache."""
    model, adapters = tiny
    prompt = _prompts(1, ["a1"], seed=6)[0][0]

    def scored(engine):
        events = []
        engine.submit("warm", prompt, "a1", SamplingParams(2), lambda e: None)
        engine.run_until_idle()
        engine.submit("s", prompt, "a1", SamplingParams(2, prompt_logprobs=1), events.append)
        engine.run_until_idle()
        return events[0].prompt_logprobs

    cached = _engine(model, adapters)
    entries = scored(cached)
    assert len(entries) == len(prompt) - 1 and cached.snapshot()["prefix_cache"]["hit_requests"] == 0
    reference = scored(_engine(model, adapters, prefix=False))
    assert [e[0] for e in entries] == [e[0] for e in reference]
    np.testing.assert_allclose([e[1] for e in entries], [e[1] for e in reference], atol=1e-5)


def test_a_merged_inference_mode_keys_blocks_by_its_numerics(tiny):
    """Merged mode: a0's rows run on the merged weights; the tokens equal the cache-off engine's and
    blocks are keyed by the mode (`EngineModes.prefix_root`)."""
    model, adapters = tiny
    requests = _prompts(6, ["a0"], seed=7)
    off, on, cache = _on_and_off(model, adapters, requests, inference_mode="merged")
    assert on == off and cache["hits"] > 0
    modes = _engine(model, adapters, inference_mode="auto").modes
    assert modes.prefix_root(1) == (1, "unmerged")
    modes.mode = type(modes.mode)("mixed", 1)
    assert modes.prefix_root(1) == (1, "merged", 1) and modes.prefix_root(None) == (None, "branch", 1)


def test_hit_rate_in_metrics_and_no_prefix_caching_option(tiny):
    from serve.cli import build_parser, engine_config
    from serve.metrics import Metrics

    model, adapters = tiny
    engine = _engine(model, adapters)
    _serve_waves(engine, _prompts(4, ["a0"], seed=8))
    text = Metrics(engine).render().decode()
    rate = engine.snapshot()["prefix_cache"]["hit_rate"]
    assert rate > 0.3 and f"jaxlora_prefix_cache_hit_rate {rate}" in text
    assert 'jaxlora_prefix_cache_requests{kind="hit"} 2.0' in text  # the second wave's two requests
    args = build_parser().parse_args(["--lora-backend", "gather"])
    assert engine_config(args, 16, 2048, None).prefix_caching
    args = build_parser().parse_args(["--no-prefix-caching", "--lora-backend", "gather"])
    assert not engine_config(args, 16, 2048, None).prefix_caching


def test_replicas_cache_their_own_pages_and_report_the_sum(tiny):
    from serve.replicas import ReplicaSet

    model, adapters = tiny
    requests = _prompts(12, ["a0", "a1", None], seed=9)
    front = ReplicaSet([_engine(model, adapters), _engine(model, adapters)])
    assert _serve_waves(front, requests) == _serve_waves(_engine(model, adapters, prefix=False), requests)
    cache = front.snapshot()["prefix_cache"]
    engines = [engine.snapshot()["prefix_cache"] for engine in front.engines]
    assert cache["hits"] == sum(c["hits"] for c in engines) > 0 and cache["hit_rate"] == cache["hits"] / cache["queries"]


def test_a_failed_step_empties_the_cache(tiny):
    """The failed step's KV writes are unknown: every cached block is dropped, and the next request
    computes its whole prompt (the same tokens as without the cache)."""
    model, adapters = tiny
    prompt = _prompts(1, ["a2"], seed=10)[0][0]
    engine = _engine(model, adapters)
    _serve_waves(engine, [(prompt, "a2")], waves=1)
    assert engine.snapshot()["prefix_cache"]["cached_pages"] > 0

    def broken(step, cache):
        raise RuntimeError("device lost")

    step_fn, engine.step_fn = engine.step_fn, broken
    failed = []
    engine.submit("x", prompt, "a2", SamplingParams(2), failed.append)
    engine.run_until_idle()
    assert failed[-1].finish_reason == "error" and engine.snapshot()["prefix_cache"]["cached_pages"] == 0
    engine.step_fn = step_fn
    hits = engine.stats.prefix_cache_hits  # "x" was admitted with hits before its step failed
    assert _serve_waves(engine, [(prompt, "a2")], waves=1) == _serve_waves(_engine(model, adapters, prefix=False),
                                                                             [(prompt, "a2")], waves=1)
    assert engine.stats.prefix_cache_hits == hits
