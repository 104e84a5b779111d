"""Multi-adapter LoRA training throughput on a Llama-3.1-8B-shaped model (random bf16 weights).

    PYTHONPATH=. python3 bench/train.py [--layers 8] [--capacity 8192] [--workloads xsum cnndm wikisum mixed]

Four adapters (r=16, alpha=32, dropout 0.1, all seven projections) on the lognormal workloads
(docs/architecture.md, "Benchmark workloads"), measured in one run, tokens/s counting real
(unpadded) tokens:
  jaxlora        our schedule (mixed-adapter microbatches, MILP + merging), fused LoRA kernels;
  jaxlora-xla    our schedule, the unfused XLA LoRA path (one-hot einsum: x @ A of every slot);
  sequential     (a) the 4 jobs one after another, each packed alone, the same unfused XLA path;
  peft-best      (b) HF transformers + peft, one job at a time, full 4096-token rows, no padding;
  peft-padded    (b) HF transformers + peft, one job at a time, batches of 4 samples padded to
                 the longest.
Compilation and the (ahead-of-time) scheduling are outside the timed region. Writes JSON to --out.
`--breakdown` first times one grad step on the fullest microbatch with each attention variant
(masked XLA softmax; attention left out; `jax.nn.dot_product_attention`; the flash kernel with
several tiles) to show what the step's time goes to, and keeps the fastest flash tiles for the run.
Run the JAX variants and the PyTorch variants in separate processes (JAX holds most of the GPU
memory while it lives): `--variants jaxlora-xla sequential` then `--variants peft-best peft-padded`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

# Run as a script, this file's folder comes first on sys.path and its name would hide the
# `train` package: look it up from the repository root instead.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.timing import kernel_times, median_call_seconds
import jaxlora.models.llama as llama_module
import pallas_kernels.attention as attention_module
from pallas_kernels.attention import FlashBlocks
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.pool import AdapterPool
from jaxlora.lora.trainable import apply_adapter_update, slot_params, split_pool
from jaxlora.nn.model_config import PROJECTIONS, LlamaConfig
from jaxlora.models.llama import Llama
from jaxlora.models.presets import llama8b_config
from jaxlora.parallel.grad_step import make_grad_step
from jaxlora.scheduler.training.greedy import per_adapter_first_fit
from jaxlora.scheduler.training.schedule import SchedulerConfig, build_schedule
from jaxlora.scheduler.training.workloads import synthetic_data
from train.config import JobConfig
from train.data import TokenizedSample
from train.optim import make_optimizer
from train.microbatch import add_trees, device_batch, pack_microbatch

LORA = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.1, target_modules=PROJECTIONS)


def make_samples(data, vocab: int, seed: int) -> dict:
    """Random token ids for every (adapter, sample index) of the workload."""
    rng = np.random.default_rng(seed)
    return {(a, i): TokenizedSample(rng.integers(0, vocab, n, dtype=np.int32), np.ones(n, bool), "synthetic")
            for a in data.adapters for i, n in enumerate(data.lengths[a])}


def batch_weights(data) -> dict:
    """1 / target tokens of each (adapter, global batch)."""
    out = {}
    for a in data.adapters:
        size = data.global_batch_size[a]
        for b in range(data.num_batches(a)):
            out[(a, b)] = 1.0 / sum(n - 1 for n in data.lengths[a][b * size:(b + 1) * size])
    return out


_GRAD_STEPS: dict = {}


UNROLL_LAYERS = True  # --no-unroll turns it off


def cached_grad_step(model, num_adapters, backend):
    """One jitted step per backend for the whole run (compiled once, reused by every workload)."""
    if backend not in _GRAD_STEPS:
        _GRAD_STEPS[backend] = make_grad_step(model, num_adapters, backend, unroll_layers=UNROLL_LAYERS)
    return _GRAD_STEPS[backend]


class JaxloraRun:
    """Trains the adapters of a pool over a list of microbatches, per-adapter AdamW."""

    def __init__(self, model, pool, num_adapters, backend, steps_per_adapter):
        trainable, self.frozen = split_pool(pool.arrays)
        self.trainable = jax.tree.map(jnp.copy, trainable)  # updates donate it: keep the pool intact
        self.num_slots = num_adapters
        self.grad_step = cached_grad_step(model, num_adapters, backend)
        job = JobConfig(name="bench", dataset="", lora=LORA, learning_rate=1e-4)
        self.optimizers = [make_optimizer(job, steps_per_adapter) for _ in range(num_adapters)]
        self.opt_states = [o.init(slot_params(self.trainable, i, LORA.r)) for i, o in enumerate(self.optimizers)]
        self.grads_acc = jax.tree.map(jnp.zeros_like, self.trainable)
        self.dropout = jnp.full(num_adapters, LORA.lora_dropout, jnp.float32)

    def microbatch(self, index, entries, capacity):
        arrays = pack_microbatch(entries, capacity, self.num_slots)
        batch, plan = device_batch(arrays, self.num_slots)
        key = jax.random.fold_in(jax.random.key(0), index)
        _, grads = self.grad_step(self.trainable, self.frozen, batch, plan, self.dropout, key)
        self.grads_acc = add_trees(self.grads_acc, grads)

    def step(self, slot):
        self.trainable, self.grads_acc, self.opt_states[slot] = apply_adapter_update(
            self.optimizers[slot], self.trainable, self.grads_acc, slot, LORA.r, self.opt_states[slot])

    def sync(self):
        jax.block_until_ready(self.trainable)


def run_microbatches(run: JaxloraRun, microbatches, data, samples, weights, capacity) -> None:
    seen = {a: 0 for a in data.adapters}
    for index, microbatch in enumerate(microbatches):
        entries = []
        for s in microbatch:
            batch = s.sample_index // data.global_batch_size[s.adapter_id]
            entries.append((s.adapter_id, samples[(s.adapter_id, s.sample_index)], weights[(s.adapter_id, batch)]))
        if entries:
            run.microbatch(index, entries, capacity)
        for s in microbatch:
            seen[s.adapter_id] += 1
            if seen[s.adapter_id] % data.global_batch_size[s.adapter_id] == 0:
                run.step(s.adapter_id)
    run.sync()


def time_jaxlora(model, pool, data, samples, microbatches, capacity, backend) -> dict:
    weights = batch_weights(data)
    run = JaxloraRun(model, pool, len(data.adapters), backend, max(data.num_batches(a) for a in data.adapters))
    run_microbatches(run, microbatches[:1], data, samples, weights, capacity)  # compile the step
    for slot in data.adapters:  # compile each adapter's optimizer step (zero gradient: no change)
        run.step(slot)
    run.sync()
    start = time.perf_counter()
    run_microbatches(run, microbatches, data, samples, weights, capacity)
    elapsed = time.perf_counter() - start
    tokens = sum(s.num_tokens for mb in microbatches for s in mb)
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed, "tokens": tokens,
            "microbatches": len(microbatches)}


def _stand_in_attention(q, k, v, mask):
    """Leave-one-out: attention replaced by its query (same shape, gradients still flow)."""
    return q


# name -> (the model's packed attention, a replacement of `attend` or None, flash tiles or None,
# the layer scan unrolled)
ATTENTION_VARIANTS = {
    "no attention (leave-one-out)": ("masked", _stand_in_attention, None, True),
    "flash, JAX kernel (skips above the diagonal)": ("flash", None, FlashBlocks(128, 64, 64, kernel="jax"), True),
    "flash spans q128 k64 bwd64": ("flash", None, FlashBlocks(128, 64, 64), True),
    "flash spans q128 k64 bwd64 s3": ("flash", None, FlashBlocks(128, 64, 64, num_stages=3), True),
    "flash spans q64 k64 bwd64 w4": ("flash", None, FlashBlocks(64, 64, 64, num_warps=4), True),
    "flash spans q128 k64 bwd128 w8": ("flash", None, FlashBlocks(128, 64, 128, num_warps=8), True),
}


def step_args(pool, microbatch, samples, capacity: int) -> tuple:
    """The grad step's arguments for one scheduled microbatch (4 adapter slots)."""
    entries = [(s.adapter_id, samples[(s.adapter_id, s.sample_index)], 1.0) for s in microbatch]
    batch, plan = device_batch(pack_microbatch(entries, capacity, 4), 4)
    trainable, frozen = split_pool(pool.arrays)
    dropout = jnp.full(4, LORA.lora_dropout, jnp.float32)
    return trainable, frozen, batch, plan, dropout, jax.random.key(0)


