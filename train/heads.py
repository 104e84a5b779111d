"""Classification jobs: a job with `head: {labels: [...]}` trains its LoRA and a task head
(`jaxlora.lora.head`: a linear layer on the final norm's output) together on `{"text", "label"}`
JSONL, the loss the cross-entropy of the head's logits at each text's last token.

A global batch is one step: its samples (tokenized as the server's /classify tokenizes an input:
`tokenizer.encode(text)`, no EOS) are packed whole into rows of `capacity` tokens by
`train.microbatch.pack_rows` (segment ids keep each text to itself; the row count is padded to a power
of two, so batches of similar size share a compiled step), the model runs once with the job's
adapter in slot 0 of a one-slot pool (`features=True`: the final norm's output), and each
sample's last token feeds the head. The seeded sample order (`train.data.sample_order`), the
optimizer (`train.optim`: AdamW over the LoRA and the head, the job's schedule) and PEFT's LoRA
init are the LM jobs'. The adapter is written to `output_dir/<job>/` with its head files.

One device; each head job trains on its own after the LM jobs (not in their shared microbatches),
and is not checkpointed (`--resume` refuses head jobs). Of the run's settings, head jobs use
capacity, max_seq_len, overlong, dtype, lora_backend, unroll_layers, remat and progress; they
write `output_dir/<job>/metrics.jsonl` (step, loss), not TensorBoard files."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from jaxlora.buckets import bucket
from jaxlora.lora import backends
from jaxlora.lora.adapter import LoraAdapter, empty_module
from jaxlora.lora.backends import LoraBackend
from jaxlora.lora.head import TaskHead, head_logits, save_head
from jaxlora.lora.peft_io import save_peft_adapter
from jaxlora.lora.pool import AdapterPool
from jaxlora.lora.trainable import join_pool, slot_adapter, split_pool
from jaxlora.models.llama import Llama, LoraInputs
from jaxlora.tokenizer import Tokenizer, TokenizerError
from train.config import ConfigError, JobConfig, TrainConfig
from train.data import TokenizedSample, read_jsonl, sample_order
from train.optim import init_lora_a, make_optimizer
from train.microbatch import device_batch, pack_rows


@dataclasses.dataclass(frozen=True)
class LabelledSample:
    """tokens [n] int32 of one text and the index of its label in the job's labels."""

    tokens: np.ndarray
    label: int
    source: str  # "file:line"


def load_labelled_samples(job: JobConfig, tokenizer: Tokenizer, max_len: int, overlong: str) -> list[LabelledSample]:
    """Every `{"text", "label"}` record of the job's dataset, tokenized; ConfigError naming file:line."""
    labels = {label: index for index, label in enumerate(job.head.labels)}
    samples = []
    for number, record in read_jsonl(job.dataset):
        where = f"{job.dataset}:{number}"
        if not isinstance(record.get("text"), str) or not isinstance(record.get("label"), str):
            raise ConfigError(f"{where}: a head job's records are {{\"text\": str, \"label\": str}}")
        if record["label"] not in labels:
            raise ConfigError(f"{where}: label {record['label']!r} is not one of the job's head labels")
        samples.append(LabelledSample(encode_text(tokenizer, record["text"], max_len, overlong, where),
                                      labels[record["label"]], where))
    return samples


def encode_text(tokenizer: Tokenizer, text: str, max_len: int, overlong: str = "refuse", where: str = "text"):
    """The token ids [n] int32 of one text to classify (truncated to `max_len` or refused)."""
    try:
        tokens = tokenizer.encode(text)
    except TokenizerError as err:
        raise ConfigError(f"{where}: {err}") from None
    if not tokens:
        raise ConfigError(f"{where}: the text is empty")
    if len(tokens) > max_len:
        if overlong == "refuse":
            raise ConfigError(f"{where}: text has {len(tokens)} tokens, more than the limit of {max_len}")
        tokens = tokens[:max_len]
    return np.asarray(tokens, np.int32)


