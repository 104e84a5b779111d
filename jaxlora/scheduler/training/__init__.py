"""Training policy of the shared scheduler (LoRAFusion §4.2).

Flow: `adapter_groups` (head-tail by mean length) -> `pack_block` per (global batch, group)
(first-fit decreasing vs two-stage HiGHS MILP) -> `merge_blocks` (cross-block, bubble-lemma
safe) -> `insert_noops` + verification -> `Schedule`. `build_schedule` does it all in one
process; `ScheduleAhead` packs in worker processes ahead of the training loop.
"""

from jaxlora.scheduler.training.ahead import ScheduleAhead
from jaxlora.scheduler.training.samples import Microbatch, Sample, TrainingData, padded_tokens
from jaxlora.scheduler.training.greedy import first_fit_decreasing, per_adapter_first_fit
from jaxlora.scheduler.training.grouping import group_adapters
from jaxlora.scheduler.training.lemma import LemmaState, ScheduleError, insert_noops
from jaxlora.scheduler.training.merging import merge_blocks
from jaxlora.scheduler.training.packing import PackResult, pack_block
from jaxlora.scheduler.training.schedule import (
    Finalizer, Schedule, SchedulerConfig, build_schedule, concat,
)
from jaxlora.scheduler.training.verify import verify_schedule
from jaxlora.scheduler.training.workloads import synthetic_data

__all__ = [
    "Finalizer", "LemmaState", "Microbatch", "PackResult", "Sample", "Schedule",
    "ScheduleAhead", "ScheduleError", "SchedulerConfig", "TrainingData", "build_schedule",
    "concat", "first_fit_decreasing", "group_adapters", "insert_noops", "merge_blocks",
    "pack_block", "padded_tokens", "per_adapter_first_fit", "synthetic_data", "verify_schedule",
]