def breakdown(model, pool, microbatch, samples, capacity: int, repeats: int) -> list[dict]:
    """Seconds of one compiled grad step (one-hot XLA LoRA backend) on one full microbatch with each
    of ATTENTION_VARIANTS: what attention costs and which flash tiles to use."""
    args = step_args(pool, microbatch, samples, capacity)
    real = sum(s.num_tokens for s in microbatch)
    original_attend, original_blocks = llama_module.attend, attention_module.DEFAULT_BLOCKS
    out = []
    for name, (impl, replacement, blocks, unroll) in ATTENTION_VARIANTS.items():
        llama_module.attend = replacement or original_attend
        attention_module.DEFAULT_BLOCKS = blocks or original_blocks
        try:
            step = make_grad_step(model, 4, "onehot", attention=impl, unroll_layers=unroll)  # traced at 1st call
            jax.block_until_ready(step(*args))  # compile
            seconds = median_call_seconds(lambda: step(*args), repeats)
            out.append({"variant": name, "step_s": seconds, "tokens_per_s": real / seconds})
        except Exception as err:  # e.g. tiles over the shared memory: record it, keep going
            out.append({"variant": name, "error": f"{type(err).__name__}: {str(err)[:300]}"})
        finally:
            llama_module.attend, attention_module.DEFAULT_BLOCKS = original_attend, original_blocks
        print(f"breakdown  {name:36} " + (f"{out[-1]['step_s'] * 1e3:8.1f} ms/step "
              f"{out[-1]['tokens_per_s']:9.0f} tokens/s" if "step_s" in out[-1] else out[-1]["error"]), flush=True)
    return out


