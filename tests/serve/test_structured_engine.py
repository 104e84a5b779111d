"""Structured outputs in the engine: free rows that share steps with rows under a grammar get the
tokens (and log-probabilities) they get alone (greedy, seeded sampling, penalties; async and
synchronous scheduling), the bitmask puts exactly the forbidden tokens at -inf, unconstrained rows'
masks allow everything, and a preempted constrained request that is recomputed still follows its
grammar (its matcher catches up from its output)."""

import json

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxlora.sampling import SamplingParams, mask_logits
from serve.engine import Engine, EngineConfig
from serve.structured import GrammarCompiler, GrammarRows
from tests.serve.conftest import SMALL_ENGINE

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
FREE = {"greedy": ("The capital of France is", SamplingParams(12)),
        "sampled": ("My favourite food is", SamplingParams(12, temperature=0.9, seed=5)),
        "penalised": ("Once upon a time", SamplingParams(4, repetition_penalty=1.3, logprobs=2)),  # then "sample"
        "adapter": ("Water boils at", SamplingParams(12, temperature=0.7, seed=11, top_k=20))}


@pytest.fixture(scope="module")
def person(smollm2):
    model, tokenizer = smollm2
    return GrammarCompiler(tokenizer, tokenizer.eos_token_ids, model.config.vocab_size).compile("json_schema", PERSON)


def _run(engine, requests):
    """{name: (tokens, log-probabilities or None, finish reason)} of `requests` {name: (prompt ids,
    adapter, SamplingParams)}, all submitted at once."""
    events = {name: [] for name in requests}
    for name, (prompt, adapter, params) in requests.items():
        engine.submit(name, prompt, adapter, params, events[name].append)
    engine.run_until_idle()
    return {name: ([e.token for e in got if e.token is not None],
                   [e.logprobs[1] for e in got if e.logprobs is not None] or None, got[-1].finish_reason)
            for name, got in events.items()}


def _free_requests(tokenizer):
    return {name: (tokenizer.encode(text), "ad0" if name == "adapter" else None, params)
            for name, (text, params) in FREE.items()}


def _constrained(tokenizer, person, count):
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person."}]))
    return {f"json{i}": (prompt, ("ad1", None)[i % 2], SamplingParams(40, temperature=(0.0, 1.0)[i % 2], seed=i,
                                                                      structured=person))
            for i in range(count)}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_free_rows_get_the_same_tokens_beside_constrained_rows(smollm2, adapters8, person, async_scheduling):
    model, tokenizer = smollm2
    config = EngineConfig(**SMALL_ENGINE, async_scheduling=async_scheduling)
    adapters = {name: adapters8[name] for name in ("ad0", "ad1")}
    free = _free_requests(tokenizer)
    alone = _run(Engine(model, tokenizer.eos_token_ids, config, adapters), free)
    engine = Engine(model, tokenizer.eos_token_ids, config, adapters)
    shared, real_step = [], engine.step_fn

    def recording(step, cache):  # steps whose masked sampler draws both free and constrained tokens
        names = {row.seq.seq_id for row in step.plan.rows if row.sample}
        if step.shapes[-1].program.endswith("_masked") and names & set(free) and names - set(free):
            shared.append(step.shapes[-1].program)
        return real_step(step, cache)

    engine.step_fn = recording
    mixed = _run(engine, {**free, **_constrained(tokenizer, person, 4)})
    assert {"sample_masked", "sample_state_masked"} <= set(shared)  # both masked programs ran mixed steps
    for name in free:
        assert mixed[name][0] == alone[name][0], name
        assert mixed[name][2] == alone[name][2]
    # float32 logprobs of another batch's reduction order (jax 0.12.0.1 on a CPU: 1.8e-5 on -4.135):
    # the project's f32 bound, relative
    np.testing.assert_allclose(mixed["penalised"][1], alone["penalised"][1], rtol=1e-5, atol=1e-6)
    for name, (tokens, _, reason) in mixed.items():
        if name.startswith("json"):
            assert reason == "stop"
            jsonschema.validate(json.loads(tokenizer.decode(tokens)), PERSON)


def test_preempted_constrained_requests_follow_their_grammar(smollm2, adapters8, person):
    model, tokenizer = smollm2
    config = EngineConfig(**{**SMALL_ENGINE, "num_pages": 24}, reserve_output_kv=False)
    engine = Engine(model, tokenizer.eos_token_ids, config, {"ad1": adapters8["ad1"]})
    preempted, hand_off = [], engine._hand_off

    def counting(seqs):
        preempted.extend(seq.seq_id for seq in seqs)
        hand_off(seqs)

    engine._hand_off = counting
    requests = _constrained(tokenizer, person, 8)
    results = _run(engine, requests)
    assert preempted  # 8 requests of ~40 pages-worth of tokens in 24 pages: some were recomputed
    for tokens, _, reason in results.values():
        assert reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), PERSON)
    assert len(engine.grammars) <= 1  # finished sequences' matchers are forgotten (the last one at the next step)


def test_mask_logits_forbids_exactly_the_cleared_bits():
    rng = np.random.default_rng(0)
    rows, vocab = 3, 70  # 3 words, the last one partly past the vocabulary
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    allowed = rng.random((rows, vocab)) < 0.3
    allowed[2] = True
    padded = np.zeros((rows, 96), bool)
    padded[:, :vocab] = allowed
    padded[2, vocab:] = True  # an all-ones row, as an unconstrained row's
    bitmask = np.packbits(padded.reshape(rows, 3, 32)[:, :, ::-1], axis=-1)  # bit t % 32 of word t // 32
    bitmask = bitmask.view(">u4").astype(np.uint32).view(np.int32).reshape(rows, 3)
    got = np.asarray(mask_logits(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))


def test_masks_allow_everything_for_rows_without_a_grammar(smollm2, person):
    model, tokenizer = smollm2
    grammars = GrammarRows(model.config.vocab_size, tokenizer.eos_token_ids)

    class Row:
        def __init__(self, seq_id, sampling, output=(), sample=True):
            self.sample = sample
            self.seq = type("Seq", (), dict(seq_id=seq_id, sampling=sampling, output=list(output),
                                             finish_reason=None))()

    rows = [Row("free", SamplingParams(4)), Row("json", SamplingParams(4, structured=person)),
            Row("chunk", SamplingParams(4, structured=person), sample=False)]
    masks = grammars.masks(rows, 4)
    assert masks.shape == (4, (model.config.vocab_size + 31) // 32)
    assert (masks[[0, 2, 3]] == -1).all()
    allowed = np.flatnonzero(np.unpackbits(masks[1].view(np.uint8), bitorder="little"))
    assert [tokenizer.decode([t]) for t in allowed] == ['{"']  # the schema's JSON starts with {"name"
    for token in tokenizer.encode('{"name":"Al","age":7}'):
        rows[1].seq.output.append(token)
    done = grammars.masks(rows[1:2], 1)
    eos = np.flatnonzero(np.unpackbits(done[0].view(np.uint8), bitorder="little"))
    assert list(eos) == sorted(tokenizer.eos_token_ids)  # complete: only EOS
    rows[1].seq.output[3:] = []  # preempted and cut back: the matcher starts over from the output
    again = grammars.masks(rows[1:2], 1)
    assert not (again[0] == done[0]).all() and len(grammars) == 1