def pack_texts(samples: list, capacity: int) -> tuple[dict, object, np.ndarray, np.ndarray]:
    """(batch, plan, rows [n], ends [n]) of token arrays `samples` (anything with `.tokens`)
    packed first-fit into a power-of-two number of rows of `capacity` tokens, all in slot 0;
    sample i's last token is at (rows[i], ends[i])."""
    rows: list[list] = []
    used: list[int] = []
    where = []
    for sample in samples:
        length = len(sample.tokens)
        row = next((r for r, u in enumerate(used) if u + length <= capacity), None)
        if row is None:
            rows.append([])
            used.append(0)
            row = len(rows) - 1
        where.append((row, used[row] + length - 1))
        rows[row].append((0, TokenizedSample(sample.tokens, np.zeros(length, bool), ""), 0.0))
        used[row] += length
    rows += [[] for _ in range(bucket(len(rows)) - len(rows))]
    batch, plan = device_batch(pack_rows(rows, capacity, 1), 1)
    batch = {k: batch[k] for k in ("tokens", "positions", "segment_ids")}
    rows_of, ends = (np.asarray(v, np.int32) for v in zip(*where))
    return batch, plan, rows_of, ends


def head_forward(model: Llama, pool: dict, head: dict, batch: dict, plan, rows, ends, backend: LoraBackend,
                 dropout_rate=None, dropout_key=None, **model_options):
    """Head logits [n, num_labels] float32 of the packed texts: the model with the pool's slot 0
    ({module: {a, b, scale, rank}}), the final norm's output at each text's last token, then the
    head {weight [L, d], bias [L]}. model_options: `Llama`'s unroll_layers, remat."""
    features, _ = model(batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"],
                        lora=LoraInputs(pool, plan, dropout_rate, dropout_key), lora_backend=backend,
                        features=True, **model_options)
    return head_logits(features[rows, ends].astype(jnp.float32), head["weight"], head["bias"])


