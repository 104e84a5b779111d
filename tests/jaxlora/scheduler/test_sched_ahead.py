"""Scheduling ahead of training in a worker process."""

import time

from jaxlora.scheduler.training.ahead import ScheduleAhead
from jaxlora.scheduler.training.schedule import SchedulerConfig, build_schedule, concat
from jaxlora.scheduler.training.verify import verify_schedule
from jaxlora.scheduler.training.workloads import synthetic_data


def test_chunks_arrive_in_order_and_form_a_valid_schedule(capfd):
    data = synthetic_data("het", 4, 24, 6, seed=2)
    config = SchedulerConfig(capacity=4096, num_stages=4, time_limit_s=0.05)
    with ScheduleAhead(data, config, batches_per_window=1, lookahead=2) as ahead:
        chunks = list(ahead)
    assert "HiGHS" not in capfd.readouterr().out  # the workers' solvers print no banner
    assert len(chunks) == data.num_global_batches + 1
    index = 0
    for chunk in chunks:
        assert chunk.first_index == index
        index += len(chunk.microbatches)
    schedule = concat(chunks)
    verify_schedule(schedule, data.all_samples(), data.global_batch_size, 4096, 64, 4)


def test_same_microbatch_count_as_in_process_when_greedy():
    data = synthetic_data("mixed", 4, 16, 8, seed=4)
    config = SchedulerConfig(capacity=8192, num_stages=1, use_milp=False)
    with ScheduleAhead(data, config, batches_per_window=2, lookahead=1) as ahead:
        began = time.perf_counter()
        schedule = concat(ahead)
        assert time.perf_counter() - began < 30
    assert schedule.microbatches == build_schedule(data, config).microbatches
