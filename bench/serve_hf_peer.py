"""Peer for `bench/serve.py` (issue 19, "Done when" item 3): Hugging Face `transformers`' own continuous
batching with paged attention (`ContinuousBatchingManager`, the engine behind `generate_batch`, transformers
5.x) serving the base model (no LoRA) on the same requests as our serving benchmark.

    PYTHONPATH=. python bench/serve_hf_peer.py [--requests 64] [--out bench/results/serve_hf_peer_h200.json]
    PYTHONPATH=. python bench/serve_hf_peer.py --tiny   # CPU smoke test (2-layer tiny model, 8 short requests)

Requests: the trace of `bench/serve.py` (its `parse_case` and `make_trace`, imported, same seed and lengths):
by default `punica:distinct` with `--requests 64`, i.e. the Punica trace every base run of the Punica suite
uses (the adapter column is ignored: this is the base model), prompt and output lengths uniform in [8, 512),
all submitted at t=0 (throughput mode); prompts are random token ids drawn exactly as `bench/serve.py` draws
them (`default_rng([seed, 3])`). A replay-mode case (`--case slora:...`) submits each request at its arrival
time from the main thread while the manager's thread generates.

Model: the Llama-3.1-8B shape of `jaxlora.models.presets.llama8b_config` (32 layers, d 4096, ffn 14336,
32 heads, 8 KV heads, head_dim 128, vocab 128256, llama3 RoPE) as a `transformers` `LlamaForCausalLM` with
random bf16 weights built directly on the device (no download). Greedy decoding; EOS disabled
(`eos_token_id=-1`), and each request gets its own `max_new_tokens` (= its output length in the trace,
through `ContinuousBatchingManager.add_request`; `generate_batch` takes one `max_new_tokens` for all
requests, so the manager's request API is used directly - same engine, same scheduler, same paged cache).
The script checks every request generated exactly its output length.

Engine settings (flags): attention `paged|sdpa` (transformers' paged implementation when flash-attn is not
installed, which it is not on the GPU machine; `--attn` picks another), pages (`block_size`) of 16 tokens,
`max_batch_tokens` 2048, at most 64 requests per batch, a KV cache of 4096 pages (64 requests of up to
1022 tokens: what our engine's default `--num-pages` gives), FIFO scheduler (transformers' default, decode
first, chunked prefill in the token budget). CUDA graphs, async batching and torch.compile follow
transformers' defaults unless `--cuda-graph`, `--async-batching`, `--compile-level` say otherwise; for
`paged|sdpa` transformers turns CUDA graphs and async batching off (an attention mask is needed) and does
not compile (`default_compile_level` 0). The JSON records the settings as transformers resolved them.

Timing (warm-up excluded): the manager is created, `manager.warmup()` runs (captures CUDA graphs when they
are on), its thread starts, and an untimed warm-up batch (8 requests of another trace, seed + 1) goes
through it; then the timed requests are submitted to the same running manager. Each request records a
timestamp per generated token (`record_timestamps=True`; taken on the host when the token reaches the
request state, as our engine's callbacks do). TTFT counts from the request's scheduled arrival (t=0 in
throughput mode) to its first token; TPOT per request is (last token - first token) / (tokens - 1);
throughput is generated tokens over the makespan (first arrival to last token).
Writes JSON (device, torch/transformers versions, date, settings, results) to --out.
"""

from __future__ import annotations

import os

# bench/serve.py imports JAX; we only need its trace generator: keep JAX off the GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, bench/ comes first on sys.path, and bench/serve.py would hide the `serve` package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.join(ROOT, "bench")]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np


def load_serve_bench():
    """bench/serve.py as a module (it is a script in a folder that is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_serve", os.path.join(ROOT, "bench", "serve.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def hf_llama_config(c, transformers):
    """transformers' LlamaConfig for a jaxlora LlamaConfig (same shape)."""
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": c.rope_theta, "factor": c.rope_scaling.factor,
                "low_freq_factor": c.rope_scaling.low_freq_factor,
                "high_freq_factor": c.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": c.rope_scaling.original_max_position_embeddings}
    return transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _pct(values, q):
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    return repr(value)


