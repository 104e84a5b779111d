"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serve.replicas import server_state

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Gauges read from the engine (or replica set: per-replica load too) at scrape time; counters
    and latency histograms from handlers."""

    def __init__(self, engine):
        self.engine = engine
        self.registry = registry = CollectorRegistry()
        self.running = Gauge("jaxlora_requests_running", "Sequences in the running batch", registry=registry)
        self.waiting = Gauge("jaxlora_requests_waiting", "Sequences waiting for admission", registry=registry)
        self.adapters_on_device = Gauge("jaxlora_adapters_on_device", "Adapters in device slots", registry=registry)
        self.adapters_known = Gauge("jaxlora_adapters_known", "Adapters registered (at start, loaded, or "
                                    "requested from the adapter directory)", registry=registry)
        self.free_pages = Gauge("jaxlora_kv_pages_free", "Free KV-cache pages", registry=registry)
        self.total_pages = Gauge("jaxlora_kv_pages_total", "KV-cache pages", registry=registry)
        self.tokens_per_second = Gauge("jaxlora_generation_tokens_per_second",
                                       "Generated tokens per second over the last 10 s", registry=registry)
        self.requests = Counter("jaxlora_requests", "Finished HTTP generation requests",
                                ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("jaxlora_prompt_tokens", "Prompt tokens submitted", registry=registry)
        self.generation_tokens = Counter("jaxlora_generation_tokens", "Tokens generated", registry=registry)
        self.adapter_loads = Gauge("jaxlora_adapter_device_loads", "Adapter copies into device slots so far",
                                   registry=registry)
        self.adapters_on_host = Gauge("jaxlora_adapters_on_host", "Adapters in the host cache (and held ones)",
                                      registry=registry)
        self.adapters_on_disk = Gauge("jaxlora_adapters_on_disk", "Adapter folders in the adapter directory",
                                      registry=registry)
        self.host_bytes = Gauge("jaxlora_adapter_host_bytes", "Bytes of adapters in host memory", registry=registry)
        self.host_bound = Gauge("jaxlora_adapter_host_bytes_limit", "The host cache's bound in bytes (0: none)",
                                registry=registry)
        self.tier_loads = Gauge("jaxlora_adapter_loads", "Adapter loads so far, per tier (disk: disk -> host, "
                                "device: host -> device)", ["tier"], registry=registry)
        self.tier_seconds = Gauge("jaxlora_adapter_load_seconds_sum", "Total seconds of those loads, per tier",
                                  ["tier"], registry=registry)
        self.tier_max = Gauge("jaxlora_adapter_load_seconds_max", "The longest of those loads, per tier",
                              ["tier"], registry=registry)
        self.page_split = Gauge("jaxlora_pages", "Device pages by holder (kv, adapters: unified paging, free)",
                                ["holder"], registry=registry)
        self.adapter_rows = Gauge("jaxlora_adapter_rows", "Device rows of adapters with unified paging (used, total)",
                                  ["kind"], registry=registry)
        self.read_errors = Gauge("jaxlora_adapter_read_errors", "Adapter reads from disk that failed",
                                 registry=registry)
        self.host_evictions = Gauge("jaxlora_adapter_host_evictions", "Adapters evicted from the host cache",
                                    registry=registry)
        self.dropped = Gauge("jaxlora_requests_dropped_overloaded",
                             "Requests dropped before their first token by early abort (TTFT objective)",
                             registry=registry)
        self.replica_batch = Gauge("jaxlora_replica_batch", "Requests placed on a replica and not finished",
                                   ["replica"], registry=registry)
        self.replica_free_pages = Gauge("jaxlora_replica_kv_pages_free",
                                        "Free KV-cache pages of a replica (net of its queued requests)", ["replica"],
                                        registry=registry)
        self.replica_draining = Gauge("jaxlora_replica_draining", "1 while a replica is draining (no new requests)",
                                      ["replica"], registry=registry)
        self.replica_idle = Gauge("jaxlora_replica_idle", "1 when a draining replica has no work left (releasable)",
                                  ["replica"], registry=registry)
        self.migrations = Gauge("jaxlora_migrations", "Requests migrated between replicas so far", registry=registry)
        self.mode = Gauge("jaxlora_inference_mode", "1 for the inference mode of the last step (merged, mixed, "
                          "unmerged; --inference-mode)", ["mode"], registry=registry)
        self.mode_switches = Gauge("jaxlora_inference_mode_switches", "Weight switches (merge, unmerge, another "
                                   "merged adapter) so far", registry=registry)
        self.mode_switch_seconds = Gauge("jaxlora_inference_mode_switch_seconds_sum", "Host seconds of those "
                                         "switches (their dispatch)", registry=registry)
        self.mode_steps = Gauge("jaxlora_inference_mode_steps", "Steps run in each inference mode", ["mode"],
                                registry=registry)
        self.train_steps = Gauge("jaxlora_train_steps", "Training microbatches run in steps serving left idle "
                                 "(fine-tuning jobs, serve.finetune) so far", registry=registry)
        self.train_tokens = Gauge("jaxlora_train_tokens", "Tokens of those microbatches", registry=registry)
        self.train_seconds = Gauge("jaxlora_train_seconds_sum", "Seconds the engine spent on them", registry=registry)
        self.step_compiles = Gauge("jaxlora_step_compiles", "Step programs compiled by serving steps (shapes the "
                                   "warm-up did not cover): each one stalls the steps while it compiles",
                                   registry=registry)
        self.steps = Gauge("jaxlora_engine_steps", "Engine steps so far, per kind (base/lora decode/mixed)", ["kind"],
                           registry=registry)
        self.step_seconds = Gauge("jaxlora_engine_step_seconds_sum", "Seconds of those steps (dispatch to sampled "
                                  "tokens on the host), per kind", ["kind"], registry=registry)
        self.phase_seconds = Gauge("jaxlora_engine_step_phase_seconds_sum", "Host seconds of each phase of the "
                                   "engine's steps so far (schedule, batch, dispatch, ...)", ["phase"], registry=registry)
        self.prefix_queries = Gauge("jaxlora_prefix_cache_queries", "Prompt tokens of admitted requests looked up in "
                                    "the prefix cache so far (vLLM's prefix_cache_queries)", registry=registry)
        self.prefix_hits = Gauge("jaxlora_prefix_cache_hits", "Of those, tokens whose KV came from cached blocks "
                                 "(not computed; vLLM's prefix_cache_hits)", registry=registry)
        self.prefix_hit_rate = Gauge("jaxlora_prefix_cache_hit_rate", "Prefix cache hits / queries so far (tokens)",
                                     registry=registry)
        self.prefix_requests = Gauge("jaxlora_prefix_cache_requests", "Admitted requests looked up in the prefix cache, "
                                     "and those that reused at least one block", ["kind"], registry=registry)
        self.prefix_pages = Gauge("jaxlora_prefix_cache_pages", "KV pages holding cached blocks (cached: all; "
                                  "unreferenced: held by no request, evictable, counted free)", ["kind"],
                                  registry=registry)
        self.prefix_evictions = Gauge("jaxlora_prefix_cache_evictions", "Cached blocks evicted for KV or adapter pages",
                                      registry=registry)
        self.ttft = Histogram("jaxlora_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("jaxlora_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("jaxlora_time_per_output_token_seconds", "Mean time per output token of a request",
                              buckets=LATENCY_BUCKETS, registry=registry)

    def render(self) -> bytes:
        snap = self.engine.snapshot()
        self.running.set(snap["running"])
        self.waiting.set(snap["waiting"])
        self.adapters_on_device.set(snap["adapters_on_device"])
        self.adapters_known.set(snap["adapters_known"])
        self.free_pages.set(snap["free_pages"])
        self.total_pages.set(snap["total_pages"])
        self.tokens_per_second.set(snap["tokens_per_second"])
        self.adapter_loads.set(self.engine.stats.adapter_loads)
        self._render_tiers(snap)
        self.dropped.set(snap["dropped_overloaded"])
        state = server_state(self.engine)
        self.migrations.set(state["migrations"])
        for load in state["replicas"]:
            replica = str(load["replica"])
            self.replica_batch.labels(replica).set(load["batch"])
            self.replica_free_pages.labels(replica).set(load["free_pages"])
            self.replica_draining.labels(replica).set(int(load["draining"]))
            self.replica_idle.labels(replica).set(int(load["idle"]))
        self._render_modes(snap)
        self._render_prefix_cache(snap["prefix_cache"])
        stats = self.engine.stats
        self.train_steps.set(getattr(stats, "train_steps", 0))
        self.train_tokens.set(getattr(stats, "train_tokens", 0))
        self.train_seconds.set(getattr(stats, "train_seconds", 0.0))
        self.step_compiles.set(getattr(stats, "step_compiles", 0))
        self._render_steps(stats)
        return generate_latest(self.registry)

    def _render_steps(self, stats) -> None:
        """Steps and their seconds per kind ("lora_decode": the kind's words joined by "_", no spaces in a
        label), host seconds per phase (`EngineStats`)."""
        for kind, (count, seconds, _tokens) in dict(stats.kind_steps).items():
            label = kind.replace(" ", "_")
            self.steps.labels(label).set(count)
            self.step_seconds.labels(label).set(seconds)
        for phase, seconds in dict(stats.phase_seconds).items():
            self.phase_seconds.labels(phase).set(seconds)

    def _render_prefix_cache(self, cache: dict) -> None:
        """The prefix cache's gauges (`EngineStats.prefix_cache`; zeros when it is off)."""
        self.prefix_queries.set(cache["queries"])
        self.prefix_hits.set(cache["hits"])
        self.prefix_hit_rate.set(cache["hit_rate"])
        self.prefix_requests.labels("looked_up").set(cache["requests"])
        self.prefix_requests.labels("hit").set(cache["hit_requests"])
        self.prefix_pages.labels("cached").set(cache["cached_pages"])
        self.prefix_pages.labels("unreferenced").set(cache["unreferenced_pages"])
        self.prefix_evictions.set(cache["evictions"])

    def _render_modes(self, snap: dict) -> None:
        """The inference mode's gauges (serve.modes; an unmerged-only engine: unmerged, no switches)."""
        current = snap.get("inference_mode", "unmerged")
        for mode in ("unmerged", "merged", "mixed"):
            self.mode.labels(mode).set(float(mode == current))
            self.mode_steps.labels(mode).set(snap.get("mode_steps", {}).get(mode, 0))
        self.mode_switches.set(snap.get("mode_switches", 0))
        self.mode_switch_seconds.set(snap.get("mode_switch_seconds", 0.0))

    def _render_tiers(self, snap: dict) -> None:
        """The adapter tiers' gauges (serve.adapter_store; host -> device loads from the engine)."""
        store, stats = self.engine.adapters, self.engine.stats
        self.adapters_on_host.set(snap["adapters_on_host"])
        self.adapters_on_disk.set(snap["adapters_on_disk"])
        self.host_bytes.set(snap["host_adapter_bytes"])
        self.host_bound.set(store.max_bytes or 0)
        tiers = {"disk": (store.stats.disk_reads, store.stats.disk_read_seconds, store.stats.disk_read_max_s),
                 "device": (stats.adapter_loads, stats.adapter_load_seconds, stats.adapter_load_max_s)}
        for tier, (count, seconds, longest) in tiers.items():
            self.tier_loads.labels(tier).set(count)
            self.tier_seconds.labels(tier).set(seconds)
            self.tier_max.labels(tier).set(longest)
        self.read_errors.set(store.stats.disk_read_errors)
        for holder, pages in snap["pages"].items():
            self.page_split.labels(holder).set(pages)
        for kind, rows in snap["adapter_rows"].items():
            self.adapter_rows.labels(kind).set(rows)
        self.host_evictions.set(store.stats.host_evictions)
