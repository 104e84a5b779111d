"""Cold start of the real server: launch -> /health ready -> first completion of `jaxlora-serve`
on a random Llama-3.1-8B-shaped HF checkpoint with LoRA on (adapters from --adapter-dir), with an
empty and then a warm persistent compile cache, in one run (issue 35: measure first).

    PYTHONPATH=. python bench/cold_start.py [--layers 32] [--out FILE]     # on a GPU machine
    PYTHONPATH=. python bench/cold_start.py --tiny                          # CPU smoke test

What it writes first (resumable: kept when present under --dir): a HF directory (config.json,
bf16 safetensors in per-layer shards with an index, a tokenizer.json: a small BPE trained here,
its ids below the model's vocabulary) whose weights are slices of one random buffer (no 8B random
draws), and `--adapters` PEFT folders (r=16, all seven projections, bf16; `bench/slora_disk.py`'s
writer, folders task-0000..). Then per cache state
("cold": a fresh --compile-cache directory; "warm": the same directory again; "warm-lowered": the
same without the server's stored executables, `--no-executable-cache`) it starts
`python -m serve` with the README's engine sizes (64 adapter slots, rank 16, 256 rows, 2048-token
steps; --tiny: the CPU sizes), timestamps every log line the server prints, polls /health, sends
one completion naming an adapter, and stops the server. Reported per run: seconds from launch to
each of: the first log line, weights loaded (the server's "model loaded in" line), /health ready, the
first completion; per run `phases`: seconds from launch to the end of each start-up phase the
server logs (imports, backend, engine built, weights on the device, uvicorn, step programs ready,
/health ready, first completion) and the weights' and programs' own lines (GB/s; lowering vs
loading seconds); and the log with its timestamps. JSON (device, jax, date) at --out.
`--small`: a CPU run of the GPU's start-up path on the 8B shape scaled down (0.5 GB)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import ml_dtypes
import numpy as np

from bench.slora_disk import adapter_name, write_adapters
from jaxlora.nn.model_config import PROJECTIONS, LlamaConfig, projection_shapes
from jaxlora.models.presets import llama8b_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_NAMES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


# ---- the checkpoint -----------------------------------------------------------------------------

class Slices:
    """bf16 arrays cut from one random buffer at moving offsets (different values, no big draws)."""

    def __init__(self, seed: int = 0, size: int = 1 << 24):
        self.buffer = (np.random.default_rng(seed).standard_normal(size, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        self.offset = 0

    def take(self, shape) -> np.ndarray:
        start = self.offset % self.buffer.size
        self.offset += 7919
        return np.resize(self.buffer[start:], shape)  # repeats the buffer's tail cyclically


def hf_config(config: LlamaConfig) -> dict:
    """config.json of a Llama with `config`'s shape (llama3 RoPE scaling when it has one)."""
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
           "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
           "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
           "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "rms_norm_eps": 1e-5,
           "rope_theta": config.rope_theta, "max_position_embeddings": config.max_position_embeddings,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    if config.rope_scaling is not None:
        scaling = config.rope_scaling
        raw["rope_scaling"] = {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
                               "high_freq_factor": scaling.high_freq_factor,
                               "original_max_position_embeddings": scaling.original_max_position_embeddings}
    return raw


def write_checkpoint(directory: str, config: LlamaConfig) -> float:
    """The HF directory (module doc); seconds spent (0 when it was there already)."""
    from safetensors.numpy import save_file

    if os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        return 0.0
    started, slices, weight_map = time.perf_counter(), Slices(), {}
    os.makedirs(directory, exist_ok=True)
    shapes = projection_shapes(config)
    shards = {"model-embed.safetensors": {
        "model.embed_tokens.weight": slices.take((config.vocab_size, config.hidden_size)),
        "model.norm.weight": np.ones(config.hidden_size, ml_dtypes.bfloat16),
        "lm_head.weight": slices.take((config.vocab_size, config.hidden_size))}}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        tensors = {f"{prefix}.{HF_NAMES[m]}.{m}.weight": slices.take(shapes[m][::-1]) for m in PROJECTIONS}
        tensors[f"{prefix}.input_layernorm.weight"] = np.ones(config.hidden_size, ml_dtypes.bfloat16)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = np.ones(config.hidden_size, ml_dtypes.bfloat16)
        shards[f"model-layer{layer:03d}.safetensors"] = tensors
    for name, tensors in shards.items():
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})
    write_tokenizer(directory, config.vocab_size)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(config), f, indent=1)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:  # last: marks it complete
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return time.perf_counter() - started


