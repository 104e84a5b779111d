"""bench/regress.py: figure extraction from the two scripts' JSON shapes, the comparison rule
(higher-is-better figures gate at the tolerance, lower-is-better ones only report) and the exit
codes of `main` with the subprocess runs replaced by hand-made reports."""

import json

import pytest

from bench import regress


def summary(tok_s: float, ttft_ms: float, kinds: dict | None = None) -> dict:
    """A run summary shaped like bench/serve.py's `run_trace` result (the fields regress reads)."""
    return {"tokens_per_s": tok_s, "ttft_p50_ms": ttft_ms, "ttft_p90_ms": 2 * ttft_ms, "requests": 64,
            "steps_by_kind": kinds or {}, "phase_ms_per_step": {"schedule": 0.1}}


def punica_spec(popularity: str) -> dict:
    return {"kind": "punica", "mode": "throughput", "requests": 64, "rate": 4.0, "cv": 1.0, "n": 0,
            "alpha": 1.0, "popularity": popularity}


def slora_spec(n: int, alpha: float) -> dict:
    return {"kind": "slora", "mode": "throughput", "requests": 400, "rate": 8.0, "cv": 1.0, "n": n,
            "alpha": alpha, "popularity": ""}


def serve_report(scale: float = 1.0) -> dict:
    """bench/serve.py's report: two Punica cases sharing one base run, and one skipped case."""
    base = summary(5000 * scale, 200, {"base decode": {"steps": 10, "mean_ms": 5.0, "mean_tokens": 30},
                                       "base mixed": {"steps": 2, "mean_ms": 50.0, "mean_tokens": 1900}})
    distinct = summary(2000 * scale, 2800, {"lora decode": {"steps": 30, "mean_ms": 8.0, "mean_tokens": 30},
                                            "lora mixed": {"steps": 1, "mean_ms": 400.0, "mean_tokens": 2000},
                                            "window mixed": {"steps": 3, "mean_ms": 60.0, "mean_tokens": 2000}})
    identical = summary(4300 * scale, 240)
    return {"device": "NVIDIA H200", "jax": "0.12.0", "results": [
        {"case": "punica distinct (throughput, 64 req)", "spec": punica_spec("distinct"), "lora": distinct,
         "base": base, "base_run_of": "punica distinct (throughput, 64 req)", "throughput_vs_base": 0.4},
        {"case": "punica identical (throughput, 64 req)", "spec": punica_spec("identical"), "lora": identical,
         "base": base, "base_run_of": "punica distinct (throughput, 64 req)", "throughput_vs_base": 0.86},
        {"case": "punica skewed (throughput, 64 req)", "spec": punica_spec("skewed"), "skipped": "time budget"},
    ]}


def slora_report() -> dict:
    """bench/slora_disk.py's report: one case with runs disk and one and their ratio."""
    return {"device": "NVIDIA H200", "jax": "0.12.0", "results": [
        {"case": "slora n=2000 a=0.3 cv=1 (throughput, 400 req)", "spec": slora_spec(2000, 0.3),
         "distinct_adapters": 300, "disk": summary(3500, 900), "one": summary(5500, 300), "disk_vs_one": 0.64}]}


def fig(value: float, better: str = "higher") -> dict:
    return {"value": value, "better": better}


# ---- extraction -----------------------------------------------------------------------------------

def test_step_ms_is_the_step_weighted_mean_over_kinds_with_the_suffix():
    kinds = {"lora mixed": {"steps": 1, "mean_ms": 400.0}, "window mixed": {"steps": 3, "mean_ms": 60.0},
             "lora decode": {"steps": 30, "mean_ms": 8.0}}
    assert regress.step_ms(kinds, "mixed") == pytest.approx((400 + 3 * 60) / 4)
    assert regress.step_ms(kinds, "decode") == pytest.approx(8.0)
    assert regress.step_ms({}, "mixed") is None


def test_serve_figures_from_a_serve_report():
    figures = regress.serve_figures(serve_report())
    values = {name: f["value"] for name, f in figures.items()}
    assert values["serve base tok/s"] == 5000
    assert values["serve base TTFT p50 ms"] == 200
    assert values["serve base mixed step ms"] == 50.0
    assert values["serve punica distinct lora tok/s"] == 2000
    assert values["serve punica distinct lora/base"] == 0.4
    assert values["serve punica distinct lora TTFT p50 ms"] == 2800
    assert values["serve punica distinct lora mixed step ms"] == pytest.approx(145.0)
    assert values["serve punica identical lora/base"] == 0.86
    assert "serve punica identical lora decode step ms" not in values  # no steps of that kind
    assert not any("skewed" in name for name in figures)  # skipped by the time budget
    assert figures["serve base tok/s"]["better"] == "higher"
    assert figures["serve punica distinct lora TTFT p50 ms"]["better"] == "lower"


