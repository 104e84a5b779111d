"""Training data: JSONL records (`text`, `prompt`/`completion`, or chat `messages`) tokenized into
(token ids, loss mask) samples with Grain, in a seeded per-epoch order.

Loss is on every token of `text`, on the completion (and EOS) of `prompt`/`completion`, and on
the assistant turns of `messages` (rendered with the model's chat template). A message's content
may be a list of text and image parts (`train.images`: data URLs or paths relative to the
dataset file); for a vision-language model each image becomes its image tokens (no loss on them)
and the sample carries the image's pixel values."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxlora.tokenizer import Tokenizer, TokenizerError
from train.config import ConfigError, JobConfig
from train.images import IMAGE_TOKEN, VisionInputs, check_content, message_text, record_images, with_images


@dataclasses.dataclass(frozen=True)
class TokenizedSample:
    """tokens [n] int32 and loss_mask [n] bool (True: the model is trained to predict this token);
    pixels [k, C, H, W] float32: the pixel values of its k images, in the order of their image
    tokens (None: text only)."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    source: str  # "file:line"
    pixels: np.ndarray | None = None


def read_jsonl(path: str) -> list[tuple[int, dict]]:
    """(line number, record) for every non-blank line; ConfigError naming file:line otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read dataset: {err}") from None
    return parse_jsonl(lines, path)


def parse_jsonl(lines: list[str], where: str) -> list[tuple[int, dict]]:
    """The records of JSONL `lines` (a training data format each: `text`, `prompt`/`completion`
    or chat `messages`) with their line numbers; ConfigError naming `where`:line otherwise."""
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}:{number}: not valid JSON: {err.msg}") from None
        _check_record(record, f"{where}:{number}")
        records.append((number, record))
    if not records:
        raise ConfigError(f"{where}: the dataset is empty")
    return records


def _check_record(record, where: str) -> None:
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    if isinstance(record.get("text"), str):
        return
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return
    messages = record.get("messages")
    if isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
        for m in messages
    ):
        for i, message in enumerate(messages):
            check_content(message["content"], f"{where}: messages[{i}].content")
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"{where}: 'messages' has no assistant turn to learn from")
        return
    raise ConfigError(f"{where}: expected 'text', 'prompt'+'completion', or 'messages' "
                      "(a list of {role, content}: a string, or a list of text and image parts)")


def tokenize_record(record: dict, tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of one record (each image part of a chat as one `<image>` token:
    `train.images.with_images` expands them)."""
    eos = list(tokenizer.eos_token_ids[:1])
    if "text" in record:
        tokens = tokenizer.encode(record["text"]) + eos
        return tokens, [True] * len(tokens)
    if "prompt" in record:
        prompt = tokenizer.encode(record["prompt"])
        completion = tokenizer.encode(record["completion"], add_bos=False) + eos
        return prompt + completion, [False] * len(prompt) + [True] * len(completion)
    messages = [{**m, "content": message_text(m["content"], IMAGE_TOKEN)} for m in record["messages"]]
    return _tokenize_chat(messages, tokenizer)


def _tokenize_chat(messages: list[dict], tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """Renders growing prefixes of the chat so that exactly the assistant turns carry loss."""
    tokens: list[int] = []
    mask: list[bool] = []
    for index, message in enumerate(messages):
        is_assistant = message["role"] == "assistant"
        text = tokenizer.apply_chat_template(messages[: index + 1], add_generation_prompt=False)
        if is_assistant:
            prefix = tokenizer.apply_chat_template(messages[:index], add_generation_prompt=True)
            prefix_ids = tokenizer.encode(prefix)
            mask += [False] * (len(prefix_ids) - len(tokens))
            tokens = prefix_ids
        full = tokenizer.encode(text)
        mask += [is_assistant] * (len(full) - len(tokens))
        tokens = full
    return tokens, mask


def load_job_samples(job: JobConfig, tokenizer: Tokenizer, max_len: int, overlong: str,
                     vision: VisionInputs | None = None) -> list[TokenizedSample]:
    """All samples of a job's dataset, tokenized (via a Grain map) and length-checked; with
    `vision` (a vision-language model) chat images are read and preprocessed."""
    records = read_jsonl(job.dataset)
    base_dir = os.path.dirname(os.path.abspath(job.dataset))

    def tokenize(item: tuple[int, dict]) -> TokenizedSample:
        number, record = item
        where = f"{job.dataset}:{number}"
        images = record_images(record, base_dir, where, vision) if "messages" in record else []
        try:
            tokens, mask = tokenize_record(record, tokenizer)
        except TokenizerError as err:
            raise ConfigError(f"{where}: {err}") from None
        tokens, mask, pixels = with_images(tokens, mask, images, vision, where)
        if len(tokens) > max_len:
            if overlong == "refuse" or pixels is not None:
                raise ConfigError(f"{where}: sample has {len(tokens)} tokens, more than the limit of {max_len} "
                                  "(raise capacity/max_seq_len, or set overlong: truncate; a sample with "
                                  "images is never truncated)")
            tokens, mask = tokens[:max_len], mask[:max_len]
        if len(tokens) < 2 or not any(mask[1:]):
            raise ConfigError(f"{where}: sample has no token to learn from")
        return TokenizedSample(np.asarray(tokens, np.int32), np.asarray(mask, bool), where, pixels)

    import grain  # here, not at the top: bench/train.py uses this module where Grain is not installed

    dataset = grain.MapDataset.source(records).map(tokenize)
    return [dataset[i] for i in range(len(dataset))]


def sample_order(num_samples: int, job: JobConfig) -> list[int]:
    """Indices of the job's samples in training order: a new seeded shuffle every epoch, as many
    epochs as `epochs`, or enough for `steps` optimizer steps (whole global batches only)."""
    if job.steps is not None:
        needed = job.steps * job.global_batch_size
    else:
        needed = (job.epochs * num_samples // job.global_batch_size) * job.global_batch_size
    if needed < job.global_batch_size:
        raise ConfigError(f"job {job.name!r}: {num_samples} samples do not fill one global batch of "
                          f"{job.global_batch_size}")
    epochs = -(-needed // num_samples)
    import grain

    order = grain.MapDataset.range(num_samples).shuffle(seed=job.seed).repeat(epochs)
    return [int(order[i]) for i in range(needed)]