def run_batch(manager, prompts, output_lens, arrivals, tag: str, timeout_s: float) -> dict:
    """Submits the requests (each at its arrival time, seconds from the start), waits for all of them and
    summarises them like `bench/serve.py`'s `summarize`."""
    count = len(prompts)
    ids = [f"{tag}{i}" for i in range(count)]
    order = np.argsort(arrivals, kind="stable")
    results = {}
    start = time.perf_counter()
    submitted = 0
    deadline = start + timeout_s
    while len(results) < count:
        now = time.perf_counter() - start
        while submitted < count and arrivals[order[submitted]] <= now:
            i = int(order[submitted])
            manager.add_request(prompts[i], request_id=ids[i], max_new_tokens=int(output_lens[i]),
                                record_timestamps=True, eos_token_id=-1)
            submitted += 1
        wait = 0.05 if submitted == count else max(0.0, min(0.05, start + arrivals[order[submitted]] - time.perf_counter()))
        result = manager.get_result(timeout=max(wait, 1e-3))
        if result is not None and result.is_finished():
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError(f"transformers' generation thread stopped with {count - len(results)} requests unfinished")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{count - len(results)} of {count} requests unfinished after {timeout_s:.0f} s")
    ttft, tpot, e2e, ends, wrong, errors, tokens = [], [], [], [], [], [], 0
    for i, rid in enumerate(ids):
        out = results[rid]
        stamps = out.timestamps or []
        n = len(out.generated_tokens)
        tokens += n
        if out.error is not None:
            errors.append(rid)
            continue
        if n != int(output_lens[i]) or len(stamps) != n:
            wrong.append({"request": i, "wanted": int(output_lens[i]), "generated": n, "timestamps": len(stamps)})
        if not stamps:
            continue
        arrival = start + float(arrivals[i])
        ttft.append(stamps[0] - arrival)
        if n > 1:
            tpot.append((stamps[-1] - stamps[0]) / (n - 1))
        e2e.append(stamps[-1] - arrival)
        ends.append(stamps[-1])
    duration = max(ends) - start if ends else float("nan")
    return {
        "requests": count, "finished_ok": count - len(errors), "errors": len(errors),
        "generated_tokens": tokens, "expected_tokens": int(np.sum(output_lens)), "length_mismatches": wrong,
        "duration_s": duration, "tokens_per_s": tokens / duration, "requests_per_s": (count - len(errors)) / duration,
        "ttft_p50_ms": 1e3 * _pct(ttft, 50), "ttft_p90_ms": 1e3 * _pct(ttft, 90),
        "tpot_p50_ms": 1e3 * _pct(tpot, 50), "tpot_p90_ms": 1e3 * _pct(tpot, 90),
        "latency_mean_s": float(np.mean(e2e)) if e2e else float("nan"), "latency_p90_s": _pct(e2e, 90),
    }


