"""Compress-then-Serve quality on real text: train one adapter per generated task on the
embedded SmolLM2-135M-Instruct (`jaxlora-train`'s `Trainer`, all together), compress the
collection with each method at several ranks and cluster counts (`jaxlora.compress`), and serve
every compressed adapter on its own task: the fraction of its own (uncompressed) accuracy kept,
its reconstruction error, and the collection's parameters against the originals.

    PYTHONPATH=. python bench/compress_quality.py [--tasks 16] [--steps 16] [--eval 20] [--out FILE]

Tasks: `train.demo_tasks.TASKS` (16 kinds: word picking, spelling, counting, small arithmetic),
answers checked exactly (`is_correct`). Adapters: r=8, alpha=16 on q/k/v/o (as `make demo`).
Compressed adapters are served the way `jaxlora-serve --compressed` serves them: JD collections
through the `compressed` LoRA backend (shared bases + per-adapter cores, one batch with every
adapter's rows), SVD collections as ordinary rank-r adapters from the device pool. Greedy, 8 new
tokens. Writes JSON (device, jax version, date, settings, per-adapter results) and a PNG with the
analogues of the paper's Fig. 2-4: accuracy kept against parameters, against reconstruction
error, and per method and rank."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from jaxlora.compress.collection import Source, compress, source_parameter_count
from jaxlora.generate import SamplingParams, generate
from jaxlora.lora.compressed import with_compressed
from jaxlora.lora.pool import AdapterPool
from jaxlora.weights import load_model
from train.config import load_train_config
from train.demo_tasks import TASKS, is_correct, make_examples, write_jsonl
from train.trainer import Trainer

# (method, rank, clusters): SVD per adapter; JD-Full and JD-Diag over one basis and over clusters.
CONFIGS = [("svd", 1, 1), ("svd", 2, 1), ("svd", 4, 1),
           ("jd-full", 8, 1), ("jd-full", 16, 1), ("jd-full", 24, 1), ("jd-full", 32, 1), ("jd-full", 8, 4), ("jd-full", 16, 2),
           ("jd-diag", 16, 1), ("jd-diag", 24, 1), ("jd-diag", 32, 1)]
NEW_TOKENS = 8


def train_adapters(run_dir: str, tasks: list[str], steps: int, examples: int, model, tokenizer):
    """Trains one r=8 adapter per task together; returns them (host LoraAdapters)."""
    jobs = []
    for index, task in enumerate(tasks):
        write_jsonl(os.path.join(run_dir, "data", f"{task}.jsonl"), make_examples(task, examples, seed=0))
        jobs.append({"name": task, "dataset": f"data/{task}.jsonl", "global_batch_size": 8, "steps": steps,
                     "learning_rate": 2e-3, "seed": index,
                     "lora": {"r": 8, "alpha": 16, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}})
    path = os.path.join(run_dir, "jobs.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"base_model": "default", "output_dir": "adapters", "capacity": 512, "checkpoint_every": 1000,
                        "solver_time_limit": 0.5, "progress": False, "jobs": jobs}, f, sort_keys=False)
    trainer = Trainer(load_train_config(path), model, tokenizer)
    trainer.run()
    return trainer.adapters()


def eval_rows(tasks: list[str], count: int, tokenizer):
    """(prompts, expected completions, task index) of `count` held-out examples per task."""
    prompts, answers, owner = [], [], []
    for index, task in enumerate(tasks):
        for example in make_examples(task, count, seed=1):
            prompts.append(tokenizer.encode(example["prompt"]))
            answers.append(example["completion"])
            owner.append(index)
    return prompts, answers, np.array(owner)


def accuracy(model, tokenizer, prompts, answers, owner, pool_arrays, row_slots, backend="gather") -> np.ndarray:
    """[tasks] accuracy: each row generated with its slot (all rows in one batch)."""
    outputs = generate(model, prompts, SamplingParams(max_new_tokens=NEW_TOKENS), tokenizer.eos_token_ids,
                       pool_arrays=pool_arrays, row_slots=row_slots, lora_backend=backend)
    correct = np.array([is_correct(tokenizer.decode(out), answer) for out, answer in zip(outputs, answers)])
    return np.array([correct[owner == t].mean() for t in range(owner.max() + 1)])


def evaluate_adapters(model, tokenizer, rows, adapters) -> np.ndarray:
    """Each task's accuracy with its own ordinary adapter (from the device pool)."""
    pool = AdapterPool(model.config, num_slots=len(adapters), max_rank=max(a.max_rank for a in adapters))
    for slot, adapter in enumerate(adapters):
        pool.load(adapter, slot=slot)
    prompts, answers, owner = rows
    return accuracy(model, tokenizer, prompts, answers, owner, pool.arrays, owner.tolist())


