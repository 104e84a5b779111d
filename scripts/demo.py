"""`make demo`: train three LoRA adapters together on the embedded SmolLM2-135M-Instruct model, each
on its own generated skill, then answer every task with the base model and with each adapter, side
by side in one batch, and print the accuracy table and a few answers. Finally serve the adapters
with `jaxlora-serve` (OpenAI-compatible HTTP) and query each one through the API."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import yaml

from jaxlora.generate import SamplingParams, generate
from jaxlora.lora.pool import AdapterPool
from jaxlora.weights import load_model
from train.config import load_train_config
from train.demo_tasks import DEMO_TASKS as TASKS, is_correct, make_examples, write_jsonl
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def _wait_healthy(base_url: str, server: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"jaxlora-serve exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("jaxlora-serve did not become healthy in time")


def serve_and_query(adapter_dir: str, names: list[str]) -> None:
    """Starts jaxlora-serve with the trained adapters and asks each (and the base model) one question."""
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    # A 256-token context (the questions and answers are a few dozen tokens): the server compiles
    # its step programs before it reports healthy, one per token bucket x block-table width bucket.
    command = [sys.executable, "-m", "serve", "--model", "default", "--port", str(port),
               "--max-adapters-on-device", "2", "--max-model-len", "256", "--log-level", "warning"]
    for name in names:
        command += ["--adapter", f"{name}={os.path.join(adapter_dir, name)}"]
    print(f"\nserving the adapters: jaxlora-serve on {base_url} (2 device slots for 3 adapters) ...")
    server = subprocess.Popen(command)
    try:
        _wait_healthy(base_url, server)
        models = [m["id"] for m in json.load(urllib.request.urlopen(f"{base_url}/v1/models"))["data"]]
        print(f"GET /v1/models -> {models}")
        for name in names:
            prompt = make_examples(name, 1, seed=2)[0]["prompt"]
            for model in (name, "SmolLM2-135M-Instruct"):
                answer = _post(f"{base_url}/v1/completions",
                               {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0})
                text = answer["choices"][0]["text"].split("\n")[0]
                print(f"POST /v1/completions model={model!r:26} {prompt!r} -> {text!r}")
    finally:
        server.terminate()
        server.wait(timeout=30)


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
    serve_and_query(config.output_dir, [a.name for a in adapters])
    print(f"\ndone in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