def write_tokenizer(directory: str, vocab_size: int) -> None:
    """tokenizer.json: a byte-level BPE trained on a few sentences (ids < vocab_size), with <s>/</s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = ["The capital of France is Paris.", "Once upon a time there was a model.", "Write a short answer."] * 20
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 400), special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(text, trainer)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)


# ---- one launch ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache_listing(cache_dir: str) -> dict:
    """{sub-folder of the compile cache ("." its top): [files, bytes]} as a run finds it (a warm run that
    misses every stored program: were the files there? bench/NOTES_serve.md, twelfth session)."""
    listing: dict = {}
    for folder, _, files in os.walk(cache_dir):
        entry = listing.setdefault(os.path.relpath(folder, cache_dir), [0, 0])
        for name in files:
            entry[0] += 1
            entry[1] += os.path.getsize(os.path.join(folder, name))
    return listing


def launch(args, model_dir: str, adapter_dir: str, cache_dir: str, label: str) -> dict:
    """Starts the server, waits for /health and one completion; the phase times and the log."""
    port = free_port()
    command = [sys.executable, "-m", "serve", "--model", model_dir, "--adapter-dir", adapter_dir, "--port", str(port),
               "--compile-cache", cache_dir, "--max-tokens-limit", "16", *args.server_args.split()]
    if label == "warm-lowered":  # the programs traced and lowered to find them in JAX's cache (no executables)
        command.append("--no-executable-cache")
    if label == "steady":  # every program compiled before ready: the steady state's reference (issue 35 item 2)
        command += ["--background-compile", "off"]
    if label == "cold-inprocess":  # the background compile on the server's own process (the baseline)
        command += ["--compile-worker", "off"]
    started, lines = time.perf_counter(), []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # the server's log also goes to a file beside --out as it comes: a run killed from outside (a device
    # call's time limit) leaves it (2026-11-28 09:08: a cold run that never turned ready left nothing)
    live = open(f"{os.path.splitext(args.out)[0]}_{label}_server.log", "w")

    def read() -> None:
        for line in process.stdout:
            lines.append((time.perf_counter() - started, line.rstrip()))
            if not any(a in line for a in ("GET /health", "POST /v1/completions", "GET /metrics")):
                live.write(f"{lines[-1][0]:8.2f} s  {lines[-1][1]}\n")
                live.flush()
        live.close()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    result = {"cache": label, "command": command}
    try:
        result["ready_s"] = wait_ready(port, process, started, max(0.0, min(args.timeout, time_left(args, 40))))
        result["first_completion_s"], result["completion"] = first_completion(port, started)
        after_ready = min(args.after_ready, time_left(args, 40))
        if after_ready > 0:
            scrapes = []
            result["after_ready"] = serve_after_ready(port, started, lines, after_ready, scrapes)
            result["after_ready_summary"] = after_ready_summary(result["after_ready"], result["ready_s"])
            result["step_windows"] = step_windows(scrapes)
    except Exception as err:  # report what happened, keep the log
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        reader.join(timeout=5)
    access = ("GET /health", "POST /v1/completions")  # the polls and completions: timed above, not logged
    result["log"] = [f"{t:8.2f} s  {line}" for t, line in lines if not any(a in line for a in access)]
    result["first_log_s"] = lines[0][0] if lines else None
    result["weights_loaded_s"] = next((t for t, line in lines if "model loaded in" in line), None)
    result["background_done_s"] = next((t for t, line in lines if "background compile done" in line), None)
    result["phases"] = phases(lines, result)
    return result


# (phase, the server's log line that ends it): seconds from launch to each, in start-up order
PHASE_LINES = (("imports", "jaxlora.serve:starting"), ("backend", "jaxlora.serve:weights in "),
               ("weights_on_device", "jaxlora.weights:weights:"), ("model_loaded", "model loaded in"),
               ("engine_built", "engine built in"), ("uvicorn", "Uvicorn running on"),
               ("programs_ready", "step programs ready"))


def phases(lines: list, result: dict) -> dict:
    """{phase: seconds from launch to its end} of a run's timestamped log (`PHASE_LINES`), then
    /health ready and the first completion; the weights' line and the programs' line as they are."""
    out = {name: next((t for t, line in lines if marker in line), None) for name, marker in PHASE_LINES}
    out["ready"], out["first_completion"] = result.get("ready_s"), result.get("first_completion_s")
    for key, marker in (("weights_line", "jaxlora.weights:weights:"), ("programs_line", "step programs ready")):
        out[key] = next((line.split(":", 2)[-1] for _, line in lines if marker in line), None)
    return out


def scrape_steps(port: int) -> dict:
    """The server's step counters from /metrics: {"steps": {kind: n}, "seconds": {kind: s},
    "phases": {phase: s}}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = {"steps": {}, "seconds": {}, "phases": {}}
    names = {"jaxlora_engine_steps{": "steps", "jaxlora_engine_step_seconds_sum{": "seconds",
             "jaxlora_engine_step_phase_seconds_sum{": "phases"}
    for line in text.splitlines():
        for prefix, key in names.items():
            if line.startswith(prefix):
                out[key][line.split('"')[1]] = float(line.split()[-1])
    return out