def profile_steps(model, pool, microbatch, samples, capacity: int, backends, log_dir: str) -> list[dict]:
    """Per-kernel device time of the grad step (flash attention) for each LoRA backend, from a
    profiler trace: where the step's time goes."""
    args = step_args(pool, microbatch, samples, capacity)
    out = []
    for backend in backends:
        step = cached_grad_step(model, 4, backend)
        times = kernel_times(lambda: step(*args), 3, os.path.join(log_dir, backend))
        out.append({"backend": backend, **{k: v for k, v in times.items() if k != "kernels"},
                    "top_kernels": times["kernels"][:60]})
        print(f"profile {backend}: device {times['device_ms']:.1f} ms, wall {times['wall_ms']:.1f} ms per step; "
              + ", ".join(f"{c} {ms:.1f}" for c, ms in sorted(times["categories"].items(), key=lambda c: -c[1])))
        for kernel in times["kernels"][:12]:
            print(f"   {kernel['total_ms']:7.2f} ms  x{kernel['calls']:<5.0f} {kernel['name'][:110]}")
    return out


def use_fastest_flash_blocks(steps: list[dict]) -> str | None:
    """Makes the fastest flash variant of a breakdown the default tiles for the rest of the run."""
    timed = [s for s in steps if "step_s" in s and ATTENTION_VARIANTS[s["variant"]][0] == "flash"]
    if not timed:
        return None
    best = min(timed, key=lambda s: s["step_s"])["variant"]
    attention_module.DEFAULT_BLOCKS = ATTENTION_VARIANTS[best][2]
    return best