def make_head_step(model: Llama, optimizer: optax.GradientTransformation, backend: LoraBackend, **model_options):
    """A jitted (params {lora, head}, opt_state, frozen, batch, plan, rows, ends, labels, mask,
    dropout_rate, key) -> (params, opt_state, mean loss): one optimizer step on the mean
    cross-entropy of the real (mask) samples. model_options: `Llama`'s unroll_layers, remat."""
    graphdef, state = nnx.split(model)

    def loss_fn(params, state, frozen, batch, plan, rows, ends, labels, mask, dropout_rate, key):
        logits = head_forward(nnx.merge(graphdef, state), join_pool(params["lora"], frozen), params["head"], batch,
                              plan, rows, ends, backend, dropout_rate, key, **model_options)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return (nll * mask).sum() / mask.sum()

    @jax.jit
    def step(params, opt_state, state, frozen, batch, plan, rows, ends, labels, mask, dropout_rate, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, state, frozen, batch, plan, rows, ends, labels, mask,
                                                  dropout_rate, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return lambda params, opt_state, *args: step(params, opt_state, state, *args)


def classify(model: Llama, pool: dict, head: TaskHead, samples: list, capacity: int,
             lora_backend: LoraBackend | str = backends.DEFAULT, batch_size: int = 64) -> np.ndarray:
    """Probabilities [n, num_labels] of token arrays `samples` (anything with `.tokens`) in
    process: the model with the adapter of the pool's slot 0 and `head` (no dropout)."""
    backend = backends.get(lora_backend)
    graphdef, state = nnx.split(model)
    arrays = {"weight": jnp.asarray(head.weight), "bias": jnp.asarray(head.bias)}

    @jax.jit
    def probs(state, batch, plan, rows, ends):
        logits = head_forward(nnx.merge(graphdef, state), pool, arrays, batch, plan, rows, ends, backend)
        return jax.nn.softmax(logits, axis=-1)

    return np.concatenate([np.asarray(probs(state, *pack_texts(samples[start:start + batch_size], capacity)))
                           for start in range(0, len(samples), batch_size)])


def adapter_pool(model: Llama, adapter: LoraAdapter, dtype=jnp.float32) -> dict:
    """The arrays {module: {a, b, scale, rank}} of a one-slot pool holding `adapter` in slot 0."""
    pool = AdapterPool(model.config, 1, adapter.max_rank, tuple(adapter.modules), dtype)
    pool.load(adapter, slot=0)
    return pool.arrays


class HeadTrainer:
    """Trains one head job of `config` on `model` (see the module doc); `run()` returns its losses."""

    def __init__(self, config: TrainConfig, job: JobConfig, model: Llama, tokenizer: Tokenizer):
        if config.mesh.size != 1:
            raise ConfigError(f"job {job.name!r}: head jobs train on one device (mesh: data/tensor/pipeline 1)")
        self.config, self.job, self.model = config, job, model
        self.samples = load_labelled_samples(job, tokenizer, config.sample_limit, config.overlong)
        self.order = sample_order(len(self.samples), job)
        self.total_steps = len(self.order) // job.global_batch_size
        modules = {m: empty_module(model.config, job.lora, m) for m in job.lora.target_modules}
        adapter = LoraAdapter(job.name, job.lora, modules)
        trainable, self.frozen = split_pool(adapter_pool(model, adapter, jnp.dtype(config.dtype)))
        ranks = {m: np.asarray(self.frozen[m]["rank"][:, 0]) for m in trainable}
        hidden, labels = model.config.hidden_size, len(job.head.labels)
        self.params = {"lora": init_lora_a(trainable, 0, ranks, seed=job.seed),
                       "head": {"weight": jnp.zeros((labels, hidden), jnp.float32),
                                "bias": jnp.zeros(labels, jnp.float32)}}
        optimizer = make_optimizer(job, self.total_steps)
        self.opt_state = optimizer.init(self.params)
        self.step = make_head_step(model, optimizer, config.backend, unroll_layers=config.unroll_layers,
                                   remat=config.remat)

    def run(self) -> list[float]:
        """Trains every global batch in order, then exports; the per-step mean losses."""
        size, losses = self.job.global_batch_size, []
        rate = None if not self.job.lora.lora_dropout else jnp.asarray([self.job.lora.lora_dropout], jnp.float32)
        log = os.path.join(self.config.output_dir, self.job.name, "metrics.jsonl")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        bar = tqdm(total=self.total_steps, desc=self.job.name, disable=not self.config.progress)
        with open(log, "w") as f, bar:
            for step in range(self.total_steps):
                chunk = [self.samples[i] for i in self.order[step * size:(step + 1) * size]]
                batch, plan, rows, ends = pack_texts(chunk, self.config.capacity)
                labels = np.asarray([s.label for s in chunk], np.int32)
                key = None if rate is None else jax.random.fold_in(jax.random.key(self.job.seed), step)
                self.params, self.opt_state, loss = self.step(self.params, self.opt_state, self.frozen, batch, plan,
                                                              rows, ends, labels, np.ones(len(chunk), np.float32),
                                                              rate, key)
                losses.append(float(loss))
                f.write(json.dumps({"step": step + 1, "loss": losses[-1]}) + "\n")
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
        self.export()
        return losses

    def adapter(self) -> LoraAdapter:
        """The trained LoRA (float32, host memory)."""
        return slot_adapter(self.model.config, self.job.name, self.job.lora, jax.device_get(self.params["lora"]), 0)

    def head(self) -> TaskHead:
        head = jax.device_get(self.params["head"])
        return TaskHead(self.job.head.labels, np.asarray(head["weight"], np.float32),
                        np.asarray(head["bias"], np.float32))

    def export(self) -> str:
        """Writes the adapter (PEFT) and its head into `output_dir/<job>/`; returns the folder."""
        path = os.path.join(self.config.output_dir, self.job.name)
        save_peft_adapter(self.adapter(), path, base_model_name=str(self.config.base_model))
        save_head(self.head(), path)
        return path


def train_head_jobs(config: TrainConfig, jobs, model: Llama, tokenizer: Tokenizer) -> dict[str, list[float]]:
    """Trains `jobs` (head jobs of `config`) one after the other; each job's per-step losses."""
    return {job.name: HeadTrainer(config, job, model, tokenizer).run() for job in jobs}
