"""Bad model files raise a `WeightsError` that names the file and the problem."""

import json
import os
import shutil

import numpy as np
import pytest

from jaxlora.weights import WeightsError, load_llama, load_model
from tests.jaxlora.hf_checkpoints import checkpoint_dir, save_random_model, tiny_llama_config, write_llama_gguf


@pytest.fixture
def hf_dir(tmp_path):
    directory = checkpoint_dir(tmp_path, "model")
    save_random_model(tiny_llama_config(), directory)
    return directory


def _truncate(path: str, fraction: float = 0.5) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * fraction))


def test_missing_weight_file(hf_dir):
    os.remove(os.path.join(hf_dir, "model.safetensors"))
    with pytest.raises(WeightsError, match=r"model\.safetensors: weight file not found"):
        load_llama(hf_dir)


def test_missing_model_path(tmp_path):
    with pytest.raises(WeightsError, match="no such model directory or file"):
        load_llama(os.path.join(str(tmp_path), "nowhere.gguf"))


def test_truncated_safetensors(hf_dir):
    file = os.path.join(hf_dir, "model.safetensors")
    _truncate(file)
    with pytest.raises(WeightsError, match=r"model\.safetensors.*truncated or corrupt"):
        load_llama(hf_dir)


def test_truncated_gguf(tmp_path, smollm2_path):
    path = os.path.join(str(tmp_path), "cut.gguf")
    shutil.copy(smollm2_path, path)
    _truncate(path, 0.6)
    with pytest.raises(WeightsError, match=r"cut\.gguf"):
        load_model(path)


def test_unknown_architecture(hf_dir):
    config_file = os.path.join(hf_dir, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["model_type"] = "gpt_neox"
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(WeightsError, match=r"config\.json: unknown architecture model_type='gpt_neox'"):
        load_llama(hf_dir)


def test_unknown_gguf_architecture(tmp_path):
    import gguf

    path = os.path.join(str(tmp_path), "mamba.gguf")
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", np.ones((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WeightsError, match=r"mamba\.gguf: unknown GGUF architecture 'mamba'"):
        load_llama(path)


def test_config_weight_shape_mismatch(hf_dir):
    config_file = os.path.join(hf_dir, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["intermediate_size"] = 96
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(WeightsError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.down_proj\.weight has shape \(64, 160\), but the config implies \(64, 96\)"):
        load_llama(hf_dir)


def test_unsupported_gguf_tensor_type(tmp_path, hf_dir):
    import gguf
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(hf_dir)
    path = os.path.join(str(tmp_path), "q5.gguf")
    write_llama_gguf(reference, path, tensor_types={"blk.1.ffn_up.weight": gguf.GGMLQuantizationType.Q5_0})
    with pytest.raises(WeightsError, match=r"q5\.gguf: tensor blk\.1\.ffn_up\.weight has GGUF type Q5_0"):
        load_llama(path)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_device_assembly_equals_the_host_assembly(tmp_path, monkeypatch, family):
    """On a GPU/TPU the stacking, transposes (and Phi-3's fused split) and the cast run on the
    device (`jaxlora.weights.layout`); forced here on the CPU, it gives the host path's arrays."""
    import jax.numpy as jnp

    import jaxlora.weights.layout as layout
    from jaxlora.weights.hf import load_hf_weights, read_hf_config
    from tests.jaxlora.hf_checkpoints import save_random_model, tiny_llama_config, tiny_phi3_config

    directory = str(tmp_path / "model")
    save_random_model((tiny_llama_config if family == "llama" else tiny_phi3_config)(), directory)
    config = read_hf_config(directory)
    for dtype in (jnp.float32, jnp.bfloat16):
        host = load_hf_weights(directory, config, dtype)
        monkeypatch.setattr(layout.jax, "default_backend", lambda: "gpu")  # the accelerators' path
        device = load_hf_weights(directory, config, dtype)
        monkeypatch.undo()
        assert set(host) == set(device)
        for name in host:
            assert host[name].dtype == device[name].dtype == jnp.dtype(dtype), name
            np.testing.assert_array_equal(np.asarray(host[name]), np.asarray(device[name]), err_msg=name)
