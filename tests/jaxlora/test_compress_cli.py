"""`jaxlora-compress`: compress PEFT adapter directories, add to a collection (projection or
recompression), show it, refuse mismatched adapters; `jaxlora-serve --compressed` reads it."""

import json
import os

import pytest

from jaxlora.compress import store
from jaxlora.compress_cli import main
from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.peft_io import save_peft_adapter
from jaxlora.weights import load_config
from serve.cli import build_parser, read_compressed

LORA = LoraConfig(r=2, lora_alpha=4, target_modules=("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    """A directory of 4 random PEFT adapters for the default model (and one for another base model)."""
    config = load_config("default")
    root = tmp_path_factory.mktemp("adapters")
    for i in range(4):
        save_peft_adapter(random_adapter(f"a{i}", config, LORA, seed=i, b_std=0.1), str(root / "set" / f"a{i}"),
                          base_model_name="default")
    save_peft_adapter(random_adapter("other", config, LORA, seed=9), str(root / "other"), base_model_name="elsewhere")
    return root


def test_compress_add_info_and_serve_option(adapter_root, tmp_path, capsys):
    out = str(tmp_path / "collection")
    args = ["--iters", "4"]
    assert main(["compress", str(adapter_root / "set" / "a[012]"), "--out", out, "--method", "jd-full",
                 "--rank", "4", *args]) == 0
    assert "3 adapters on default" in capsys.readouterr().out
    assert store.load(out).names == ["a0", "a1", "a2"]
    assert main(["add", out, str(adapter_root / "set" / "a3"), *args]) == 0
    grown = store.load(out)
    assert grown.names == ["a0", "a1", "a2", "a3"] and grown.errors["a3"]["q_proj"] > 0.5  # projected: lossy
    assert main(["add", out, str(adapter_root / "set" / "a3"), "--recompress", "--out", str(tmp_path / "again"),
                 *args]) == 2
    assert "already has adapters named ['a3']" in capsys.readouterr().err
    assert main(["info", out, "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["method"] == "jd-full" and [a["name"] for a in manifest["adapters"]] == grown.names
    assert all(a["path"].startswith(str(adapter_root)) for a in manifest["adapters"])
    parsed = build_parser().parse_args(["--compressed", out])
    assert read_compressed(parsed).names == grown.names and parsed.lora_backend == "compressed"
    with pytest.raises(SystemExit, match="need --lora-backend compressed"):
        read_compressed(build_parser().parse_args(["--compressed", out, "--lora-backend", "pallas"]))
    with pytest.raises(SystemExit, match="--compressed: .*not found"):
        read_compressed(build_parser().parse_args(["--compressed", str(tmp_path)]))


def test_recompression_reads_the_sources_again(adapter_root, tmp_path):
    out = str(tmp_path / "collection")
    assert main(["compress", str(adapter_root / "set" / "a0"), str(adapter_root / "set" / "a1"), "--out", out,
                 "--method", "jd-diag", "--rank", "3", "--iters", "4"]) == 0
    assert main(["add", out, str(adapter_root / "set" / "a2"), "--recompress", "--iters", "4"]) == 0
    assert store.load(out).names == ["a0", "a1", "a2"] and store.load(out).method == "jd-diag"


def test_mismatched_or_missing_adapters_are_refused_by_name(adapter_root, tmp_path, capsys):
    out = str(tmp_path / "c")
    assert main(["compress", str(adapter_root / "set"), str(adapter_root / "other"), "--out", out, "--rank", "2"]) == 2
    assert "adapter 'other' was trained on base model 'elsewhere', not 'default'" in capsys.readouterr().err
    assert main(["compress", str(tmp_path / "nothing*"), "--out", out, "--rank", "2"]) == 2
    assert "no PEFT adapter" in capsys.readouterr().err
    assert not os.path.exists(out)
    with pytest.raises(SystemExit):
        main(["compress", "--help"])
    assert "--clusters" in capsys.readouterr().out