def time_peft(config: LlamaConfig, data, samples, mode: str) -> dict:
    """HF transformers + peft, one job at a time (all jobs timed; model built once per job)."""
    import torch
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    hf_config = HFLlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                              intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                              num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                              max_position_embeddings=8192, attn_implementation="sdpa")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        base = LlamaForCausalLM(hf_config).to(torch.bfloat16)
    total_tokens, total_time = 0, 0.0
    for adapter in data.adapters:
        model = get_peft_model(base, PeftLoraConfig(r=LORA.r, lora_alpha=LORA.lora_alpha, lora_dropout=0.1,
                                                    target_modules=list(PROJECTIONS)))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        batches = _peft_batches(data, samples, adapter, mode, device)
        for tokens, labels in batches[:1]:  # warm-up
            _peft_step(model, optimizer, tokens, labels)
        torch.cuda.synchronize() if device == "cuda" else None
        start = time.perf_counter()
        for tokens, labels in batches:
            _peft_step(model, optimizer, tokens, labels)
        torch.cuda.synchronize() if device == "cuda" else None
        total_time += time.perf_counter() - start
        total_tokens += sum(int((labels != -100).sum()) for _, labels in batches)
        base = model.unload()
    return {"tokens_per_s": total_tokens / total_time, "seconds": total_time, "tokens": total_tokens}


def _peft_batches(data, samples, adapter, mode, device):
    import torch

    lengths = data.lengths[adapter]
    if mode == "best":  # the same number of real tokens, as full 4096-token rows, 2 per step
        total = sum(lengths)
        width = min(4096, total)
        rows = total // width
        flat = np.concatenate([samples[(adapter, i)].tokens for i in range(len(lengths))])[: rows * width]
        out = []
        for start in range(0, rows, 2):
            tokens = torch.as_tensor(flat[start * width:(start + 2) * width].reshape(-1, width).astype(np.int64),
                                     device=device)
            out.append((tokens, tokens.clone()))
        return out
    out = []
    for start in range(0, len(lengths), 4):
        group = [samples[(adapter, i)].tokens for i in range(start, min(start + 4, len(lengths)))]
        width = max(len(g) for g in group)
        tokens = np.zeros((len(group), width), np.int64)
        labels = np.full((len(group), width), -100, np.int64)
        for row, g in enumerate(group):
            tokens[row, : len(g)], labels[row, : len(g)] = g, g
        out.append((torch.as_tensor(tokens, device=device), torch.as_tensor(labels, device=device)))
    return out