def test_the_distinct_decode_step_against_its_bytes_floor():
    """bench/serve.py's `decode_floor`: the LoRA decode step's extra over base against each row's
    adapter read once at the measured bandwidth; regress reports it, lower is better, not gated."""
    from bench.serve import decode_floor

    report = serve_report()
    lora, base = report["results"][0]["lora"], report["results"][0]["base"]
    floor = decode_floor(lora, base, adapter_bytes=84 << 20, copy_bytes_per_s=4e12)
    assert floor["rows"] == 30 and floor["extra_ms"] == pytest.approx(3.0)
    assert floor["floor_ms"] == pytest.approx(1e3 * 30 * (84 << 20) / 4e12)
    assert floor["extra_over_floor"] == pytest.approx(3.0 / floor["floor_ms"])
    assert decode_floor(report["results"][1]["lora"], base, 84 << 20, 4e12) is None  # no LoRA decode step
    report["results"][0]["decode_floor"] = floor
    figures = regress.serve_figures(report)
    assert figures["serve punica distinct decode extra/floor"] == {"value": floor["extra_over_floor"],
                                                                    "better": "lower"}
    assert not regress.verdict(None, figures["serve punica distinct decode extra/floor"], 0.05)["gates"]


def test_slora_disk_figures_from_a_slora_disk_report():
    figures = regress.slora_disk_figures(slora_report())
    assert {name: f["value"] for name, f in figures.items()} == {
        "slora_disk slora n=2000 a=0.3 disk tok/s": 3500, "slora_disk slora n=2000 a=0.3 disk TTFT p50 ms": 900,
        "slora_disk slora n=2000 a=0.3 disk/one": 0.64, "slora_disk slora n=2000 a=0.3 one tok/s": 5500,
        "slora_disk slora n=2000 a=0.3 one TTFT p50 ms": 300}
    assert figures["slora_disk slora n=2000 a=0.3 disk/one"]["better"] == "higher"


def test_the_h200_reference_names_figures_the_extraction_produces():
    with open(regress.os.path.join(regress.ROOT, "bench", "regress_reference.json")) as f:
        h200 = json.load(f)["devices"]["NVIDIA H200"]["figures"]
    serve = serve_report()  # every Punica case with decode and mixed steps, as a real run has
    serve["results"][1]["lora"] = serve["results"][0]["lora"]
    serve["results"][2] = {**serve["results"][1], "spec": punica_spec("skewed")}
    serve["results"].append({**serve["results"][1], "spec": punica_spec("uniform")})
    serve["results"][0]["decode_floor"] = {"floor_ms": 0.75, "extra_ms": 2.2, "extra_over_floor": 2.9}  # distinct's
    disk = slora_report()
    disk["results"].append({**disk["results"][0], "spec": slora_spec(2000, 1.0)})
    produced = {**regress.serve_figures(serve), **regress.slora_disk_figures(disk)}
    assert set(h200) <= set(produced)
    assert all(h200[name]["better"] == produced[name]["better"] for name in h200)


# ---- comparison -----------------------------------------------------------------------------------

@pytest.mark.parametrize("measured,verdict", [(94.0, "DROP"), (96.0, "PASS"), (130.0, "PASS"), (95.0, "PASS")])
def test_higher_is_better_figures_drop_beyond_the_tolerance(measured, verdict):
    rows = regress.compare({"serve base tok/s": fig(measured)}, {"serve base tok/s": fig(100.0)}, 0.05)
    assert rows["serve base tok/s"]["verdict"] == verdict
    assert rows["serve base tok/s"]["change"] == pytest.approx(measured / 100 - 1)
    assert regress.exit_code(rows, [], True) == (1 if verdict == "DROP" else 0)


def test_lower_is_better_figures_are_reported_but_do_not_gate():
    reference = {"serve base TTFT p50 ms": fig(200.0, "lower"), "serve base tok/s": fig(100.0)}
    rows = regress.compare({"serve base TTFT p50 ms": fig(400.0, "lower"), "serve base tok/s": fig(99.0)},
                           reference, 0.05)
    assert rows["serve base TTFT p50 ms"]["verdict"] == "DROP" and not rows["serve base TTFT p50 ms"]["gates"]
    assert regress.failing(rows) == []
    assert regress.exit_code(rows, [], True) == 0


