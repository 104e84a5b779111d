"""The shared scheduler: token budget model and the training policy (LoRAFusion §4.2).

`capacity` picks the token capacity of a microbatch from a throughput profile; `training`
packs the samples of many adapters into microbatches for pipelined multi-LoRA training.
"""

from jaxlora.scheduler.capacity import CapacityProfile, choose_capacity, profile_token_capacity

__all__ = ["CapacityProfile", "choose_capacity", "profile_token_capacity"]