def step_windows(scrapes: list) -> list:
    """Per interval between two scrapes [(t, counters)]: each kind's steps and mean ms, and the host
    ms per step of each phase (what the engine spent where, stand-in period against later)."""
    windows = []
    for (t0, a), (t1, b) in zip(scrapes, scrapes[1:]):
        steps = {k: b["steps"][k] - a["steps"].get(k, 0) for k in b["steps"]}
        total = sum(steps.values())
        windows.append({"from_s": round(t0, 1), "to_s": round(t1, 1), "steps": total, "kinds": {
            k: {"steps": n, "mean_ms": round(1e3 * (b["seconds"][k] - a["seconds"].get(k, 0.0)) / n, 3)}
            for k, n in steps.items() if n},
            "phase_ms_per_step": {p: round(1e3 * (v - a["phases"].get(p, 0.0)) / total, 3)
                                  for p, v in b["phases"].items()} if total else {}})
    return windows


def serve_after_ready(port: int, started: float, lines: list, seconds: float, scrapes: list | None = None,
                      scrape_every: float = 15.0, steady_s: float = 30.0) -> list:
    """One completion after another for up to `seconds` while the server compiles in the background,
    then `steady_s` more once its log says the background compile is done (the steady reference,
    every program compiled): [(seconds since launch, latency seconds, background done)] (how much
    slower serving is until every program is compiled). With `scrapes`, the server's step counters
    every `scrape_every` s are appended there (`scrape_steps`)."""
    done_line = lambda: any("background compile done" in line for _, line in list(lines))
    times, done_at, next_scrape = [], None, time.perf_counter()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and (done_at is None or time.perf_counter() - done_at < steady_s):
        if scrapes is not None and time.perf_counter() >= next_scrape:
            scrapes.append((time.perf_counter() - started, scrape_steps(port)))
            next_scrape += scrape_every
        done = done_line()
        t0 = time.perf_counter()
        first_completion(port, started)
        times.append((round(t0 - started, 2), round(time.perf_counter() - t0, 4), done))
        if done and done_at is None:
            done_at = t0
    if scrapes is not None:
        scrapes.append((time.perf_counter() - started, scrape_steps(port)))
    return times


def after_ready_summary(times: list, ready_s: float, window: float = 30.0) -> dict:
    """Issue 35 item 2's figure from `serve_after_ready`'s [(t, latency, done)]: the mean completion
    latency in the first `window` s after ready against the steady one (the completions once the
    background compile is done; while it still runs, those of the last `window` s, `steady_from`
    says which), and their ratio (target <= 1.2)."""
    first = [lat for t, lat, _ in times if t < ready_s + window]
    done = [lat for _, lat, finished in times if finished]
    last = [lat for t, lat, _ in times if times and t >= times[-1][0] - window]
    steady, source = (done, "background done") if done else (last, f"last {window:.0f} s, background running")
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    out = {"first_window_mean_s": mean(first), "first_window_completions": len(first),
           "steady_mean_s": mean(steady), "steady_completions": len(steady), "steady_from": source}
    out["ratio"] = out["first_window_mean_s"] / out["steady_mean_s"] if first and steady else None
    return out


def first_window_vs_steady(runs: list) -> dict:
    """{"first_window_vs_steady": the cold run's first-window mean latency / the "steady" run's mean
    over its whole after-ready window (every program compiled before it turned ready)}, {} unless
    both ran."""
    cold = next((r for r in runs if r["cache"] == "cold" and "after_ready_summary" in r), None)
    steady = next((r for r in runs if r["cache"] == "steady" and r.get("after_ready")), None)
    if cold is None or steady is None or not cold["after_ready_summary"]["first_window_mean_s"]:
        return {}
    latencies = [lat for _, lat, _ in steady["after_ready"]]
    mean = sum(latencies) / len(latencies)
    return {"first_window_vs_steady": {"cold_first_window_mean_s": cold["after_ready_summary"]["first_window_mean_s"],
                                       "steady_mean_s": mean, "steady_completions": len(latencies),
                                       "ratio": cold["after_ready_summary"]["first_window_mean_s"] / mean}}


def time_left(args, margin: float) -> float:
    """Seconds until --deadline less `margin` (the server's stop and the JSON): inf without one."""
    if args.deadline is None:
        return float("inf")
    return args.deadline - (time.perf_counter() - args.script_started) - margin


def wait_ready(port: int, process, started: float, timeout: float) -> float:
    while time.perf_counter() - started < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return time.perf_counter() - started
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"/health not ready within {timeout} s")