def _peft_step(model, optimizer, tokens, labels):
    loss = model(input_ids=tokens, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=2, help="global batches per adapter")
    parser.add_argument("--workloads", nargs="+", default=["xsum", "cnndm", "wikisum", "mixed"])
    parser.add_argument("--variants", nargs="*",
                        default=["jaxlora", "jaxlora-xla", "sequential", "peft-best", "peft-padded"])
    parser.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    parser.add_argument("--out", default="bench/results/train.json")
    parser.add_argument("--breakdown", action="store_true",
                        help="first: time one grad step on a full microbatch with the model's attention, with "
                             "attention left out, and with jax.nn.dot_product_attention")
    parser.add_argument("--profile", nargs="*", default=None, metavar="BACKEND",
                        help="time each kernel of the grad step (profiler trace) for these LoRA backends "
                             "(default: onehot fused) on the fullest microbatch, after --breakdown")
    parser.add_argument("--no-unroll", action="store_true",
                        help="keep the layer scan rolled in the jaxlora/sequential runs (default: unrolled)")
    parser.add_argument("--plot-from", nargs="+", default=None,
                        help="result JSONs (e.g. the JAX and the PyTorch process of one device call): write "
                             "their bar chart to --out's .png and exit")
    args = parser.parse_args()
    global UNROLL_LAYERS
    UNROLL_LAYERS = not args.no_unroll
    if args.plot_from:
        plot(args.plot_from, os.path.splitext(args.out)[0] + ".png")
        return
    config = llama8b_config(args.layers, args.tiny)
    model = pool = None
    if any(v.startswith(("jaxlora", "sequential")) for v in args.variants) or args.breakdown or args.profile is not None:
        model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
        pool = AdapterPool(config, num_slots=4, max_rank=LORA.r, dtype=jnp.bfloat16)
        for index in range(4):
            pool.load(random_adapter(f"adapter{index}", config, LORA, seed=index))
    results = []
    device = jax.devices()[0].device_kind
    if (args.breakdown or args.profile is not None) and model is not None:
        data = synthetic_data(args.workloads[0], 4, args.batches * args.global_batch, args.global_batch, seed=1)
        ours = build_schedule(data, SchedulerConfig(capacity=args.capacity, padding_multiple=1, time_limit_s=1.0))
        fullest = max(ours.microbatches, key=lambda mb: sum(s.num_tokens for s in mb))
        fullest_samples = make_samples(data, config.vocab_size, seed=2)
    if args.breakdown and model is not None:
        steps = breakdown(model, pool, fullest, fullest_samples, args.capacity, 5)
        results.append({"workload": args.workloads[0], "variant": "breakdown", "tokens_in_microbatch":
                        sum(s.num_tokens for s in fullest), "steps": steps,
                        "flash_blocks_used": use_fastest_flash_blocks(steps)})
        _write_report(args, device, results)
    if args.profile is not None and model is not None:
        results.append({"workload": args.workloads[0], "variant": "profile", "steps": profile_steps(
            model, pool, fullest, fullest_samples, args.capacity, args.profile or ["onehot", "fused"],
            tempfile.mkdtemp(prefix="jaxlora_trace_"))})
        _write_report(args, device, results)
    for workload in (args.workloads if args.variants else []):
        data = synthetic_data(workload, 4, args.batches * args.global_batch, args.global_batch, seed=1)
        samples = make_samples(data, config.vocab_size, seed=2)
        ours = build_schedule(data, SchedulerConfig(capacity=args.capacity, padding_multiple=1, time_limit_s=1.0))
        alone = per_adapter_first_fit(data.all_samples(), args.capacity, 1)
        runs = {"jaxlora": lambda: time_jaxlora(model, pool, data, samples, ours.microbatches, args.capacity, "fused"),
                "jaxlora-xla": lambda: time_jaxlora(model, pool, data, samples, ours.microbatches, args.capacity, "onehot"),
                "sequential": lambda: time_jaxlora(model, pool, data, samples, alone, args.capacity, "onehot"),
                "peft-best": lambda: time_peft(config, data, samples, "best"),
                "peft-padded": lambda: time_peft(config, data, samples, "padded")}
        for variant in args.variants:
            result = {"workload": workload, "variant": variant, **runs[variant]()}
            results.append(result)
            print(f"{workload:8} {variant:12} {result['tokens_per_s']:10.0f} tokens/s  ({result['seconds']:.2f} s)",
                  flush=True)
            _write_report(args, device, results)  # after every variant: a crash keeps what was measured
    print(f"device: {device}, jax {jax.__version__}, {args.layers} layers; wrote {args.out}")


def _write_report(args, device: str, results: list) -> None:
    report = {"device": device, "jax": jax.__version__, "date": datetime.date.today().isoformat(),
              "host": platform.node(), "layers": args.layers, "capacity": args.capacity,
              "global_batch": args.global_batch, "batches": args.batches, "unroll_layers": UNROLL_LAYERS,
              "flash_blocks": str(attention_module.DEFAULT_BLOCKS), "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


def plot(paths: list, png: str) -> None:
    """Tokens/s per workload and variant, from result JSONs measured on one device."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [json.load(open(p)) for p in paths]
    results = [r for report in reports for r in report["results"] if "tokens_per_s" in r]  # not breakdown/profile
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    variants = list(dict.fromkeys(r["variant"] for r in results))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, variant in enumerate(variants):
        values = [next((r["tokens_per_s"] for r in results if r["workload"] == w and r["variant"] == variant), 0)
                  for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=variant)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("tokens/s (real tokens)")
    first = reports[0]
    ax.set_title(f"4 adapters, {first['layers']}-layer Llama-3.1-8B shape, {first['device']}, jax {first['jax']}, "
                 f"{first['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
