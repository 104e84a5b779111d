"""The shared scheduler: the token-budget model and its two policies.

`training` packs the samples of many adapters into microbatches for pipelined multi-LoRA training
(LoRAFusion §4.2); `serving` admits requests, builds each continuous-batching step under a token
budget with rows grouped by adapter, and keeps the device adapter pool (LRU, prefetch).
"""
