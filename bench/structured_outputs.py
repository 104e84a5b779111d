"""Cost per token of structured outputs (rows under a JSON-schema grammar, `serve.structured`) vs
free rows on `serve.engine.Engine`, on a Llama-3.1-8B-shaped model with random bf16 weights.

    PYTHONPATH=. python bench/structured_outputs.py [--rows 64] [--layers 32] [--out FILE]
    PYTHONPATH=. python bench/structured_outputs.py --tiny     # CPU smoke test (tiny model)

Needs llguidance (a runtime dependency; on a GPU image without it, install its wheel as
bench/server_wheels.txt says); nothing else beyond the engine's packages.

Cases (each on a fresh engine, the same compiled programs): `free` (no row constrained), `mixed`
(every `--mixed-every`-th request constrained: constrained and free rows share each step, the
masked sampler runs every step), `constrained` (every request constrained). Each case submits
`--requests` requests at t=0 (prompts of --prompt-len random tokens, up to --output-len tokens,
sampled at temperature 1 with their own seeds) and calls `Engine.step()` until all finish, with
`--rows` rows per step (max_num_seqs), async scheduling on (the default: the masks of step N+1 are
computed while its forward runs, after step N's tokens are read). Requests may end early: a
constrained row when its JSON is complete (then only EOS is allowed); free rows ignore EOS (random
weights), so each generates --output-len tokens.

The cases run interleaved `--repeats` times (default 2; the last round is reported, every run is
kept in the JSON's "all_runs"). Reported per case: generated tokens/s over the makespan, ms per
generated token, TPOT p50/p90 of the free and of the constrained requests, mean step ms, the
engine's host ms per step phase, and the host time of the masks (llguidance, `GrammarRows.masks`:
ms per masked step and per constrained row); and the costs: a constrained row's TPOT vs a free
row's (the `constrained` vs the `free` case) and the free rows' TPOT beside constrained ones
(`mixed` vs `free`).

Tokenizer: llguidance masks from a tokenizer's vocabulary, and its cost grows with it. With
--tokenizer (a HF tokenizer.json, e.g. Llama 3.1's) that one is used, its ids past the model's
vocabulary never allowed; by default a synthetic byte-level BPE vocabulary of the model's size
(seeded: the 256 byte tokens, then random words of 1-10 characters, 40% with a leading space,
letters, digits and JSON punctuation, and an EOS token), so no download is needed.

Writes JSON (device, jax version, date, settings, results) to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

# Run as a script, this file's folder comes first on sys.path and its name would hide packages:
# look them up from the repository root instead.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.models.llama import Llama
from jaxlora.models.presets import llama8b_config
from jaxlora.sampling import SamplingParams
from jaxlora.scheduler.serving import pages_for
from jaxlora.tokenizer import Tokenizer
from serve.engine import Engine, EngineConfig
from serve.step import SAMPLERS
from serve.structured import GrammarCompiler

SCHEMA = {  # a typical extraction schema: nested object, array, enum, pattern, integer range
    "type": "object", "additionalProperties": False,
    "required": ["id", "name", "tags", "address", "status", "score"],
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "additionalProperties": False, "required": ["street", "city", "zip"],
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "number"},
    },
}


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer of `vocab_size` tokens (see the module doc); EOS is the last id."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    encode = _byte_level_chars()  # byte -> its symbol in byte-level BPE vocabularies
    vocab = {symbol: b for b, symbol in enumerate(encode)}
    rng = np.random.default_rng(seed)
    chars = list("abcdefghijklmnopqrstuvwxyz") * 7 + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ") + list("0123456789") + \
        list('{}[]":,.-_ ')
    while len(vocab) < vocab_size - 1:
        word = "".join(rng.choice(chars, rng.integers(1, 11)))
        word = (" " if rng.random() < 0.4 else "") + word
        symbols = "".join(encode[ord(c)] for c in word)  # ASCII: one byte per character
        vocab.setdefault(symbols, len(vocab))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|eot|>", special=True)])
    return Tokenizer(backend=backend, eos_token_ids=(vocab_size - 1,))


def _byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


class MaskTimer:
    """Wraps an engine's `GrammarRows.masks`, adding up its host time and the rows it masked."""

    def __init__(self, grammars):
        self.seconds, self.calls, self.rows = 0.0, 0, 0
        self._masks = grammars.masks
        grammars.masks = self

    def __call__(self, plan_rows, rows):
        start = time.perf_counter()
        result = self._masks(plan_rows, rows)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.rows += sum(row.sample and row.seq.sampling.structured is not None for row in plan_rows)
        return result


