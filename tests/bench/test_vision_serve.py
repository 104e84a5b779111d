"""bench/vision_serve.py --tiny end to end on the CPU: a tiny random LLaVA serves one image+text trace
on the base model and over 1, 4 and 12 adapters; the JSON names the device and shapes, every request
of every case finishes with exactly its output length, every image goes through the tower, and no
step compiles inside a timed run (the host-only pass found every program)."""

import json

from bench import vision_serve

KEYS = ("tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")


def test_tiny_run_serves_every_case_on_the_same_trace(tmp_path):
    out = tmp_path / "vision_serve.json"
    returned = vision_serve.main(["--tiny", "--compile-cache", "", "--compile-threads", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert len(returned["cases"]) == len(report["cases"])
    assert report["device"] and report["jax"] and report["date"] and report["total_s"] > 0
    assert report["model"]["tokens_per_image"] == 16 and report["model"]["flops_per_image"]["tower"] > 0
    trace = report["trace"]
    assert trace["requests"] == trace["image_requests"] == 12 and trace["image_tokens"] == 12 * 16
    assert report["compile"]["programs"] >= report["compile"]["with_images"] > 0
    assert set(report["tower_ms"]) == {"1", "2", "4", "8"}
    assert [case["adapters"] for case in report["cases"]] == [0, 1, 4, 12] and not report["skipped"]
    for case in report["cases"]:
        assert case["finished_ok"] == case["requests"] == 12 and case["errors"] == 0
        assert case["generated_tokens"] == case["expected_tokens"] == trace["output_tokens"]
        assert case["images_encoded"] == 12 and 1 <= case["tower_calls"] <= 12
        assert case["compiles_in_run"] == 0 and case["warmup_runs"] == 1
        assert case["distinct_adapters"] == case["adapters"]
        assert all(case[key] > 0 for key in KEYS) and set(case["vs_base"]) == set(KEYS)
    assert report["cases"][0]["vs_base"]["tokens_per_s"] == 1.0
    assert (tmp_path / "vision_serve.png").exists()


def test_adapters_are_spread_uniformly_and_the_trace_is_the_same_for_every_case():
    args = vision_serve.parse_args(["--tiny"])
    config = vision_serve.llava_config(2, True)
    model, processor = vision_serve.build_model(config)
    serving = vision_serve.ImageServing(model, processor)
    vtrace = vision_serve.make_vision_trace(serving, 12, 4, 24, 0.25, 0)
    assert sum(image is None for image in vtrace.images) == 3  # the text-only share
    for prompt, image in zip(vtrace.prompts, vtrace.images):
        assert prompt.count(config.image_token_id) == (0 if image is None else config.tokens_per_image)
    for adapters in (1, 4, 12):
        trace = vtrace.with_adapters(adapters)
        assert sorted(trace.adapters.tolist()) == sorted(list(range(adapters)) * (12 // adapters))
        assert (trace.output_lens == vtrace.trace.output_lens).all()
    assert vision_serve.max_image_requests(vision_serve.engine_config(args, vtrace), 16, 12) == 5
