"""Segmented / batched gather matmul kernels for multi-LoRA (Punica SGMV/BGMV, S-LoRA MBGMM).

Pure array functions: no models, requests or files. Every op has a pure-jnp reference, a GPU
Pallas (Triton) kernel, a TPU Pallas (Mosaic) kernel and one dispatch function
(`impl` in {None (auto), "reference", "gpu", "tpu"}; kernels of another backend run in
interpret mode, which is how CPU tests exercise both).

Data layout: x [T, k]; pool A [slots, k, r_max], B [slots, r_max, n]; rows grouped by adapter;
seg_starts int32 [S+1], seg_slot int32 [S] (-1: base model only), seg_rank int32 [S] (<= r_max),
seg_scale float32 [S]. Rows >= seg_starts[S] are padding (zero delta, y untouched).
"""

from pallas_kernels.lora_delta import sgmv_lora_delta
from pallas_kernels.dispatch import (
    bgmv_expand,
    bgmv_lora,
    bgmv_lora_fused,
    bgmv_lora_grouped,
    bgmv_lora_packed,
    bgmv_lora_stacked,
    bgmv_shrink,
    kernel_style,
    resolve_impl,
    segment_outer,
    sgmv_expand,
    sgmv_lora,
    sgmv_lora_routing,
    sgmv_lora_stacked,
    sgmv_lora_tiles,
    sgmv_shrink,
)
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.routing import TileRouting, make_routing
from pallas_kernels.tiles import TileConfig, get_tile_config

__all__ = [
    "TileConfig",
    "TileRouting",
    "bgmv_expand",
    "bgmv_lora",
    "bgmv_lora_fused",
    "bgmv_lora_grouped",
    "bgmv_lora_packed",
    "bgmv_lora_stacked",
    "bgmv_shrink",
    "get_tile_config",
    "kernel_style",
    "make_routing",
    "paged_attention",
    "paged_attention_reference",
    "resolve_impl",
    "segment_outer",
    "sgmv_expand",
    "sgmv_lora",
    "sgmv_lora_stacked",
    "sgmv_lora_delta",
    "sgmv_lora_routing",
    "sgmv_lora_tiles",
    "sgmv_shrink",
]
