"""PEFT-format adapters: PEFT's files load in jaxlora with PEFT's logits, and ours load in PEFT."""

import os

import numpy as np
import pytest

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.peft_io import load_peft_adapter, save_peft_adapter
from jaxlora.lora.plan import build_plan
from jaxlora.lora.pool import AdapterPool
from jaxlora.nn.model_config import PROJECTIONS
from jaxlora.models.llama import LoraInputs
from tests.jaxlora.hf_checkpoints import relative_error

TEXT = "Adapters change what a model says about the weather in Paris."


def _hf_smollm2(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


def _torch_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


def _jax_logits_with(model, adapter, tokens):
    pool = AdapterPool(model.config, num_slots=2, max_rank=max(16, adapter.max_rank))
    slot = pool.load(adapter)
    lora = LoraInputs(pool.arrays, build_plan(np.full(tokens.shape, slot)))
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(model(tokens, positions, lora=lora)[0])


def test_peft_adapter_loads_with_peft_logits(tmp_path, smollm2, smollm2_path):
    import torch
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    model, tokenizer = smollm2
    tokens = np.array([tokenizer.encode(TEXT)])
    torch.manual_seed(0)
    peft_config = PeftLoraConfig(
        r=8, lora_alpha=16, target_modules=list(PROJECTIONS), use_rslora=True, lora_dropout=0.0,
        rank_pattern={"v_proj": 4, "layers.2.mlp.down_proj": 12}, alpha_pattern={"o_proj": 7},
        init_lora_weights=False,  # random, non-zero B
    )
    peft_model = get_peft_model(_hf_smollm2(smollm2_path), peft_config).eval()
    expected = _torch_logits(peft_model, tokens)
    peft_model.save_pretrained(str(tmp_path))
    adapter = load_peft_adapter(str(tmp_path), model.config)
    assert adapter.modules["v_proj"].rank[0] == 4 and adapter.modules["down_proj"].rank[2] == 12
    assert adapter.modules["o_proj"].scale[0] == pytest.approx(7 / np.sqrt(8))
    ours = _jax_logits_with(model, adapter, tokens)
    base = np.asarray(model(tokens, np.arange(tokens.shape[1])[None])[0])
    assert relative_error(expected, base) > 1e-2  # the adapter matters
    assert relative_error(ours, expected) <= 1e-4


def test_jaxlora_adapter_loads_in_peft(tmp_path, smollm2, smollm2_path):
    from peft import PeftModel

    model, tokenizer = smollm2
    tokens = np.array([tokenizer.encode(TEXT)])
    config = LoraConfig(r=16, lora_alpha=32, target_modules=("q_proj", "k_proj", "up_proj", "down_proj"),
                        use_rslora=True, rank_pattern={"up_proj": 8}, alpha_pattern={"layers.0.self_attn.q_proj": 5})
    adapter = random_adapter("ours", model.config, config, seed=3, b_std=0.05)
    save_peft_adapter(adapter, str(tmp_path), base_model_name="SmolLM2-135M-Instruct")
    peft_model = PeftModel.from_pretrained(_hf_smollm2(smollm2_path), str(tmp_path)).eval()
    assert relative_error(_jax_logits_with(model, adapter, tokens), _torch_logits(peft_model, tokens)) <= 1e-4
    reloaded = load_peft_adapter(str(tmp_path), model.config)
    for module, weights in adapter.modules.items():
        np.testing.assert_array_equal(reloaded.modules[module].a, weights.a)
        np.testing.assert_array_equal(reloaded.modules[module].scale, weights.scale)


FAMILY_TARGETS = {  # PEFT's module names on each family
    "qwen3": list(PROJECTIONS), "mistral": list(PROJECTIONS), "gemma2": list(PROJECTIONS),
    "gemma3": list(PROJECTIONS), "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}


@pytest.mark.parametrize("family", sorted(FAMILY_TARGETS))
def test_peft_adapter_on_each_family_gives_peft_logits(tmp_path, family):
    """Model families: a PEFT adapter made for a random checkpoint (Qwen3's q/k norms and head_dim,
    Mistral's window, Gemma 2/3, Phi-3's fused qkv_proj / gate_up_proj: one A, B split by rows)
    loads in jaxlora with PEFT's logits."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    from jaxlora.weights import load_llama
    from tests.jaxlora import hf_checkpoints

    import torch

    directory = hf_checkpoints.checkpoint_dir(tmp_path, family)
    reference = hf_checkpoints.save_random_model(getattr(hf_checkpoints, f"tiny_{family}_config")(), directory)
    model = load_llama(directory)
    torch.manual_seed(1)
    fused_pattern = {"layers.1.self_attn.qkv_proj": 2, "gate_up_proj": 3} if family == "phi3" else {}
    peft_config = PeftLoraConfig(r=4, lora_alpha=8, target_modules=FAMILY_TARGETS[family], lora_dropout=0.0,
                                 init_lora_weights=False, rank_pattern=fused_pattern)
    peft_model = get_peft_model(reference, peft_config).eval()
    tokens = np.random.default_rng(2).integers(0, 320, size=(1, 29))
    expected = _torch_logits(peft_model, tokens)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    adapter = load_peft_adapter(str(tmp_path / "adapter"), model.config)
    if family == "phi3":
        assert set(adapter.modules) == set(PROJECTIONS) and adapter.modules["k_proj"].rank[1] == 2
        np.testing.assert_array_equal(adapter.modules["q_proj"].a, adapter.modules["v_proj"].a)
    base = np.asarray(model(tokens, np.arange(tokens.shape[1])[None])[0])
    assert relative_error(expected, base) > 1e-2  # the adapter matters
    assert relative_error(_jax_logits_with(model, adapter, tokens), expected) <= 1e-4
