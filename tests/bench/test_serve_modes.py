"""bench/serve.py --modes-skew's pieces: the engine config of each --modes entry (auto: the cost
policy with the measured switch as its prior; auto-credit: V-LoRA's credits) and the markdown
table with TTFT/TPOT p50/p90 per mode and auto's ratio to the best fixed mode."""

from bench.serve import mode_config, skew_table
from jaxlora.scheduler.serving import CostPolicy, ModePolicy
from serve.engine import EngineConfig


def test_mode_config_picks_the_policy():
    config = EngineConfig(max_num_seqs=16)
    auto = mode_config(config, "auto", {"merge_ms_mean": 9.7})
    assert auto.inference_mode == "auto" and auto.mode_policy == CostPolicy(max_batch=16, switch_s=9.7 / 1e3)
    assert mode_config(config, "auto", None).mode_policy == CostPolicy(max_batch=16)
    credit = mode_config(config, "auto-credit", None)
    assert credit.inference_mode == "auto" and credit.mode_policy == ModePolicy(max_batch=16)
    assert mode_config(config, "mixed", None).inference_mode == "mixed"


def test_skew_table_shows_latencies_and_auto_against_the_best_fixed_mode():
    def run(ms, tpot90, switches=0):
        return {"token_latency_ms": ms, "ttft_p50_ms": 100.0, "ttft_p90_ms": 300.0, "tpot_p50_ms": 5.0,
                "tpot_p90_ms": tpot90, "modes": {"mode_switches": switches}}

    report = {"skews": [{"share": 0.9, "runs": {"auto": run(5.0, 8.0, 3), "unmerged": run(6.0, 7.0),
                                                  "mixed": run(5.5, 8.0, 1)}}]}
    lines = skew_table(report).splitlines()
    assert lines[0].startswith("| share | mode | ms/token | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 |")
    assert "| 0.90 | auto | 5.00 | 100 | 300 | 5.0 | 8.0 | 3 |" in lines
    # the best fixed mode by ms per token (mixed): 5 / 5.5 and its TPOT p90 8 / 8; the lowest TPOT p90 of any: 8 / 7
    assert lines[-1] == "| 0.90 | auto / best fixed (mixed) | 0.909 | | | | 1.000 (lowest of any: 1.143) | |"
