"""The shared scheduler: the token-budget model and its two policies.

`capacity` picks the token capacity of a microbatch from a throughput profile; `training`
packs the samples of many adapters into microbatches for pipelined multi-LoRA training
(LoRAFusion §4.2); `serving` admits requests, builds each continuous-batching step under a token
budget with rows grouped by adapter, and keeps the device adapter pool (LRU, prefetch).
"""

from jaxlora.scheduler.capacity import CapacityProfile, choose_capacity, profile_token_capacity

__all__ = ["CapacityProfile", "choose_capacity", "profile_token_capacity"]
