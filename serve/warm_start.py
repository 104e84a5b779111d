"""The server's start-up with the step programs loading while the weights are read (issue 35).

`jaxlora-serve` on a HF safetensors directory (one engine on one device, unmerged LoRA: what most
servers run) builds its engine on zero weights of the checkpoint's shapes (`placeholder_model`:
the safetensors headers checked first, nothing read), so the KV pages are sized after them as
before; then `load_into` starts the engine's first step programs (`Engine.start_warmup`: lowered
over the weights' shapes, loaded from the persistent compile cache or compiled) and meanwhile
writes the checkpoint into the engine's weight arrays in place (`jaxlora.weights.fill`). A warm
start then costs about max(weights, programs) instead of their sum. `/health` turns ready once
both are done (`Engine.warmup` waits for the programs). Other set-ups load the weights first."""

from __future__ import annotations

import logging
import os
import time

from jaxlora.models.llama import Llama
from jaxlora.weights import resolve_model_path
from jaxlora.weights.fill import fill_weights, placeholder_weights
from jaxlora.weights.hf import plan_hf_weights, read_hf_config
from jaxlora.weights.layout import Planned

log = logging.getLogger("jaxlora.serve")


def applies(args, mesh, devices, collection, vlm: bool) -> bool:
    """Whether the server's arguments take this start-up: a HF directory (not a GGUF file, not a
    vision-language model), one engine on one device (no tensor parallel, replicas or compressed
    collection), the unmerged inference mode (merged modes keep a copy of the base weights made
    when the engine is built); layers stacked or split (`fill_weights(split_layers=True)`). The
    engine takes the placeholder over (`Handover.ZEROS`): its arrays are remade side by side before
    the KV pages are sized (split layers' copies left the KV pool's 30 GiB arrays without room on
    an H200 otherwise; 2026-11-28 16:48, bench/NOTES_serve.md)."""
    path = resolve_model_path(args.model)
    return (os.path.isdir(path) and not vlm and mesh is None and devices is None and collection is None
            and args.inference_mode == "unmerged")


def placeholder_model(path: str, dtype) -> tuple[Llama, dict[str, Planned]]:
    """(the model of the HF directory `path` on zero weights in `dtype`, its weights' plan for
    `load_into`); WeightsError for a config or a safetensors header the model cannot take."""
    config = read_hf_config(path)
    plan = plan_hf_weights(path, config)
    return Llama(config, weights=placeholder_weights(config, dtype), dtype=dtype), plan


def load_into(engine, plan: dict[str, Planned], started: float, dtype: str) -> None:
    """Starts the engine's step programs, then writes `plan`'s weights into the engine's arrays
    (module doc); logs "model loaded in" (seconds since `started`) once they are on the device."""
    engine.start_warmup()
    fill_weights(plan, engine.weight_variables(), split_layers=engine.config.split_layers)
    log.info("model loaded in %.1f s (%d layers, %s; the step programs loading meanwhile)",
             time.perf_counter() - started, engine.model_config.num_layers, dtype)