def test_a_missing_gating_figure_fails_and_a_new_one_does_not():
    rows = regress.compare({"serve new tok/s": fig(1.0)}, {"serve base tok/s": fig(100.0)}, 0.05)
    assert rows["serve base tok/s"]["verdict"] == "MISSING"
    assert rows["serve new tok/s"]["verdict"] == "NEW"
    assert regress.failing(rows) == ["serve base tok/s"]


def test_exit_codes_order_failed_subprocess_then_no_reference():
    drop = regress.compare({"a tok/s": fig(1.0)}, {"a tok/s": fig(2.0)}, 0.05)
    assert regress.exit_code(drop, ["serve"], True) == 3
    assert regress.exit_code(drop, [], False) == 2
    assert regress.exit_code(drop, [], True) == 1


def test_update_replaces_only_the_parts_that_ran():
    entry = {"figures": {"serve base tok/s": fig(1.0), "slora_disk x disk/one": fig(0.5)}}
    meta = {"date": "2026-11-27", "commit": "abc", "dirty": False, "jax": "0.12"}
    new = regress.updated_entry(entry, {"serve base tok/s": fig(2.0)}, ["serve"], meta, tiny=False)
    assert new["figures"]["serve base tok/s"]["value"] == 2.0
    assert new["figures"]["serve base tok/s"]["date"] == meta["date"]
    assert new["figures"]["slora_disk x disk/one"]["value"] == 0.5
    assert "tolerance" not in new
    assert regress.updated_entry(None, {}, ["serve"], meta, tiny=True)["tolerance"] == regress.TINY_TOLERANCE


def test_slora_commands_write_the_adapters_first_only_when_missing(tmp_path):
    args = regress.parse_args(["--tiny", "--adapter-dir", str(tmp_path)])
    assert [c for c in regress.slora_commands(args, "out.json") if "--write-only" in c]
    last = tmp_path / "task-0039"
    last.mkdir()
    (last / "adapter_model.safetensors").write_bytes(b"")
    commands = regress.slora_commands(args, "out.json")
    assert len(commands) == 1 and "slora:n=40,alpha=0.3" in commands[0] and "--tiny" in commands[0]


# ---- main, with the runs replaced -----------------------------------------------------------------

def fake_measure(scale: float, failed=()):
    return lambda args: ({"serve": serve_report(scale)}, {"serve": "regress_serve.json"}, list(failed))


def test_main_no_reference_then_update_then_drop(tmp_path, monkeypatch):
    reference = str(tmp_path / "reference.json")
    argv = ["--only", "serve", "--reference", reference, "--out-dir", str(tmp_path)]
    monkeypatch.setattr(regress, "measure", fake_measure(1.0))
    assert regress.main(argv) == 2
    assert not (tmp_path / "reference.json").exists()
    assert regress.main(argv + ["--update"]) == 0
    assert json.loads((tmp_path / "reference.json").read_text())["devices"]["NVIDIA H200"]["figures"]
    monkeypatch.setattr(regress, "measure", fake_measure(0.96))
    assert regress.main(argv) == 0
    monkeypatch.setattr(regress, "measure", fake_measure(0.94))
    assert regress.main(argv) == 1
    written = json.loads((tmp_path / "regress_nvidia_h200.json").read_text())
    assert written["exit_code"] == 1 and written["verdicts"]["serve base tok/s"]["verdict"] == "DROP"
    monkeypatch.setattr(regress, "measure", fake_measure(1.0, failed=["serve"]))
    assert regress.main(argv) == 3


def test_the_readme_serving_tables_show_the_h200_reference():
    """The README's serving and disk-tier tables and bench/regress_reference.json come from the same
    run (`--update` and the tables change together): each Punica row shows the reference's LoRA
    tok/s, base tok/s and LoRA/base, each disk row its disk/one ratio."""
    root = regress.ROOT
    with open(regress.os.path.join(root, "bench", "regress_reference.json")) as f:
        h200 = json.load(f)["devices"]["NVIDIA H200"]["figures"]
    with open(regress.os.path.join(root, "README.md")) as f:
        rows = {line.split("|")[1].strip(): line for line in f if line.startswith("| ")}
    base = f"{h200['serve base tok/s']['value']:,.0f}"
    for case in ("distinct", "uniform", "skewed", "identical"):
        row = rows[f"Punica {case}"]
        for figure in (f"{h200[f'serve punica {case} lora tok/s']['value']:,.0f}", base,
                       f"{h200[f'serve punica {case} lora/base']['value']:.2f}"):
            assert f" {figure} " in row, (case, figure, row)
    for alpha in ("1", "0.3"):
        ratio = h200[f"slora_disk slora n=2000 a={alpha} disk/one"]["value"]
        assert f" {ratio:.2f} " in rows[f"S-LoRA n=2000, alpha={alpha}"], alpha
