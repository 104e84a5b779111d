"""The serving policy: continuous batching under a token budget, KV-page admission control (KV and
adapter pages in one budget with unified paging), the LRU device adapter slots with prefetch,
each step's inference mode (merged / mixed / unmerged, V-LoRA), prefix caching of full KV blocks (docs/architecture.md, "The serving
engine's step"), and the placement of requests over replicas (Punica). Host-side only (no JAX)."""

from jaxlora.scheduler.serving.adapters import AdapterSlots
from jaxlora.scheduler.serving.mode_choice import (
    INFERENCE_MODES, CreditModes, Mode, ModePolicy, Pending, choose_mode, fixed_mode, runs_in,
)
from jaxlora.scheduler.serving.mode_costs import CostModes, CostPolicy, StepCosts
from jaxlora.scheduler.serving.pages import PageAllocator, admission_pages, pages_for
from jaxlora.scheduler.serving.prefix import PrefixCache, PrefixStats
from jaxlora.scheduler.serving.placement import ReplicaState, RoundRobin, place
from jaxlora.scheduler.serving.unified import UnifiedPages, adapter_pages
from jaxlora.scheduler.serving.policy import (
    PENDING,
    SCHEDULE_POLICIES,
    SchedulerConfig,
    Sequence,
    ServingScheduler,
    Status,
    StepPlan,
    StepRow,
)

__all__ = [
    "AdapterSlots", "CostModes", "CostPolicy", "CreditModes", "INFERENCE_MODES", "Mode", "ModePolicy", "PENDING",
    "Pending", "SCHEDULE_POLICIES", "PageAllocator", "PrefixCache", "PrefixStats", "ReplicaState",
    "RoundRobin", "SchedulerConfig", "Sequence", "ServingScheduler", "Status", "StepCosts", "StepPlan", "StepRow",
    "UnifiedPages", "adapter_pages", "admission_pages", "choose_mode", "fixed_mode", "pages_for", "place", "runs_in",
]