def run_case(model, config: EngineConfig, shapes, eos_ids, constraint, constrained: list[bool], prompts,
             output_len: int) -> dict:
    """Serves the requests (request i under `constraint` when constrained[i]) on a fresh engine;
    returns the case's numbers (see the module doc)."""
    engine = Engine(model, eos_ids, config)
    engine.warmup(shapes)
    timer = MaskTimer(engine.grammars)
    records = [{"first": None, "end": None, "tokens": 0, "reason": None} for _ in prompts]

    def callback(i):
        def on_event(event):
            now = time.perf_counter()
            if event.token is not None:
                records[i]["tokens"] += 1
                records[i]["first"] = records[i]["first"] or now
            if event.finish_reason is not None:
                records[i]["end"], records[i]["reason"] = now, event.finish_reason
        return on_event

    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(output_len, temperature=1.0, seed=i, ignore_eos=not constrained[i],
                                structured=constraint if constrained[i] else None)
        engine.submit(i, prompt, None, params, callback(i))
    engine.run_until_idle()
    end = time.perf_counter()
    stats = engine.stats
    tokens = sum(r["tokens"] for r in records)

    def tpot(kind: bool) -> dict:
        values = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r, c in zip(records, constrained)
                  if c == kind and r["tokens"] > 1]
        return {"requests": sum(c == kind for c in constrained),
                "tpot_p50_ms": 1e3 * float(np.percentile(values, 50)) if values else None,
                "tpot_p90_ms": 1e3 * float(np.percentile(values, 90)) if values else None,
                "tokens": sum(r["tokens"] for r, c in zip(records, constrained) if c == kind),
                "stopped": sum(r["reason"] == "stop" for r, c in zip(records, constrained) if c == kind)}

    return {"generated_tokens": tokens, "duration_s": end - start, "tokens_per_s": tokens / (end - start),
            "ms_per_token": 1e3 * (end - start) / tokens, "free": tpot(False), "constrained": tpot(True),
            "steps": stats.steps, "mean_step_ms": 1e3 * stats.step_seconds / max(1, stats.steps),
            "phase_ms_per_step": stats.phase_ms_per_step(), "compiles_in_run": stats.step_compiles,
            "mask_ms_per_masked_step": 1e3 * timer.seconds / max(1, timer.calls),
            "mask_ms_per_constrained_row": 1e3 * timer.seconds / max(1, timer.rows), "masked_steps": timer.calls}


