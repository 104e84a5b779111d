"""Does a step's call return before the device is done? (issue 35 item 2 / issue 34 item 3, 2026-11-28)

On a cold server the host's `dispatch` phase took the whole device step while scanned stand-ins
served (13-15 ms a decode step against 6.4-7.1 ms with the unrolled programs; bench/NOTES_serve.md,
ninth session): the stand-in's call seems not to return before its step is done, so the host cannot
build the next step meanwhile. This probe builds one engine at the 8B shape (random weights, every
pool slot holding an adapter), compiles one step's forward several ways (layers unrolled or scanned,
each with a set of XLA options), and times, per way, `Engine.run_step` (the forward and the sampler):

  call_ms       the call alone, the device idle before it (host launch cost);
  queued_ms     the call made while the previous step still runs (returns at once if dispatch is async);
  pipelined_ms  20 calls back to back, then one wait, per call (the engine's async loop's floor);
  sync_ms       call and wait, one at a time;
  stable_inputs the four again with the step's host inputs placed on the device once (the same input
                buffers every call: no CUDA-graph update for them).

It also counts the optimized HLO's while loops and those with a known trip count (XLA's `WhileThunk`
reads an unknown loop's predicate back to the host and waits for the device every iteration).

  python bench/dispatch_probe.py [--tiny] [--step decode32] [--variant window1] [--out ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# run as a script, this folder (bench/serve.py) would hide the serve package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
from bench.serve import LORA, PROFILE_STEPS, AdapterFactory, profile_plan, profile_variants  # noqa: E402
from jaxlora.models.llama import Llama  # noqa: E402
from jaxlora.models.presets import llama8b_config  # noqa: E402
from jaxlora.scheduler.serving import pages_for  # noqa: E402
from serve.engine import Engine  # noqa: E402
from serve.engine_config import EngineConfig  # noqa: E402
from serve.step import STAND_IN_GPU_OPTIONS  # noqa: E402

# XLA's default command-buffer types (jax 0.11/0.12)
CB_DEFAULT = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
CUBLAS = {"xla_gpu_enable_triton_gemm": False}
WAYS = {  # name: (layers scanned, XLA options); "scanned" is the server's stand-in
    "unrolled": (False, {}),
    "unrolled_cb_off": (False, {"xla_gpu_enable_command_buffer": ""}),
    "unrolled_cublas": (False, dict(CUBLAS)),  # no Triton GEMM autotuning: a faster compile, if as fast a step
    "scanned": (True, dict(STAND_IN_GPU_OPTIONS)),
    "scanned_cublas_only": (True, dict(CUBLAS)),  # the stand-in before 2026-11-28 (its loop outside command buffers)
    "scanned_cb_off": (True, {**CUBLAS, "xla_gpu_enable_command_buffer": ""}),
    "scanned_cb_while_unroll": (True, {**STAND_IN_GPU_OPTIONS, "xla_gpu_command_buffer_unroll_loops": True}),
}


def hlo_loops(text: str) -> dict:
    """While loops of an optimized HLO module and how many carry a known trip count."""
    whiles = [line for line in text.splitlines() if re.search(r"= .*\bwhile\(", line)]
    return {"while": len(whiles), "known_trip_count": sum("known_trip_count" in line for line in whiles),
            "conditional": len(re.findall(r"\bconditional\(", text))}


def timings(run, rounds: int = 10, pipelined: int = 20) -> dict:
    """call / queued / pipelined / sync ms of `run()` (module doc), medians over `rounds`."""
    call, queued, sync = [], [], []
    for _ in range(rounds):
        jax.block_until_ready(run())
        t0 = time.perf_counter()
        out = run()
        call.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = run()  # the step above still runs on the device
        queued.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        sync.append(time.perf_counter() - t0)
    jax.block_until_ready(run())
    t0 = time.perf_counter()
    for _ in range(pipelined):
        out = run()
    jax.block_until_ready(out)
    piped = (time.perf_counter() - t0) / pipelined
    ms = lambda values: float(np.median(values)) * 1e3
    return {"call_ms": ms(call), "queued_ms": ms(queued), "pipelined_ms": piped * 1e3, "sync_ms": ms(sync)}


def probe_way(engine: Engine, step, scanned: bool, options: dict) -> dict:
    """Compiles `step`'s forward the given way into the engine's programs and times run_step."""
    programs = engine.programs
    forward = step.shapes[0]
    args = (engine._state, engine.cache, step.batch, step.lora, step.prev_tokens, step.token_src)
    t0 = time.perf_counter()
    compiled = programs.lower(forward, args, scan=scanned).compile(compiler_options=options or None)
    compile_s = time.perf_counter() - t0
    programs._compiled[forward] = compiled  # this probe's program serves the step (bench only)
    result = {"scanned": scanned, "options": options, "compile_s": compile_s, "hlo": hlo_loops(compiled.as_text())}
    result.update(timings(lambda: engine.run_step(step)))
    # the same step with its host inputs placed on the device once: every call gets the same input
    # buffers, so XLA's command buffers (CUDA graphs) need no update for them (`command_buffer::
    # update` was 2.6-4.2 ms of a step's host time on the H200's disk trace, 2026-11-29)
    stable = step._replace(batch=_on_device(step.batch), prev_tokens=_on_device(step.prev_tokens),
                           token_src=_on_device(step.token_src), sampling=_on_device(step.sampling),
                           lora=None if step.lora is None else step.lora._replace(plan=_on_device(step.lora.plan)))
    result["stable_inputs"] = timings(lambda: engine.run_step(stable))
    result["tokens"] = np.asarray(engine.run_step(step)).tolist()
    return result


def _on_device(tree):
    """`tree` with its numpy arrays placed on the default device (once)."""
    return jax.tree.map(lambda a: jax.device_put(a) if isinstance(a, np.ndarray) else a, tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2 layers at a tiny size (a CPU smoke run)")
    parser.add_argument("--step", default="decode32", choices=sorted(PROFILE_STEPS))
    parser.add_argument("--variant", default="window1", help="bench/serve.py's profile variant (base, window1, ...)")
    parser.add_argument("--ways", nargs="*", default=list(WAYS), choices=list(WAYS))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 2)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    layers = args.layers or (2 if args.tiny else 32)
    config = llama8b_config(layers, args.tiny)
    model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    factory = AdapterFactory(config, 2)
    chunks, chunk_tokens, decode_rows = PROFILE_STEPS[args.step]
    context, page_size = 384, 16
    rows = chunks + decode_rows
    engine_config = EngineConfig(
        max_adapters_on_device=4 if args.tiny else 64, max_lora_rank=LORA.r, page_size=page_size,
        num_pages=rows * pages_for(context + chunk_tokens + 1, page_size), max_model_len=1024,
        max_num_seqs=max(rows, 8), token_budget=max(chunks * chunk_tokens + decode_rows, 32),
        prefill_chunk=max(chunk_tokens, 16), max_waiting=64, lora_backend="pallas" if jax.default_backend() == "gpu"
        else "gather")
    variants = profile_variants(engine_config, [engine_config.lora_backend], (1, 8))
    config_v, adapters = variants[args.variant]
    engine = Engine(model, eos_ids=(), config=config_v)
    prepared = [engine.prepare_adapter(factory(i)) for i in range(len(factory.sets))]
    for slot in range(config_v.max_adapters_on_device):
        engine.pool.load(prepared[slot % len(prepared)], slot=slot)
    step = engine.build_step(profile_plan(engine, chunks, chunk_tokens, decode_rows, context, adapters))
    engine.run_step(step)  # the sampler's program, compiled once
    results = {}
    for name in args.ways:
        scanned, options = WAYS[name]
        if jax.default_backend() != "gpu":
            options = {}  # the XLA GPU options mean nothing to the CPU compiler
        try:
            results[name] = probe_way(engine, step, scanned, options)
        except Exception as err:  # an option this XLA does not know: recorded, the others still run
            results[name] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
            traceback.print_exc()
        first = next(iter(results.values())).get("tokens")
        if first is not None and "tokens" in results[name]:  # the same greedy tokens as the first way's
            results[name]["tokens_equal_first"] = float(np.mean(np.equal(results[name]["tokens"], first)))
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "tokens"}), flush=True)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "step": args.step, "variant": args.variant, "layers": layers,
              "tokens": len(step.batch.tokens), "results": results}
    out = args.out or f"bench/results/dispatch_probe_{'cpu' if args.tiny else 'gpu'}.json"
    with open(out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"device {report['device']}, jax {report['jax']}; wrote {out}")


if __name__ == "__main__":
    main()
