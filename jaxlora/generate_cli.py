"""`jaxlora-generate`: complete prompts with a model (the embedded SmolLM2 by default)."""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp

from jaxlora.generate import SamplingParams, generate_text
from jaxlora.vision.generate import generate_text_with_images
from jaxlora.vision.loading import IMAGE_TOKEN, is_vlm_dir, load_vlm
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
    parser.add_argument("--image", action="append", default=[], metavar="FILE",
                        help="an image for a vision-language model (a LLaVA-1.5 or Idefics3 directory): each <image> of the "
                             "prompts takes the next one (repeat the option)")
    return parser


def generate_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if os.path.isdir(args.model) and is_vlm_dir(args.model):
        return _generate_vlm(args)
    if args.image:
        print("error: --image needs a vision-language model directory (LLaVA-1.5, Idefics3)", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed)
        model, tokenizer = load_model(args.model, dtype=jnp.dtype(args.dtype))
    except (ValueError, WeightsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for prompt, answer in zip(args.prompts, generate_text(model, tokenizer, args.prompts, params, args.chat)):
        print(f"> {prompt}\n{answer}\n")
    return 0


def _read_image(path: str):
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
            return image
    except (OSError, Image.DecompressionBombError) as err:
        raise ValueError(f"{path}: cannot read the image: {err}") from None


def _generate_vlm(args) -> int:
    try:
        params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed)
        model, tokenizer, processor = load_vlm(args.model, dtype=jnp.dtype(args.dtype))
        images = [_read_image(path) for path in args.image]
        counts = [prompt.count(IMAGE_TOKEN) for prompt in args.prompts]
        if sum(counts) != len(images):
            raise ValueError(f"the prompts hold {sum(counts)} {IMAGE_TOKEN} placeholders but {len(images)} "
                             f"--image files were given")
        groups = [images[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(counts))]
        answers = generate_text_with_images(model, tokenizer, processor, args.prompts, groups, params, args.chat)
    except (ValueError, WeightsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for prompt, answer in zip(args.prompts, answers):
        print(f"> {prompt}\n{answer}\n")
    return 0


if __name__ == "__main__":
    sys.exit(generate_main())