def print_case(label: str, r: dict) -> None:
    nan = float("nan")
    print(f"{label:18} {r['tokens_per_s']:9.1f} tok/s  {r['ms_per_token']:7.3f} ms/token  step "
          f"{r['mean_step_ms']:7.2f} ms  TPOT p50 free {r['free']['tpot_p50_ms'] or nan:7.2f} ms, constrained "
          f"{r['constrained']['tpot_p50_ms'] or nan:7.2f} ms  masks {r['mask_ms_per_masked_step']:.3f} ms/step, "
          f"{r['mask_ms_per_constrained_row']:.3f} ms/row", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, few short requests (CPU smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 2)")
    parser.add_argument("--rows", type=int, default=None, help="rows per step, max_num_seqs (default 64; --tiny: 8)")
    parser.add_argument("--requests", type=int, default=None, help="requests per case (default 2 x rows)")
    parser.add_argument("--prompt-len", type=int, default=None, help="(default 64; --tiny: 8)")
    parser.add_argument("--output-len", type=int, default=None, help="(default 128; --tiny: 24)")
    parser.add_argument("--mixed-every", type=int, default=8, help="mixed case: every n-th request constrained")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the cases (the last is reported)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: synthetic, the model's vocab)")
    parser.add_argument("--compile-cache", default="/tmp/jaxlora_serve_jit_cache", help="'' for none")
    parser.add_argument("--out", default=None, help="(default bench/results/structured_outputs_<device>.json)")
    args = parser.parse_args()
    tiny = args.tiny
    pick = lambda value, default, tiny_default: value if value is not None else (tiny_default if tiny else default)
    layers, rows = pick(args.layers, 32, 2), pick(args.rows, 64, 8)
    requests = args.requests or 2 * rows
    prompt_len, output_len = pick(args.prompt_len, 64, 8), pick(args.output_len, 128, 24)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    device = jax.devices()[0].device_kind
    config = llama8b_config(layers, tiny)
    print(f"device: {device}, jax {jax.__version__}, {layers} layers, {rows} rows, {requests} requests per case",
          flush=True)
    t0 = time.perf_counter()
    model = Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    jax.block_until_ready(nnx.state(model))
    if args.tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        backend = HFTokenizer.from_file(args.tokenizer)
        eos = backend.token_to_id("<|eot_id|>") or backend.token_to_id("</s>")
        tokenizer = Tokenizer(backend=backend, eos_token_ids=(eos,))
    else:
        tokenizer = synthetic_tokenizer(config.vocab_size)
    compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_ids, config.vocab_size)
    compile_start = time.perf_counter()
    constraint = compiler.compile("json_schema", SCHEMA)
    grammar_ms = 1e3 * (time.perf_counter() - compile_start)  # includes building llguidance's tokenizer
    max_len = prompt_len + output_len
    engine_config = EngineConfig(
        max_num_seqs=rows, max_model_len=max_len + 16, num_pages=rows * pages_for(max_len + 16, 16),
        token_budget=pick(None, 256, 32), prefill_chunk=pick(None, 128, 16), max_waiting=1 << 30,
        max_adapters_on_device=1, max_lora_rank=8)
    probe = Engine(model, tokenizer.eos_token_ids, engine_config)
    shapes = [s for s in probe.step_shapes() if (s.program == "forward" and not s.lora and not s.window)
              or s.program in SAMPLERS]
    warm = probe.warmup(shapes)
    del probe
    print(f"model, tokenizer and grammar ready ({grammar_ms:.0f} ms for the grammar); compiled {warm['programs']} "
          f"programs in {warm['seconds']:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(config.vocab_size, tokenizer.vocab_size) - 1, prompt_len).tolist()
               for _ in range(requests)]
    cases = {"free": [False] * requests, "mixed": [i % args.mixed_every == 0 for i in range(requests)],
             "constrained": [True] * requests}
    run_case(model, engine_config, shapes, tokenizer.eos_token_ids, constraint, cases["mixed"][: rows],
             prompts[: rows], 8)  # untimed warm-up of the host paths
    runs = {name: [] for name in cases}
    for repeat in range(args.repeats):  # the cases interleaved; the last round is reported
        for name, constrained in cases.items():
            runs[name].append(run_case(model, engine_config, shapes, tokenizer.eos_token_ids, constraint,
                                       constrained, prompts, output_len))
            print_case(f"{name} ({repeat + 1}/{args.repeats})", runs[name][-1])
    results = {name: case_runs[-1] for name, case_runs in runs.items()}
    free, mixed, constrained = (results[k] for k in ("free", "mixed", "constrained"))
    costs = {
        "constrained_vs_free_tpot": constrained["constrained"]["tpot_p50_ms"] / free["free"]["tpot_p50_ms"],
        "constrained_vs_free_ms_per_token": constrained["ms_per_token"] / free["ms_per_token"],
        "free_rows_beside_constrained_vs_alone_tpot": mixed["free"]["tpot_p50_ms"] / free["free"]["tpot_p50_ms"],
        "mixed_constrained_vs_free_tpot": mixed["constrained"]["tpot_p50_ms"] / mixed["free"]["tpot_p50_ms"],
    }
    print("costs: " + ", ".join(f"{k} {v:.3f}x" for k, v in costs.items()), flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat()
    report = {"device": device, "jax": jax.__version__, "date": date,
              "host": platform.node(), "backend": jax.default_backend(),
              "model": {"shape": "tiny" if tiny else "Llama-3.1-8B", "layers": layers, "dtype": "bfloat16",
                        "weights": "random"},
              "tokenizer": args.tokenizer or f"synthetic byte-level BPE, {config.vocab_size} tokens",
              "schema": SCHEMA, "grammar_compile_ms": grammar_ms, "engine": dataclasses.asdict(engine_config),
              "settings": {"rows": rows, "requests": requests, "prompt_len": prompt_len, "output_len": output_len,
                           "mixed_every": args.mixed_every, "temperature": 1.0},
              "compile": warm, "results": results, "all_runs": runs, "costs": costs,
              "total_s": time.perf_counter() - t0}
    out = args.out or f"bench/results/structured_outputs_{'cpu' if jax.default_backend() == 'cpu' else device}.json"
    out = out.replace(" ", "_").lower() if args.out is None else out
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