def first_completion(port: int, started: float) -> tuple[float, dict]:
    body = json.dumps({"model": adapter_name(0), "prompt": "The capital of France is", "max_tokens": 8}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        answer = json.load(reply)
    return time.perf_counter() - started, {"text": answer["choices"][0]["text"], "usage": answer.get("usage")}


# ---- main -----------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--small", action="store_true",
                        help="CPU: the 8B shape scaled down (hidden 2048, 4 layers, 0.5 GB of bf16), the CPU's "
                             "engine sizes with --background-compile on (the GPU's start-up path)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 2)")
    parser.add_argument("--dir", default=None, help="checkpoint and adapters (default /tmp/jaxlora_cold_start[_tiny])")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--runs", nargs="+", default=["cold", "warm"],
                        choices=("cold", "cold-inprocess", "warm", "warm-lowered", "steady"),
                        help="warm-lowered: warm, without the server's stored executables (--no-executable-cache); "
                             "steady: the cache of the run before, every program compiled before ready "
                             "(--background-compile off): its after-ready latency is the steady reference of "
                             "the cold run's first window (`first_window_vs_steady` in the JSON)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for /health per run")
    parser.add_argument("--server-args", default=None, help="extra jaxlora-serve options (default: the README's sizes)")
    parser.add_argument("--after-ready", type=float, default=0.0,
                        help="seconds of one completion after another after the first (latency while the server "
                             "compiles in the background, then steady)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds from this script's start by which it must have written its JSON (a device "
                             "call's limit): a run's wait for /health and its --after-ready are cut to fit, and "
                             "a server not ready in time is reported as such")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.script_started = time.perf_counter()
    tiny = args.tiny
    tiny = tiny or args.small
    layers = args.layers or (4 if args.small else 2 if tiny else 32)
    config = llama8b_config(layers, tiny and not args.small)
    if args.small:  # the 8B shape scaled down for a CPU (0.5 GB of bf16): hidden 2048, GQA 16/4, 16k vocab
        config = dataclasses.replace(llama8b_config(layers), hidden_size=2048, intermediate_size=5632,
                                     vocab_size=16384, num_heads=16, num_kv_heads=4, head_dim=128)
    if tiny:
        config = dataclasses.replace(config, max_position_embeddings=512)
    suffix = "_small" if args.small else "_tiny" if tiny else ""
    args.dir = args.dir or f"/tmp/jaxlora_cold_start{suffix}"
    args.out = args.out or f"bench/results/cold_start{'_cpu_small' if args.small else '_cpu' if tiny else ''}.json"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.server_args is None:
        args.server_args = ("--max-adapters-on-device 4 --max-model-len 256 --background-compile on" if args.small
                            else "--max-adapters-on-device 4 --max-model-len 256" if tiny else
                            "--max-adapters-on-device 64 --max-lora-rank 16 --max-num-seqs 256 "
                            "--max-num-batched-tokens 2048 --max-model-len 1024")
    model_dir, adapter_dir = os.path.join(args.dir, "model"), os.path.join(args.dir, "adapters")
    write_s = write_checkpoint(model_dir, config)
    write_adapters(adapter_dir, config, args.adapters, [16], PROJECTIONS)  # bench/slora_disk.py's writer
    import jax  # after the writes: the report's device (the server runs in its own process)

    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": layers,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "checkpoint_write_s": write_s, "server_args": args.server_args, "runs": []}
    cache_dir = tempfile.mkdtemp(prefix="jaxlora_cold_cache_")
    try:
        for label in args.runs:
            if label.startswith("cold") and os.listdir(cache_dir):  # a cold run after another: a cache of its own
                shutil.rmtree(cache_dir, ignore_errors=True)
                cache_dir = tempfile.mkdtemp(prefix="jaxlora_cold_cache_")
            before = cache_listing(cache_dir)
            result = launch(args, model_dir, adapter_dir, cache_dir, label)
            result["cache_before"] = before
            report["runs"].append(result)
            print(f"{label:5}: " + ", ".join(f"{k} {v:.1f}" for k, v in result["phases"].items()
                                              if isinstance(v, float)), flush=True)
            print(f"{label:5}: first log {result['first_log_s'] or float('nan'):6.1f} s, weights "
                  f"{result['weights_loaded_s'] or float('nan'):6.1f} s, ready {result.get('ready_s', float('nan')):6.1f} s,"
                  f" first completion {result.get('first_completion_s', float('nan')):6.1f} s"
                  f"{'  ERROR ' + result['error'] if 'error' in result else ''}", flush=True)
            if "after_ready_summary" in result:
                print(f"{label:5}: after ready {result['after_ready_summary']}, background done "
                      f"{result['background_done_s']}", flush=True)
            report.update(first_window_vs_steady(report["runs"]))
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    print(f"device {report['device']}, jax {report['jax']}; wrote {args.out}")


if __name__ == "__main__":
    main()
