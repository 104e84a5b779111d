"""`make demo`: the main job on the embedded SmolLM2-135M-Instruct model.

For now: greedy chat completions from the base model for a few fixed prompts (training and serving
adapters side by side replace this as they land)."""

import time

from jaxlora.generate import SamplingParams, generate_text
from jaxlora.weights import default_model_path, load_model

PROMPTS = [
    "What is the capital of France?",
    "What is 2 + 3?",
    "Name three colors of the rainbow.",
]


def main() -> None:
    started = time.time()
    print(f"model: {default_model_path()}")
    model, tokenizer = load_model("default")
    config = model.config
    print(f"loaded SmolLM2: {config.num_layers} layers, d={config.hidden_size}, "
          f"vocab {config.vocab_size} ({time.time() - started:.1f} s)\n")
    answers = generate_text(model, tokenizer, PROMPTS, SamplingParams(max_new_tokens=40), chat=True)
    for prompt, answer in zip(PROMPTS, answers):
        print(f"user:      {prompt}\nassistant: {answer.strip()}\n")
    print(f"done in {time.time() - started:.1f} s")


if __name__ == "__main__":
    main()
