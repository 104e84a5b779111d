"""Serving a vision-language model with many LoRA adapters (issue 39, item 4): a LLaVA-1.5-layout
model at an 8B-class shape with random bf16 weights serves one trace of image+text requests on the
base model and over 1, 8 and 64 adapters, all in one run, on `serve.engine.Engine` with its
`serve.vision.ImageServing` (the tower beside the engine's language model).

    PYTHONPATH=. python bench/vision_serve.py --out bench/results/vision_serve_h200.json
    PYTHONPATH=. python bench/vision_serve.py --compile-only      # fill --compile-cache and stop
    PYTHONPATH=. python bench/vision_serve.py --tiny              # CPU smoke test (tiny LLaVA, 12 requests)

Model (built in memory, nothing read or downloaded): CLIP ViT-L/14 at 336 px (width 1024, MLP 4096,
16 heads, 576 patches an image; LLaVA-1.5 feeds the projector the second-to-last of the 24 layers'
hidden states, so 23 layers run, `jaxlora.vision.config`) -> the 2-layer GELU projector (1024 ->
4096 -> 4096) -> a Llama-3.1-8B-shaped language model (`jaxlora.models.presets.llama8b_config`: 32
layers, 4096 wide, GQA 32/8 heads, MLP 14336, vocab 128256), built as bench/serve.py builds its
random 8B model. The image token is the vocabulary's last id; each image is 576 prompt tokens.

Trace (`make_vision_trace`): bench/serve.py's Punica trace at the same seed (`make_trace`: all
requests at t=0, text lengths and output lengths uniform in [8, 512), so the text part is the
README's serving trace), each request's prompt = a few random text tokens, one image, the rest of
its random text (`--text-share`: a share of the requests without an image, default none). Images
are random uint8 pictures of random sizes put through the LLaVA processor's preprocessing
(`ImageServing.prompt`, what the server does with a chat image) before the clock starts. Cases:
the base model (no adapter), then `--adapters` (default 1 8 64) distinct adapters (r=16 on all
seven projections, random A/B: bench/serve.py's `AdapterFactory`), requests spread uniformly over
them (a balanced permutation), the SAME trace for each. Engine like the README's serving table:
hybrid LoRA backend, 256 rows and 2048 tokens a step, 2048-token prefill chunks, 64 adapter slots,
the adapter window of 8; KV pages for every request's whole context (no preemption).

Compilation before the clock (`compile_programs`): every case is first run host-only (the engine's
device step replaced by a stub that records each step's program, `StepShape`: token bucket, LoRA
variant, image-row bucket; the scheduler's plan does not depend on the device's results, so the
timed run takes the same steps), the union of those programs is compiled in parallel (`compile_all`),
and the tower's encode is compiled and timed for each image bucket a step can hold. Each case then
serves its trace once untimed (`--warmup-runs`: every program's first execution) and once timed,
each on a fresh engine warmed up from JAX's caches; `compiles_in_run` in the JSON says if a timed
step compiled anyway. `--compile-cache DIR` keeps them across processes and
`--compile-only` stops once they are compiled.

Reported per case (bench/serve.py's `run_trace`: the driver calls `Engine.step()` in this thread,
timing from t=0 to the last token): generated tokens/s, TTFT and TPOT p50/p90, the ratio of each to
the base run's, steps, tower calls and images encoded in the run, and the tower's device time
(calls x the measured encode time of their bucket). Writes JSON (+ PNG) to --out after each case.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time

# Run as a script, this file's folder comes first on sys.path and its name would hide the
# `serve` package: look it up from the repository root instead.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.serve import (LORA, AdapterFactory, Case, Trace, compile_all, host_only_step, json_then_pyplot,
                         make_trace, run_trace, use_compile_cache)
from bench.timing import median_call_seconds
from jaxlora.buckets import bucket
from jaxlora.lora import backends as lora_backends
from jaxlora.models.presets import llama8b_config
from jaxlora.scheduler.serving import pages_for
from jaxlora.vision.config import ClipVisionConfig, LlavaConfig
from jaxlora.vision.llava import Llava
from jaxlora.vision.preprocess import ImageProcessorConfig
from serve.engine import EngineConfig
from serve.vision import ImageInput, ImageServing

# CLIP ViT-L/14-336 as LLaVA-1.5 runs it (feature layer -2 of 24: 23 layers run); the tiny CPU tower
VIT_L_336 = ClipVisionConfig(hidden_size=1024, intermediate_size=4096, num_layers=23, num_heads=16, image_size=336,
                             patch_size=14)
TINY_VIT = ClipVisionConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, image_size=32, patch_size=8)


# ---- model --------------------------------------------------------------------------------------

def llava_config(layers: int, tiny: bool) -> LlavaConfig:
    """LLaVA-1.5's layout: the ViT-L/14-336 tower (tiny: 32 px, 16 patches), feature layer = the
    last layer run, projector 1024 -> d -> d, over `llama8b_config(layers, tiny)`; the image token
    is the vocabulary's last id."""
    text = llama8b_config(layers, tiny)
    vision = TINY_VIT if tiny else VIT_L_336
    return LlavaConfig(vision=vision, text=text, image_token_id=text.vocab_size - 1,
                       feature_layers=(vision.num_layers,))