def resolved_settings(manager, model) -> dict:
    cb = manager.continuous_batching_config
    keys = ("block_size", "page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "max_blocks_per_request",
            "max_memory_percent", "allow_block_sharing", "use_async_batching", "use_cuda_graph",
            "q_padding_interval_size", "kv_padding_interval_size", "varlen_compile_config",
            "decode_compile_config", "default_compile_level", "scheduler_type", "safety_margin")
    out = {k: _jsonable(getattr(cb, k)) for k in keys if hasattr(cb, k)}
    out.setdefault("block_size", out.get("page_size"))
    processor = manager.batch_processor
    if processor is not None:
        out["prefix_sharing"] = bool(processor.cache.use_prefix_sharing)
        out["scheduler"] = type(processor.scheduler).__name__
        out["scheduler_safety_margin"] = processor.scheduler.safety_margin
    out["attn_implementation"] = model.config._attn_implementation
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="2-layer tiny model, 8 short requests (CPU smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 2)")
    parser.add_argument("--case", default="punica:distinct",
                        help="bench/serve.py case spec whose trace is served (adapters ignored)")
    parser.add_argument("--requests", type=int, default=None, help="requests (default 64; --tiny: 8)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s in replay mode")
    parser.add_argument("--min-len", type=int, default=None, help="lengths in [min, max) (default 8; --tiny: 4)")
    parser.add_argument("--max-len", type=int, default=None, help="(default 512; --tiny: 24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--attn", default="paged|sdpa",
                        help="attention implementation (paged|sdpa, paged|eager, paged|flash_attention_2, ...)")
    parser.add_argument("--block-size", type=int, default=16, help="KV page size in tokens (transformers default 256)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV pages (default: --max-requests-per-batch contexts of 2*(max_len-1) tokens, as "
                             "bench/serve.py sizes ours; 0: transformers infers it from free memory)")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="tokens per step (default 2048; --tiny: 32)")
    parser.add_argument("--max-requests-per-batch", type=int, default=None, help="(default 64; --tiny: 8)")
    parser.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--async-batching", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--compile-level", type=int, default=0, help="transformers' default_compile_level (0: none)")
    parser.add_argument("--no-block-sharing", action="store_true", help="turn prefix (block) sharing off")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for one batch")
    parser.add_argument("--out", default="bench/results/serve_hf_peer.json")
    args = parser.parse_args()
    tiny = args.tiny
    pick = lambda value, default, tiny_default: value if value is not None else (tiny_default if tiny else default)
    args.layers = pick(args.layers, 32, 2)
    args.requests = pick(args.requests, 64, 8)
    args.min_len = pick(args.min_len, 8, 4)
    args.max_len = pick(args.max_len, 512, 24)
    args.max_batch_tokens = pick(args.max_batch_tokens, 2048, 32)
    args.max_requests_per_batch = pick(args.max_requests_per_batch, 64, 8)
    max_model_len = 2 * (args.max_len - 1)
    if args.num_blocks is None:
        args.num_blocks = args.max_requests_per_batch * math.ceil(max_model_len / args.block_size)

    t0 = time.perf_counter()
    serve_bench = load_serve_bench()
    from jaxlora.models.presets import llama8b_config

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    device_name = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    if not cuda:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    flash = {name: importlib.util.find_spec(name) is not None for name in ("flash_attn", "flash_attn_interface", "kernels")}
    print(f"device: {device_name}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.layers} layers, attn {args.attn}; installed: "
          + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in flash.items()), flush=True)

    defaults = {"requests": args.requests, "rate": args.rate, "cv": 1.0, "slora_mode": "replay",
                "punica_mode": "throughput"}
    case = serve_bench.parse_case(args.case, defaults)
    trace = serve_bench.make_trace(case, args.seed, args.min_len, args.max_len, 1000)
    config = llama8b_config(args.layers, tiny)
    token_rng = np.random.default_rng([args.seed, 3])  # as bench/serve.py draws its prompts
    prompts = [token_rng.integers(0, config.vocab_size, int(n)).tolist() for n in trace.prompt_lens]
    warm_case = serve_bench.Case("punica", "throughput", min(args.warmup_requests, args.requests), args.rate, 1.0,
                                 popularity="distinct")
    warm = serve_bench.make_trace(warm_case, args.seed + 1, args.min_len, args.max_len, 1000)
    warm_rng = np.random.default_rng([args.seed + 1, 3])
    warm_prompts = [warm_rng.integers(0, config.vocab_size, int(n)).tolist() for n in warm.prompt_lens]

    hf_config = hf_llama_config(config, transformers)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16, attn_implementation=args.attn)
    model.eval()
    if cuda:
        torch.cuda.synchronize()
    params = sum(p.numel() for p in model.parameters())
    model_s = time.perf_counter() - t0
    print(f"model ready ({params / 1e9:.2f} B parameters, bf16, random) {model_s:.1f} s after start", flush=True)

    generation_config = GenerationConfig(do_sample=False, max_new_tokens=int(trace.output_lens.max()),
                                         eos_token_id=-1, pad_token_id=0)
    # transformers >= 5.23 renames block_size to page_size (block_size still accepted, deprecated)
    page_key = "page_size" if "page_size" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)} else "block_size"
    cb_kwargs = dict(max_batch_tokens=args.max_batch_tokens,
                     max_requests_per_batch=args.max_requests_per_batch, default_compile_level=args.compile_level,
                     allow_block_sharing=not args.no_block_sharing)
    cb_kwargs[page_key] = args.block_size
    if args.num_blocks:
        cb_kwargs["num_blocks"] = args.num_blocks
    if args.cuda_graph != "auto":
        cb_kwargs["use_cuda_graph"] = args.cuda_graph == "on"
    if args.async_batching != "auto":
        cb_kwargs["use_async_batching"] = args.async_batching == "on"
    cb_config = ContinuousBatchingConfig(**cb_kwargs)
    hints = WorkloadHints(max_prompt_length=int(trace.prompt_lens.max()),
                          max_generated_length=int(trace.output_lens.max()), num_requests=args.requests)
    manager = model.init_continuous_batching(generation_config=generation_config,
                                             continuous_batching_config=cb_config, workload_hints=hints)
    setup_start = time.perf_counter()
    manager.warmup()
    manager_warmup_s = time.perf_counter() - setup_start
    manager.start()
    try:
        warm_start = time.perf_counter()
        warm_result = run_batch(manager, warm_prompts, warm.output_lens, np.zeros(len(warm_prompts)), "warm",
                                args.timeout)
        warm_s = time.perf_counter() - warm_start
        steps_before = manager.current_batch
        print(f"warm-up: manager.warmup() {manager_warmup_s:.1f} s, then {len(warm_prompts)} requests in "
              f"{warm_s:.1f} s", flush=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        result = run_batch(manager, prompts, trace.output_lens, trace.arrivals, "req", args.timeout)
        steps = manager.current_batch - steps_before
        settings = resolved_settings(manager, model)
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
    result["steps"] = steps
    result["mean_step_ms"] = 1e3 * result["duration_s"] / max(1, steps)
    result["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None

    report = {
        "device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": platform.node(),
        "installed": flash,
        "model": {"shape": "tiny" if tiny else "Llama-3.1-8B", "layers": args.layers, "dtype": "bfloat16",
                  "weights": "random", "parameters": params, "class": type(model).__name__},
        "engine": "transformers ContinuousBatchingManager (generate_batch's engine), base model, greedy, EOS off, "
                  "per-request max_new_tokens",
        "case": case.name, "spec": dataclasses.asdict(case),
        "transformers_settings": settings, "settings": vars(args),
        "timings_s": {"model_ready": model_s, "manager_warmup": manager_warmup_s, "warmup_batch": warm_s},
        "warmup_batch": warm_result, "base": result,
        "measurement": "per-token host timestamps (record_timestamps=True); TTFT from scheduled arrival; "
                       "TPOT per request = (last - first token) / (tokens - 1); throughput = tokens / makespan; "
                       "warm-up (manager.warmup() and an 8-request batch) excluded",
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)

    r = result
    print(f"\n{'peer':40} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9} "
          f"{'wall s':>7} {'steps':>6} {'step ms':>8}")
    print(f"{'transformers CB ' + settings['attn_implementation']:40} {r['tokens_per_s']:8.1f} "
          f"{r['ttft_p50_ms']:8.0f}m {r['ttft_p90_ms']:8.0f}m {r['tpot_p50_ms']:8.1f}m {r['tpot_p90_ms']:8.1f}m "
          f"{r['duration_s']:7.1f} {steps:6d} {r['mean_step_ms']:8.1f}")
    print(f"{case.name}; {r['generated_tokens']} tokens generated of {r['expected_tokens']} expected, "
          f"{len(r['length_mismatches'])} length mismatches, {r['errors']} errors")
    print(f"settings: block_size {settings['block_size']}, num_blocks {settings['num_blocks']}, max_batch_tokens "
          f"{settings['max_batch_tokens']}, max_requests_per_batch {settings['max_requests_per_batch']}, cuda graphs "
          f"(varlen, decode) {settings['use_cuda_graph']}, async {settings['use_async_batching']}, compile "
          f"varlen {settings['varlen_compile_config']} decode {settings['decode_compile_config']}, prefix sharing "
          f"{settings.get('prefix_sharing')}")
    print(f"device: {device_name}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{time.perf_counter() - t0:.0f} s; wrote {args.out}", flush=True)
    if r["length_mismatches"] or r["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
