"""The serving policy: continuous batching under a token budget, KV-page admission control, and the
LRU device adapter slots with prefetch (docs/architecture.md, "The serving engine's step").
Host-side only (no JAX)."""

from jaxlora.scheduler.serving.adapters import AdapterSlots
from jaxlora.scheduler.serving.pages import PageAllocator, pages_for
from jaxlora.scheduler.serving.policy import (
    PENDING,
    SchedulerConfig,
    Sequence,
    ServingScheduler,
    Status,
    StepPlan,
    StepRow,
)

__all__ = [
    "AdapterSlots", "PENDING", "PageAllocator", "SchedulerConfig", "Sequence", "ServingScheduler", "Status",
    "StepPlan", "StepRow", "pages_for",
]