def build_model(config: LlavaConfig) -> tuple[Llava, ImageProcessorConfig]:
    """The random bf16 LLaVA (weights on the device) and its image processor's settings (LLaVA-1.5's:
    shortest edge -> image size, center crop, CLIP normalisation)."""
    model = Llava(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    jax.block_until_ready(nnx.state(model))
    size = config.vision.image_size
    return model, ImageProcessorConfig(shortest_edge=size, crop_size=(size, size))


def flops_per_image(config: LlavaConfig) -> dict:
    """Forward FLOPs (2 per multiply-add) of one image: the tower over its P + 1 positions
    (linears and attention, the layers run), the projector over P rows, and the language model's
    prefill of its P image tokens (linears only; attention grows with the context)."""
    vision, text = config.vision, config.text
    tokens, d, f = vision.num_patches + 1, vision.hidden_size, vision.intermediate_size
    per_layer = 2 * tokens * (4 * d * d + 2 * d * f) + 4 * tokens * tokens * d
    patches = 2 * vision.num_patches * vision.patch_features * d
    projector = 2 * config.tokens_per_image * (config.projector_in + text.hidden_size) * text.hidden_size
    q, kv = text.num_heads * text.head_dim, text.num_kv_heads * text.head_dim
    lm_layer = text.hidden_size * (2 * q + 2 * kv) + 3 * text.hidden_size * text.intermediate_size
    return {"tower": vision.num_layers * per_layer + patches, "projector": projector,
            "prefill_linears": 2 * config.tokens_per_image * text.num_layers * lm_layer}


# ---- trace --------------------------------------------------------------------------------------

@dataclasses.dataclass
class VisionTrace:
    """One trace for every case: bench/serve.py's `Trace` (arrivals, text lengths, output lengths),
    each request's expanded prompt ids and its `ImageInput` (None: a text-only request)."""

    trace: Trace
    prompts: list[list[int]]
    images: list[ImageInput | None]
    seed: int = 0

    def with_adapters(self, adapters: int) -> Trace:
        """The trace with requests spread uniformly over `adapters` adapters (a balanced permutation;
        0: every request on the base model)."""
        if adapters == 0:
            return self.trace
        order = np.random.default_rng([self.seed, 7, adapters]).permutation(len(self.prompts))
        return dataclasses.replace(self.trace, adapters=order % max(1, adapters))


def make_vision_trace(serving: ImageServing, requests: int, min_len: int, max_len: int, text_share: float,
                      seed: int) -> VisionTrace:
    """`requests` requests (bench/serve.py's Punica trace in throughput mode: text and output lengths
    in [min_len, max_len)), each prompt = up to 8 random text tokens, one random image (uint8, random
    size, through `ImageServing.prompt`: preprocessed and expanded to its image tokens), the rest of
    its text; a `text_share` of them without an image."""
    trace = make_trace(Case("punica", "throughput", requests, 1.0, 1.0, popularity="identical"), seed, min_len,
                       max_len, 1)
    rng = np.random.default_rng([seed, 11])
    vocab, image_token = serving.config.text.vocab_size, serving.image_token_id
    text_only = rng.permutation(requests) < round(text_share * requests)
    size = serving.config.vision.image_size
    prompts, images = [], []
    for i, length in enumerate(trace.prompt_lens):
        text = [t + (t >= image_token) for t in rng.integers(0, vocab - 1, int(length)).tolist()]  # never the image id
        if text_only[i]:
            prompts.append(text)
            images.append(None)
            continue
        cut = int(rng.integers(0, min(8, len(text)) + 1))
        height, width = (int(n) for n in rng.integers(size // 2, 2 * size, 2))
        picture = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        ids, image = serving.prompt(text[:cut] + [image_token] + text[cut:], [picture])
        prompts.append(ids)
        images.append(image)
    return VisionTrace(trace, prompts, images, seed)


# ---- the tower ----------------------------------------------------------------------------------

class CountingImages(ImageServing):
    """`ImageServing` that records each tower call's images and padded bucket (`calls`)."""

    def __init__(self, model: Llava, processor: ImageProcessorConfig):
        super().__init__(model, processor)
        self.calls: list[tuple[int, int]] = []  # (images, padded to)

    def encode(self, pixels: list[np.ndarray]) -> list[jax.Array]:
        count = sum(len(p) for p in pixels)
        self.calls.append((count, bucket(count, 1)))
        return super().encode(pixels)

    def summary(self, bucket_ms: dict[int, float]) -> dict:
        """Calls, images and the tower's estimated device time (each call at its bucket's measured ms)."""
        return {"tower_calls": len(self.calls), "images_encoded": sum(n for n, _ in self.calls),
                "tower_ms_est": sum(bucket_ms.get(padded, float("nan")) for _, padded in self.calls),
                "tower_buckets": sorted({padded for _, padded in self.calls})}


def max_image_requests(config: EngineConfig, tokens_per_image: int, requests: int) -> int:
    """Most requests whose image tokens one step can hold: the budget's tokens in whole images, plus a
    chunk ending and one starting inside an image (`ImageServing.plan_rows`)."""
    return min(requests, config.max_num_seqs, (config.token_budget - 2) // tokens_per_image + 2)


def tower_times(serving: ImageServing, most_images: int, repeats: int) -> dict[int, float]:
    """Compiles the tower's encode for every bucket of images a step may encode (1 .. bucket of
    `most_images`) and times each call (`ImageServing.encode`: the pixels' copy to the device, the
    tower and projector; `median_call_seconds`, ms); {bucket: ms}."""
    size = serving.config.vision.image_size
    times = {}
    for padded in sorted({bucket(n, 1) for n in range(1, most_images + 1)}):
        pixels = [np.zeros((padded, 3, size, size), np.float32)]
        jax.block_until_ready(serving.encode(pixels))
        times[padded] = 1e3 * median_call_seconds(lambda: serving.encode(pixels), repeats)
    return times


# ---- compilation --------------------------------------------------------------------------------

def discover_programs(model: Llava, serving: ImageServing, config: EngineConfig, vtrace: VisionTrace,
                      adapters: int, factory: AdapterFactory) -> list:
    """The forward programs (`StepShape`s) a case runs: its trace served host-only (`host_only_step`
    records each step's shapes instead of running them; the tower runs, so its buckets compile)."""
    seen: dict = {}

    def record(step, cache):
        for shape in step.shapes:
            seen[shape] = None
        return host_only_step(step, cache)

    trace = vtrace.with_adapters(adapters)
    run_trace(model.language, config, trace, vtrace.prompts, factory if adapters else None, step_fn=record,
              images=(serving, vtrace.images))
    return list(seen)


def compile_programs(model: Llava, serving: ImageServing, config: EngineConfig, vtrace: VisionTrace,
                     cases: list[int], factory: AdapterFactory, threads: int) -> tuple[dict, dict]:
    """Finds each case's programs (`discover_programs`) and compiles their union, `threads` at a time.
    Returns ({case adapters: its shapes}, compile info: counts by kind and seconds)."""
    started = time.perf_counter()
    shapes = {adapters: discover_programs(model, serving, config, vtrace, adapters, factory) for adapters in cases}
    found_s = time.perf_counter() - started
    union = list(dict.fromkeys(shape for case in shapes.values() for shape in case))
    counts = {"programs": len(union), "with_images": sum(s.images > 0 for s in union),
              "lora": sum(s.lora and not s.window for s in union), "window": sum(s.window for s in union),
              "base": sum(not s.lora for s in union), "unrolled": sum(s.tokens < _scan_from(config) for s in union),
              "per_case": {str(a): len(s) for a, s in shapes.items()}}
    print(f"expected step programs: {counts['programs']} ({counts['base']} base, {counts['window']} adapter window, "
          f"{counts['lora']} LoRA kernels; {counts['with_images']} with image rows, {counts['unrolled']} unrolled); "
          f"per case {counts['per_case']}; found host-only in {found_s:.1f} s", flush=True)
    print("  " + ", ".join(shape_name(shape) for shape in union), flush=True)
    info = compile_all(model.language, config, threads, shapes=union)
    info.update(counts, discover_s=found_s, shapes=[shape_name(shape) for shape in union])
    return shapes, info


def shape_name(shape) -> str:
    """A forward program in a few characters: its variant, tokens, and image rows (e.g. `window 2048 +4096 img`)."""
    variant = "window" if shape.window else "kernels decode" if shape.decode_only else "kernels" if shape.lora else "base"
    return f"{variant} {shape.tokens}" + (f" +{shape.images} img" if shape.images else "")


def _scan_from(config: EngineConfig) -> int:
    return config.for_platform(jax.default_backend()).scan_layers_from_tokens


# ---- cases --------------------------------------------------------------------------------------

def run_case(model: Llava, processor: ImageProcessorConfig, config: EngineConfig, vtrace: VisionTrace,
             adapters: int, factory: AdapterFactory, shapes: list, bucket_ms: dict, warmups: int = 1) -> dict:
    """One timed run of the trace: on the base model (`adapters` 0) or over `adapters` adapters,
    after `warmups` untimed runs of it (each program's first execution: on a CPU XLA finishes its
    kernels then; on a GPU the modules load); bench/serve.py's `run_trace` figures plus the tower's
    (`CountingImages.summary`) and the untimed runs' seconds."""
    trace = vtrace.with_adapters(adapters)
    run = lambda serving: run_trace(model.language, config, trace, vtrace.prompts, factory if adapters else None,
                                    shapes=shapes, images=(serving, vtrace.images))
    started = time.perf_counter()
    for _ in range(warmups):
        run(ImageServing(model, processor))
    warmup_s = time.perf_counter() - started
    serving = CountingImages(model, processor)
    result = run(serving)
    result.update(serving.summary(bucket_ms), adapters=adapters, warmup_runs=warmups, warmup_s=warmup_s,
                  distinct_adapters=int(len(set(trace.adapters.tolist()))) if adapters else 0,
                  expected_tokens=int(trace.output_lens.sum()))
    return result


RATIOS = ("tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")
HEADER = (f"{'case':12} {'tok/s':>8} {'x base':>7} {'TTFT p50':>9} {'p90':>7} {'TPOT p50':>9} {'p90':>6} "
          f"{'steps':>6} {'tower':>6} {'images':>6} {'tower ms':>9} {'compiled':>8}")


def case_name(adapters: int) -> str:
    return "base" if adapters == 0 else f"{adapters} adapter" + ("s" if adapters > 1 else "")


def print_case(r: dict) -> None:
    """One row of `HEADER`."""
    print(f"{case_name(r['adapters']):12} {r['tokens_per_s']:8.0f} {r.get('vs_base', {}).get('tokens_per_s', 1):7.3f} "
          f"{r['ttft_p50_ms']:7.0f}ms {r['ttft_p90_ms']:5.0f}ms {r['tpot_p50_ms']:7.2f}ms {r['tpot_p90_ms']:6.2f} "
          f"{r['steps']:6d} {r['tower_calls']:6d} {r['images_encoded']:6d} {r['tower_ms_est']:9.1f} "
          f"{r['compiles_in_run']:8d}" + (f"  errors {r['errors']}" if r["errors"] else ""), flush=True)


def write_report(path: str, report: dict) -> None:
    """The JSON, and a PNG next to it: tokens/s, TTFT and TPOT p50/p90 per case."""
    plt = json_then_pyplot(path, report)
    cases = report["cases"]
    if plt is None or not cases:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = [case_name(c["adapters"]) for c in cases]
    x = np.arange(len(cases))
    axes[0].bar(x, [c["tokens_per_s"] for c in cases], color="tab:blue")
    for i, c in enumerate(cases):
        axes[0].annotate(f"{c['vs_base']['tokens_per_s']:.2f}x", (i, c["tokens_per_s"]), ha="center", va="bottom")
    for ax, key in zip(axes[1:], ("ttft", "tpot")):
        ax.bar(x - 0.2, [c[f"{key}_p50_ms"] for c in cases], 0.4, label="p50")
        ax.bar(x + 0.2, [c[f"{key}_p90_ms"] for c in cases], 0.4, label="p90")
        ax.legend()
    for ax, title in zip(axes, ("generated tokens/s", "TTFT (ms)", "TPOT (ms)")):
        ax.set_xticks(x, names)
        ax.set_title(title)
    fig.suptitle(f"jaxlora VLM serving ({report['model']['shape']}, {report['engine']['lora_backend']}), "
                 f"{report['device']}, jax {report['jax']}, {report['trace']['requests']} requests")
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
    plt.close(fig)


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random LLaVA, short prompts (CPU smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="language model layers (default 32; --tiny: 2)")
    parser.add_argument("--requests", type=int, default=None, help="requests in the trace (default 64; --tiny: 12)")
    parser.add_argument("--adapters", type=int, nargs="+", default=None,
                        help="adapter counts after the base case (default 1 8 64; --tiny: 1 4 12)")
    parser.add_argument("--text-share", type=float, default=0.0, help="share of requests without an image")
    parser.add_argument("--min-len", type=int, default=None, help="text and output lengths in [min, max) (default 8)")
    parser.add_argument("--max-len", type=int, default=None, help="(default 512; --tiny: 24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-sets", type=int, default=4, help="distinct random A/B sets the adapters share")
    parser.add_argument("--adapter-slots", type=int, default=None, help="device adapter pool (default 64; --tiny: 8)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="rows per step (default 256; --tiny: 8)")
    parser.add_argument("--token-budget", type=int, default=None, help="tokens per step (default 2048; --tiny: 64)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="(default 2048; --tiny: 32)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--lora-backend", default=None, help="default: hybrid on a GPU, gather elsewhere "
                        "(onehot if hybrid fails to compile)")
    parser.add_argument("--compile-threads", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--compile-cache", default="/tmp/jaxlora_serve_jit_cache",
                        help="JAX persistent compilation cache dir ('' to disable)")
    parser.add_argument("--compile-only", action="store_true", help="compile every program into --compile-cache, stop")
    parser.add_argument("--warmup-runs", type=int, default=1, help="untimed runs of each case's trace before its "
                        "timed run (every program executed once)")
    parser.add_argument("--time-budget", type=float, default=0, help="seconds; skip cases that would not fit (0: off)")
    parser.add_argument("--out", default="bench/results/vision_serve.json")
    args = parser.parse_args(argv)
    pick = lambda value, default, tiny: value if value is not None else (tiny if args.tiny else default)
    args.layers = pick(args.layers, 32, 2)
    args.requests = pick(args.requests, 64, 12)
    args.adapters = pick(args.adapters, [1, 8, 64], [1, 4, 12])
    args.min_len = pick(args.min_len, 8, 4)
    args.max_len = pick(args.max_len, 512, 24)
    args.adapter_slots = pick(args.adapter_slots, 64, 8)
    args.max_num_seqs = pick(args.max_num_seqs, 256, 8)
    args.token_budget = pick(args.token_budget, 2048, 64)
    args.prefill_chunk = pick(args.prefill_chunk, 2048, 32)
    args.lora_backend = args.lora_backend or ("hybrid" if jax.default_backend() == "gpu" else "gather")
    return args


def engine_config(args, vtrace: VisionTrace) -> EngineConfig:
    """The README's serving sizes (args), the context of the trace's longest request, KV pages for
    every request's whole context at once (min(rows, requests) of them)."""
    longest = max(len(p) + int(n) for p, n in zip(vtrace.prompts, vtrace.trace.output_lens))
    max_model_len = pages_for(longest, args.page_size) * args.page_size
    contexts = min(args.max_num_seqs, args.requests)
    return EngineConfig(
        max_adapters_on_device=args.adapter_slots, max_lora_rank=LORA.r, page_size=args.page_size,
        num_pages=contexts * pages_for(max_model_len, args.page_size), max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs, token_budget=args.token_budget, prefill_chunk=args.prefill_chunk,
        max_waiting=1 << 30, lora_backend=args.lora_backend)


def compile_with_fallback(model, serving, config, vtrace, cases, factory, threads) -> tuple:
    """`compile_programs`; if a custom-kernel backend fails to compile, again with onehot. Returns
    (config, {case: shapes}, compile info)."""
    try:
        return (config,) + compile_programs(model, serving, config, vtrace, cases, factory, threads)
    except Exception as err:
        if not lora_backends.get(config.lora_backend).custom_kernel:
            raise
        print(f"the {config.lora_backend} backend failed to compile ({type(err).__name__}: {str(err)[:300]}); "
              f"using onehot", flush=True)
        config = dataclasses.replace(config, lora_backend="onehot")
        return (config,) + compile_programs(model, serving, config, vtrace, cases, factory, threads)


def describe(args, config: LlavaConfig, vtrace: VisionTrace, engine: EngineConfig, factory: AdapterFactory) -> dict:
    """The report's header: device, versions, shapes, engine, trace and adapters."""
    images = [i for i in vtrace.images if i is not None]
    return {
        "device": jax.devices()[0].device_kind, "jax": jax.__version__, "backend": jax.default_backend(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": platform.node(),
        "model": {"shape": "tiny LLaVA" if args.tiny else "LLaVA-1.5 layout: CLIP ViT-L/14-336 + MLP projector + "
                  "Llama-3.1-8B", "dtype": "bfloat16", "weights": "random",
                  "vision": dataclasses.asdict(config.vision), "feature_layers": list(config.feature_layers),
                  "text": {"layers": config.text.num_layers, "hidden": config.text.hidden_size,
                           "heads": config.text.num_heads, "kv_heads": config.text.num_kv_heads,
                           "mlp": config.text.intermediate_size, "vocab": config.text.vocab_size},
                  "tokens_per_image": config.tokens_per_image, "image_token_id": config.image_token_id,
                  "flops_per_image": flops_per_image(config)},
        "engine": dataclasses.asdict(engine),
        "trace": {"requests": args.requests, "image_requests": len(images),
                  "text_only_requests": args.requests - len(images), "images_per_request": 1,
                  "text_len": [args.min_len, args.max_len], "output_len": [args.min_len, args.max_len],
                  "prompt_tokens": sum(len(p) for p in vtrace.prompts),
                  "image_tokens": len(images) * config.tokens_per_image,
                  "output_tokens": int(vtrace.trace.output_lens.sum()), "arrivals": "all at t=0", "seed": args.seed},
        "adapters": {"r": LORA.r, "lora_alpha": LORA.lora_alpha, "target_modules": list(LORA.target_modules),
                     "weight_sets": args.weight_sets, "bytes_per_adapter_float32": factory.bytes_per_set,
                     "spread": "uniform (balanced permutation)"},
        "settings": vars(args), "cases": [], "skipped": [],
    }


def run_cases(args, model, processor, engine, vtrace, factory, shapes, report, started) -> None:
    """The base case (always: every ratio needs it), then each adapter count, written after each;
    an adapter case that would end past --time-budget (1.3x the case before it) is skipped with a message."""
    last_s = 0.0
    for adapters in [0] + list(args.adapters):
        elapsed = time.perf_counter() - started
        if adapters and args.time_budget and elapsed + 1.3 * last_s > args.time_budget:
            print(f"{case_name(adapters):12} skipped (time budget: {elapsed:.0f} s used, ~{1.3 * last_s:.0f} s needed)",
                  flush=True)
            report["skipped"].append(adapters)
            write_report(args.out, report)
            continue
        case_start = time.perf_counter()
        result = run_case(model, processor, engine, vtrace, adapters, factory, shapes[adapters], report["tower_ms"],
                          args.warmup_runs)
        last_s = time.perf_counter() - case_start
        base = report["cases"][0] if report["cases"] else result
        result["vs_base"] = {key: result[key] / base[key] for key in RATIOS}
        report["cases"].append(result)
        print_case(result)
        write_report(args.out, report)


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    use_compile_cache(args.compile_cache)
    config = llava_config(args.layers, args.tiny)
    model, processor = build_model(config)
    serving = ImageServing(model, processor)
    vtrace = make_vision_trace(serving, args.requests, args.min_len, args.max_len, args.text_share, args.seed)
    engine = engine_config(args, vtrace)
    factory = AdapterFactory(config.text, args.weight_sets)
    device = jax.devices()[0].device_kind
    print(f"device: {device}, jax {jax.__version__}; {config.text.num_layers}-layer LM, tower {config.vision.num_layers} "
          f"layers, {config.tokens_per_image} tokens an image; {args.requests} requests, cases base + "
          f"{args.adapters} adapters; ready in {time.perf_counter() - started:.1f} s", flush=True)
    report = describe(args, config, vtrace, engine, factory)
    most = max_image_requests(engine.for_platform(jax.default_backend()), config.tokens_per_image, args.requests)
    report["tower_ms"] = tower_times(serving, most, 3 if args.tiny else 10)
    print("tower encode ms by images: " + ", ".join(f"{n}: {ms:.2f}" for n, ms in report["tower_ms"].items()), flush=True)
    engine, shapes, report["compile"] = compile_with_fallback(model, serving, engine, vtrace, [0] + list(args.adapters),
                                                             factory, args.compile_threads)
    report["engine"] = dataclasses.asdict(engine)
    print(f"compiled {report['compile']['programs']} step programs in {report['compile']['seconds']:.1f} s "
          f"({args.compile_threads} threads); {time.perf_counter() - started:.0f} s so far", flush=True)
    if args.compile_only:
        return report
    print(f"device: {device}", flush=True)
    print(HEADER, flush=True)
    run_cases(args, model, processor, engine, vtrace, factory, shapes, report, started)
    report["total_s"] = time.perf_counter() - started
    write_report(args.out, report)
    print(f"device: {device}, jax {jax.__version__}, backend {engine.lora_backend}; {report['total_s']:.0f} s; "
          f"wrote {args.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