def evaluate_compressed(model, tokenizer, rows, collection) -> np.ndarray:
    """Each task's accuracy with its compressed adapter, served as `jaxlora-serve --compressed` does."""
    if collection.method == "svd":
        return evaluate_adapters(model, tokenizer, rows, [collection.as_adapter(n) for n in collection.names])
    pool = AdapterPool(model.config, num_slots=1, max_rank=1, target_modules=collection.modules)
    arrays = with_compressed(pool.arrays, collection.serving_set().device_arrays(model.dtype))
    prompts, answers, owner = rows
    return accuracy(model, tokenizer, prompts, answers, owner, arrays, (1 + owner).tolist(), backend="compressed")


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    colors = {"svd": "tab:blue", "jd-full": "tab:red", "jd-diag": "tab:green"}
    for run in report["runs"]:
        kept = [a["kept"] for a in run["adapters"] if a["kept"] is not None]
        label = f"{run['method']} r={run['rank']}" + (f" k={run['clusters']}" if run["clusters"] > 1 else "")
        color = colors[run["method"]]
        axes[0].scatter(run["reduction"], np.mean(kept), color=color, s=40)
        axes[0].annotate(label, (run["reduction"], np.mean(kept)), fontsize=7)
        axes[1].scatter([a["error"] for a in run["adapters"]], [a["kept"] for a in run["adapters"]], color=color,
                        s=8, alpha=0.6)
        axes[2].bar(label, np.mean(kept), color=color)
        axes[2].plot([label], [min(kept)], "k_", markersize=12)
    axes[0].set(xscale="log", xlabel="parameter reduction (originals / compressed)", ylabel="mean accuracy kept",
                title="Fig. 2 analogue: quality vs memory")
    axes[1].set(xlabel="relative reconstruction error (q/k/v/o mean)", ylabel="accuracy kept",
                title="Fig. 3 analogue: per adapter")
    axes[2].set(ylabel="mean accuracy kept (bar), worst adapter (tick)", title="Fig. 4 analogue: per method")
    axes[2].tick_params(axis="x", rotation=70, labelsize=7)
    for ax in axes:
        ax.axhline(0.95, color="gray", linestyle=":", linewidth=1)
    fig.suptitle(f"Compress-then-Serve on SmolLM2-135M, {len(report['tasks'])} task adapters "
                 f"({report['device']}, jax {report['jax']}, {report['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=16, help=f"how many of the {len(TASKS)} task kinds")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per adapter (batch 8)")
    parser.add_argument("--train-examples", type=int, default=128)
    parser.add_argument("--eval", type=int, default=20, help="held-out examples per task")
    parser.add_argument("--iters", type=int, default=30, help="alternating iterations of the JD methods")
    parser.add_argument("--run-dir", default="/tmp/jaxlora_compress_quality")
    parser.add_argument("--out", default="bench/results/compress_quality_cpu.json")
    args = parser.parse_args()
    started = time.time()
    tasks = list(TASKS)[: args.tasks]
    model, tokenizer = load_model("default")
    adapters = train_adapters(args.run_dir, tasks, args.steps, args.train_examples, model, tokenizer)
    trained = time.time()
    print(f"trained {len(adapters)} adapters in {trained - started:.0f} s", flush=True)
    rows = eval_rows(tasks, args.eval, tokenizer)
    base = accuracy(model, tokenizer, *rows, None, None)
    own = evaluate_adapters(model, tokenizer, rows, adapters)
    for task, b, o in zip(tasks, base, own):
        print(f"  {task:<16} base {b:5.0%}  adapter {o:5.0%}")
    sources = [Source(a, base_model="SmolLM2-135M-Instruct") for a in adapters]
    original = source_parameter_count(sources)
    report = {"device": jax.devices()[0].device_kind, "platform": platform.platform(), "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "settings": vars(args), "tasks": tasks,
              "original_parameters": original, "train_seconds": round(trained - started, 1),
              "base_accuracy": base.tolist(), "adapter_accuracy": own.tolist(), "runs": []}
    for method, rank, clusters in [c for c in CONFIGS if c[2] <= len(tasks)]:
        t0 = time.time()
        collection = compress(sources, model.config, method, rank, clusters, "SmolLM2-135M-Instruct", args.iters)
        seconds = time.time() - t0
        acc = evaluate_compressed(model, tokenizer, rows, collection)
        per_adapter = []
        for t, task in enumerate(tasks):
            errors = collection.errors[task]
            per_adapter.append({"task": task, "accuracy": float(acc[t]), "own_accuracy": float(own[t]),
                                "kept": float(acc[t] / own[t]) if own[t] > 0 else None,
                                "cluster": int(collection.cluster[t]), "errors": errors,
                                "error": float(np.mean(list(errors.values())))})
        kept = [a["kept"] for a in per_adapter if a["kept"] is not None]
        run = {"method": method, "rank": rank, "clusters": clusters, "parameters": collection.parameter_count(),
               "reduction": original / collection.parameter_count(), "compress_seconds": round(seconds, 2),
               "mean_kept": float(np.mean(kept)), "min_kept": float(np.min(kept)), "adapters": per_adapter}
        report["runs"].append(run)
        print(f"{method:8} r={rank:<3} k={clusters}  params /{run['reduction']:5.1f}  kept mean {run['mean_kept']:5.1%} "
              f"min {run['min_kept']:5.1%}  error {np.mean([a['error'] for a in per_adapter]):.3f}  "
              f"({seconds:.1f} s)", flush=True)
        report["total_seconds"] = round(time.time() - started, 1)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.out)[0] + ".png")
    print(f"done in {time.time() - started:.0f} s: {args.out}")


if __name__ == "__main__":
    main()
