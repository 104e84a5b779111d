"""Where the serving engine's start-up compile goes, one step program at a time (issue 35).

Builds the engine `jaxlora-serve` builds for the README's sizes (random Llama-3.1-8B-shaped bf16
weights made on the device, packed projections, 64 adapter slots of rank 16, 256 rows, 2048-token
steps, context 1024, `--gpu-memory-utilization` as given), then for each chosen step program, one
after the other on one thread: the trace + lowering seconds, the XLA compile seconds, XLA's memory
analysis (temp / argument / output / alias bytes) and the device time of one padding-only run of
it (median of --runs, after one warm-up run). One JSON line per program is appended to --out as it
finishes, so a call that runs out of time still returns what it measured.

Variants for comparing what the compile costs (one process each; XLA flags from XLA_FLAGS):
  --layers-as scan     every program's decoder layers as a `lax.scan` (one compiled layer body;
                       each layer's weights are sliced out of the stacked arrays);
  --layers-as unrolled every program's layers unrolled (default: the engine's choice by tokens,
                       `EngineConfig.scan_layers_from_tokens`).
  --split-layers       the layers' weights one array a layer, not stacked (unrolled only: a Python
                       loop over them): every layer's GEMM fusions equal, one autotuning key.

    PYTHONPATH=. python bench/compile_time.py --tiny                      # CPU smoke test
    PYTHONPATH=. python bench/compile_time.py --out $OUT/default.jsonl   # on a GPU
    XLA_FLAGS=--xla_gpu_autotune_level=0 PYTHONPATH=. python bench/compile_time.py --out ...
    PYTHONPATH=. python bench/compile_time.py --layers-as unrolled --threads 4 --programs base_decode32 \
        lora_decode64 window_decode64 base_decode64 --out ...   # four unrolled compiles at once
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlora.lora import backends
from jaxlora.models.llama import Llama, split_layers
from jaxlora.models.packed import pack_projections
from jaxlora.models.presets import llama8b_config
from serve.cli import build_parser, engine_config
from serve.engine import Engine
from serve.step import StepShape

# name -> (tokens, lora, decode_only, window); rows follow the engine's rule (min(tokens, rows))
PROGRAMS = {
    "base_decode32": (32, False, False, False),
    "base_decode64": (64, False, False, False),
    "lora_decode128": (128, True, True, False),
    "lora_decode64": (64, True, True, False),
    "window_decode64": (64, True, False, True),
    "lora_mixed2048": (2048, True, False, False),
    "base_mixed2048": (2048, False, False, False),
    "window_mixed2048": (2048, True, False, True),
    "lora_mixed256": (256, True, False, False),
}


def build_engine(args) -> Engine:
    """The engine of the CLI's arguments for the README's sizes (or the CPU's at --tiny)."""
    sizes = (["--max-adapters-on-device", "4", "--max-model-len", "256"] if args.tiny else
             ["--max-adapters-on-device", "64", "--max-lora-rank", "16", "--max-num-seqs", "256",
              "--max-num-batched-tokens", "2048", "--max-model-len", "1024"])
    cli = build_parser().parse_args(["--model", "unused", "--gpu-memory-utilization", str(args.memory), *sizes])
    config = llama8b_config(args.layers, args.tiny)
    model = pack_projections(Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    jax.block_until_ready(nnx.state(model))
    cli.lora_backend = backends.resolve(cli.lora_backend, jax.default_backend(), 1)
    return Engine(model, [2], engine_config(cli, 16, min(cli.max_model_len, config.max_position_embeddings), None))


def split_engine_layers(engine: Engine) -> None:
    """The engine's model, adapter window included, with its layers' weights one array a layer
    (`split_layers`; the stacked arrays freed), and its forward programs traced over them (bench only)."""
    model = split_layers(nnx.merge(engine._graphdef, engine._state))
    engine._graphdef, engine._state = nnx.split(model)
    forward, (_, backend, rows) = engine.programs._static["forward"]
    engine.programs._static["forward"] = (forward, (engine._graphdef, backend, rows))


def program_shape(engine: Engine, name: str) -> StepShape:
    """The forward `name` of `PROGRAMS` (tokens capped at the engine's token budget), at the widest
    block table."""
    tokens, lora, decode_only, window = PROGRAMS[name]
    tokens = min(tokens, engine.config.token_budget)
    width = max(shape.width for shape in engine.step_shapes() if shape.program == "forward")
    return StepShape("forward", tokens, min(tokens, engine.config.max_num_seqs), width, lora, decode_only, window)


def compile_program(engine: Engine, name: str, options: dict | None = None) -> tuple[dict, object, tuple]:
    """Lowers and compiles the program `name` (XLA `options` per compile): (its info with the
    seconds and XLA's memory analysis, the compiled program, its padding arguments)."""
    shape = program_shape(engine, name)
    args = engine.startup.padding_args(shape)
    started = time.perf_counter()
    lowered = engine.programs.lower(shape, args)
    lowered_s = time.perf_counter() - started
    started = time.perf_counter()
    compiled = lowered.compile(compiler_options=options or None)
    compile_s = time.perf_counter() - started
    memory = compiled.memory_analysis()
    info = {"program": name, "shape": shape._asdict(), "lower_s": round(lowered_s, 2), "compile_s": round(compile_s, 2),
            "options": options or {}}
    if memory is not None:
        for key in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                    "generated_code_size_in_bytes"):
            info[key] = getattr(memory, key, None)
    return info, compiled, args


def run_ms(engine: Engine, compiled, args: tuple, runs: int) -> float:
    """Median ms of one padding-only run of `compiled` (after one warm-up run)."""
    times = []
    args = (args[0], engine.cache) + args[2:]  # the pool of now (an earlier program's run donated the old one)
    for i in range(runs + 1):
        started = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        if i:
            times.append((time.perf_counter() - started) * 1e3)
        engine.cache = out[2]  # donated: the next run takes the returned pool
        args = (args[0], engine.cache) + args[2:]
    return round(statistics.median(times), 3)


def measure(engine: Engine, name: str, runs: int, options: dict | None = None) -> dict:
    """Lower, compile, memory analysis and run time of the program `name`."""
    info, compiled, args = compile_program(engine, name, options)
    info["run_ms"] = run_ms(engine, compiled, args, runs)
    return info


def measure_together(engine: Engine, names: list[str], runs: int, threads: int, options: dict | None = None) -> list:
    """`names` lowered and compiled `threads` at a time (as the server's start-up does), each one's
    seconds and the wall time of them all ("together_s"); then each one's run time, one at a time."""
    import concurrent.futures

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(lambda name: compile_program(engine, name, options), names))
    together_s = round(time.perf_counter() - started, 2)
    infos = []
    for info, compiled, args in done:
        info.update(threads=threads, together_s=together_s, run_ms=run_ms(engine, compiled, args, runs))
        infos.append(info)
    return infos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="2 small layers, CPU sizes (smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 2)")
    parser.add_argument("--programs", nargs="+", choices=sorted(PROGRAMS),
                        default=["base_decode64", "lora_decode64", "window_decode64", "lora_mixed2048", "base_mixed2048"])
    parser.add_argument("--layers-as", choices=("auto", "unrolled", "scan"), default="auto",
                        help="auto: the engine's choice (EngineConfig.scan_layers_from_tokens)")
    parser.add_argument("--memory", type=float, default=0.9, help="--gpu-memory-utilization (sizes the KV pool)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--label", default="default")
    parser.add_argument("--threads", type=int, default=1,
                        help="compile the programs this many at a time (threads of this process), then time each")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="an XLA option for each compile (e.g. xla_gpu_autotune_level=0); repeatable")
    parser.add_argument("--split-layers", action="store_true",
                        help="the layers' weights one array a layer (jaxlora.models.llama.split_layers), not stacked")
    parser.add_argument("--out", default="bench/results/compile_time.jsonl")
    args = parser.parse_args()
    args.layers = args.layers or (2 if args.tiny else 32)
    started = time.perf_counter()
    engine = build_engine(args)
    if args.split_layers:
        split_engine_layers(engine)
    if args.layers_as != "auto":  # every forward's layers unrolled, or one scan body
        engine.programs.scan_from_tokens = 1 << 30 if args.layers_as == "unrolled" else 0
    head = {"program": "setup", "label": args.label, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "layers": args.layers, "layers_as": args.layers_as,
            "split_layers": args.split_layers,
            "memory": args.memory, "num_pages": engine.cache.num_pages, "lora_backend": engine.config.lora_backend,
            "setup_s": round(time.perf_counter() - started, 1), "step_programs": len(engine.step_shapes())}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(head) + "\n")
    print(json.dumps(head), flush=True)
    options = dict(parse_option(option) for option in args.option)
    if args.threads > 1:
        results = measure_together(engine, args.programs, args.runs, args.threads, options)
    else:
        results = (measure(engine, name, args.runs, options) for name in args.programs)
    for result in results:
        info = {"label": args.label, **result}
        with open(args.out, "a") as f:
            f.write(json.dumps(info) + "\n")
        print(json.dumps(info), flush=True)


def parse_option(text: str) -> tuple[str, object]:
    """"name=value" -> (name, value as a bool, int or string)."""
    name, _, value = text.partition("=")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    try:
        return name, int(value)
    except ValueError:
        return name, value


if __name__ == "__main__":
    main()
