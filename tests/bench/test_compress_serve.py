"""bench/compress_serve.py --tiny end to end on the CPU: the programs compiled first (both engines, the
compressed one from a set of the collection's shapes) so that no timed run compiles, the three runs
side by side with their ratios, pools holding the adapters' q/v only, and prompts that share no
leading tokens (a shared prefix let the prefix cache serve the one-adapter run: the 11-29 bug)."""

import json

import numpy as np

from bench import compress_serve
from jaxlora.models.presets import llama8b_config


def test_prompts_are_distinct_from_their_first_tokens():
    prompts = compress_serve.trace_prompts(np.array([40, 12, 40, 7, 33]), 1000, seed=0)
    assert [len(p) for p in prompts] == [40, 12, 40, 7, 33]
    assert len({tuple(p[:4]) for p in prompts}) == 5
    assert prompts == compress_serve.trace_prompts(np.array([40, 12, 40, 7, 33]), 1000, seed=0)


def test_shape_alike_set_has_the_collections_shapes():
    config = llama8b_config(2, True)
    shared = compress_serve.shape_alike_set(config, count=5, rank=4, clusters=2)
    assert shared.names == tuple(f"adapter{i}" for i in range(5)) and set(shared.modules) == {"q_proj", "v_proj"}
    q = shared.modules["q_proj"]
    assert q["basis_in"].shape[:2] == (2, 2) and q["basis_in"].shape[3] == 4 and q["sigma"].shape == (2, 5, 4, 4)
    assert shared.shapes()["q_proj"] == (2, config.hidden_size, q["basis_out"].shape[3])


def test_tiny_run_compiles_first_and_serves_all_three(tmp_path):
    out = tmp_path / "compress_serve.json"
    common = ["--tiny", "--cases", "slora:n=24,alpha=1,cv=1,mode=throughput", "--compile-threads", "2",
              "--compile-cache", "", "--out", str(out)]  # no persistent cache: it would outlive tmp_path
    compress_serve.main(common + ["--compile-only"])
    assert not out.exists()
    compress_serve.main(common)
    report = json.loads(out.read_text())
    assert report["engine"]["lora_target_modules"] == ["q_proj", "v_proj"]
    assert set(report["compile_seconds"]) == {"uncompressed", "compressed"}
    [result] = report["results"]
    assert set(result["runs"]) == {"single", "compressed", "uncompressed"}
    for run in result["runs"].values():
        assert run["finished_ok"] == run["requests"] == 24 and run["errors"] == 0
        assert run["compiles_in_run"] == 0 and run["tokens_per_s"] > 0
    assert result["compressed_vs_single"] > 0 and result["uncompressed_vs_single"] > 0
