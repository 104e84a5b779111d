"""`jaxlora-generate`: complete prompts with a model (the embedded SmolLM2 by default)."""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp

from jaxlora.generate import SamplingParams, generate_text
from jaxlora.weights import WeightsError, load_model


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxlora-generate", description=__doc__)
    parser.add_argument("prompts", nargs="+", help="prompt texts")
    parser.add_argument("--model", default="default", help="'default', a HF directory or a .gguf file")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    return parser


def generate_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed)
        model, tokenizer = load_model(args.model, dtype=jnp.dtype(args.dtype))
    except (ValueError, WeightsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for prompt, answer in zip(args.prompts, generate_text(model, tokenizer, args.prompts, params, args.chat)):
        print(f"> {prompt}\n{answer}\n")
    return 0


if __name__ == "__main__":
    sys.exit(generate_main())
