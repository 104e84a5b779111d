"""`make demo`: train three LoRA adapters together on the embedded SmolLM2-135M-Instruct model, each
on its own generated skill, then answer every task with the base model and with each adapter, side
by side in one batch, and print the accuracy table and a few answers."""

import os
import time

import yaml

from jaxlora.generate import SamplingParams, generate
from jaxlora.lora.pool import AdapterPool
from jaxlora.weights import load_model
from train.config import load_train_config
from train.demo_tasks import TASKS, is_correct, make_examples, write_jsonl
from train.trainer import Trainer

RUN_DIR = os.environ.get("JAXLORA_DEMO_DIR", "runs/demo")
TRAIN_EXAMPLES, EVAL_EXAMPLES, STEPS = 96, 12, 12


def write_jobs() -> str:
    """Datasets (generated, deterministic) and the jobs file; returns the jobs file's path."""
    jobs = []
    for index, task in enumerate(TASKS):
        write_jsonl(os.path.join(RUN_DIR, "data", f"{task}.jsonl"), make_examples(task, TRAIN_EXAMPLES, seed=0))
        jobs.append({"name": task, "dataset": f"data/{task}.jsonl", "global_batch_size": 8, "steps": STEPS,
                     "learning_rate": 2e-3, "seed": index,
                     "lora": {"r": 8 * (index + 1), "alpha": 16 * (index + 1), "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}})
    config = {"base_model": "default", "output_dir": "adapters", "capacity": 384, "checkpoint_every": 4,
              "solver_time_limit": 0.5, "jobs": jobs}
    path = os.path.join(RUN_DIR, "jobs.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path


def evaluate(model, tokenizer, adapters) -> tuple[dict, dict]:
    """Accuracy of the base model (slot -1) and of each adapter on every task, in one batch."""
    pool = AdapterPool(model.config, num_slots=len(adapters), max_rank=max(a.max_rank for a in adapters))
    slots = {"base model": -1} | {a.name: pool.load(a) for a in adapters}
    rows = []
    for task in TASKS:
        for example in make_examples(task, EVAL_EXAMPLES, seed=1):
            rows += [(name, slot, task, example) for name, slot in slots.items()]
    prompts = [tokenizer.encode(example["prompt"]) for _, _, _, example in rows]
    outputs = generate(model, prompts, SamplingParams(max_new_tokens=6), tokenizer.eos_token_ids,
                       pool_arrays=pool.arrays, row_slots=[slot for _, slot, _, _ in rows])
    scores, samples = {}, {}
    for (name, _, task, example), output in zip(rows, outputs):
        answer = tokenizer.decode(output)
        scores.setdefault((name, task), []).append(is_correct(answer, example["completion"]))
        samples.setdefault((name, task), (example, answer))
    return {key: sum(v) / len(v) for key, v in scores.items()}, samples


def print_table(accuracy: dict, names: list[str]) -> None:
    print(f"\n{'accuracy':<14}" + "".join(f"{task:>14}" for task in TASKS))
    for name in names:
        print(f"{name:<14}" + "".join(f"{accuracy[(name, task)]:>14.0%}" for task in TASKS))


def main() -> None:
    started = time.time()
    os.makedirs(RUN_DIR, exist_ok=True)
    config = load_train_config(write_jobs())
    model, tokenizer = load_model("default")
    print(f"training {len(config.jobs)} adapters together on SmolLM2-135M-Instruct "
          f"({STEPS} steps each, {TRAIN_EXAMPLES} examples per task) ...")
    trainer = Trainer(config, model, tokenizer)
    trainer.run()
    adapters = trainer.adapters()
    print(f"trained in {time.time() - started:.0f} s; adapters written to {config.output_dir}/<name> (PEFT format)")
    accuracy, samples = evaluate(model, tokenizer, adapters)
    print_table(accuracy, ["base model"] + [a.name for a in adapters])
    print("\none answer per task (prompt -> base model | its own adapter):")
    for task in TASKS:
        example, base_answer = samples[("base model", task)]
        _, own_answer = samples[(task, task)]
        print(f"  {example['prompt']!r}\n    base: {base_answer!r}   {task}: {own_answer!r}   "
              f"(expected {example['completion']!r})")
    print(f"\ndone in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
