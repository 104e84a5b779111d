"""Engine sizes: step sizes by platform (vLLM's on a GPU/TPU, small on a CPU), bounds, and KV pages
sized from the device memory left after the weights and the adapter pool; token ids of a request
outside the vocabulary refused."""

import dataclasses

import pytest

from jaxlora.sampling import SamplingParams
from serve import engine as engine_module
from serve.engine import Engine, EngineConfig, kv_pages_that_fit
from tests.jaxlora.parallel.fixtures import CONFIG, tiny_model


def test_step_sizes_follow_the_platform_unless_given():
    gpu = EngineConfig().for_platform("gpu")
    assert (gpu.max_num_seqs, gpu.token_budget, gpu.prefill_chunk) == (256, 2048, 2048)
    assert (gpu.min_step_tokens, gpu.min_lora_mixed_tokens) == (32, 256)
    # the same step sizes on a TPU; the compile worker only on a GPU (a TPU opens to one process)
    assert EngineConfig().for_platform("tpu") == dataclasses.replace(gpu, compile_worker=False)
    cpu = EngineConfig().for_platform("cpu")
    assert (cpu.max_num_seqs, cpu.token_budget, cpu.prefill_chunk) == (32, 128, 64)
    given = EngineConfig(max_num_seqs=8, token_budget=512).for_platform("gpu")
    assert (given.max_num_seqs, given.token_budget, given.prefill_chunk) == (8, 512, 512)


@pytest.mark.parametrize("bad, message", [
    (dict(max_num_seqs=0), r"max_num_seqs must be in \[1, 1024\]"), (dict(token_budget=70000), "token_budget"),
    (dict(gpu_memory_utilization=1.2), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(num_pages=4, page_size=16, max_model_len=128), "exceeds the KV cache"),
    (dict(min_step_tokens=24), "min_step_tokens must be a power of two"),
    (dict(min_lora_mixed_tokens=0), "min_lora_mixed_tokens must be a power of two")])
def test_bad_sizes_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**bad)


def test_kv_pages_fit_the_memory_left_on_every_device():
    gib = 1 << 30
    stats = [{"bytes_limit": 100 * gib, "bytes_in_use": 20 * gib}, {"bytes_limit": 100 * gib, "bytes_in_use": 30 * gib}]
    assert kv_pages_that_fit(stats, 0.9, gib) == 60  # 0.9 * 100 - 30 on the fuller device
    assert kv_pages_that_fit(stats[:1], 0.5, gib) == 30
    assert kv_pages_that_fit(stats[:1], 0.1, gib) == 0
    assert kv_pages_that_fit([None], 0.9, gib) is None and kv_pages_that_fit([{}], 0.9, gib) is None


def test_engine_sizes_its_kv_cache(monkeypatch):
    model = tiny_model(CONFIG)
    engine = Engine(model, (), EngineConfig(max_model_len=64, page_size=8))  # a CPU reports no memory
    assert engine.config.num_pages == EngineConfig.CPU_CONTEXTS * 8 == engine.cache.num_pages
    assert engine.config.max_num_seqs == 32 and engine.max_rows == 32
    monkeypatch.setattr(engine_module, "kv_pages_that_fit", lambda stats, utilization, page_bytes: 1000)
    assert Engine(model, (), EngineConfig(max_model_len=64, page_size=8)).cache.num_pages == 1000
    monkeypatch.setattr(engine_module, "kv_pages_that_fit", lambda stats, utilization, page_bytes: 7)
    with pytest.raises(ValueError, match="one context of max_model_len 64 needs 8: raise gpu_memory_utilization"):
        Engine(model, (), EngineConfig(max_model_len=64, page_size=8))
    events = []
    engine.submit("r", [1, 2, 3], None, SamplingParams(4), events.append)
    engine.run_until_idle()
    assert events[-1].finish_reason == "length" and engine.free_pages == engine.config.num_pages


def test_token_ids_outside_the_vocabulary_are_refused(smollm2):
    from serve.engine import RequestError

    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(max_num_seqs=4, token_budget=16, num_pages=16,
                                                                 max_model_len=64, page_size=8))
    vocab = model.config.vocab_size
    for bad in (SamplingParams(4, logit_bias=((vocab, 1.0),)), SamplingParams(4, stop_token_ids=(-1,))):
        with pytest.raises(RequestError, match="token ids"):
            engine.submit("r", [1, 2, 3], None, bad, lambda e: None)
