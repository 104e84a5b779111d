"""The adapter pool as training sees it: trainable A/B apart from the frozen scale/rank, one
adapter slot's parameters, and that slot's optimizer step (each adapter its own optax state)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax

from jaxlora.lora.adapter import LoraAdapter, ModuleLora, empty_module
from jaxlora.lora.adapter_config import LoraConfig


def split_pool(pool_arrays: dict) -> tuple[dict, dict]:
    """(trainable {module: {a, b}}, frozen {module: {scale, rank}}) from an AdapterPool's arrays."""
    trainable = {m: {"a": v["a"], "b": v["b"]} for m, v in pool_arrays.items()}
    frozen = {m: {"scale": v["scale"], "rank": v["rank"]} for m, v in pool_arrays.items()}
    return trainable, frozen


def join_pool(trainable: dict, frozen: dict) -> dict:
    """The pool arrays {module: {a, b, scale, rank}} back from `split_pool`'s two halves."""
    return {m: {**trainable[m], **frozen[m]} for m in trainable}


def slot_params(trainable: dict, slot: int, rank: int) -> dict:
    """One adapter's parameters {module: {a [L, k, r], b [L, r, n]}} out of the pool."""
    return {m: {"a": v["a"][:, slot, :, :rank], "b": v["b"][:, slot, :rank, :]} for m, v in trainable.items()}


def slot_adapter(base, name: str, config: LoraConfig, trainable: dict, slot: int) -> LoraAdapter:
    """The adapter in `slot` of host trainable arrays {module: {a [L, S, k, r], b [L, S, r, n]}}
    for the base model config `base`, float32, at the ranks `config` gives each layer."""
    modules = {}
    for module in config.target_modules:
        template = empty_module(base, config, module)
        width = template.a.shape[2]
        modules[module] = ModuleLora(np.asarray(trainable[module]["a"][:, slot, :, :width], np.float32),
                                     np.asarray(trainable[module]["b"][:, slot, :width, :], np.float32),
                                     template.rank, template.scale)
    return LoraAdapter(name, config, modules)


@functools.partial(jax.jit, static_argnums=(0, 3, 4), donate_argnums=(1, 2))
def apply_adapter_update(optimizer, trainable, grads_acc, slot: int, rank: int, opt_state):
    """One optimizer step of the adapter in `slot` from its accumulated gradient; clears that gradient.

    Returns (trainable, grads_acc, opt_state) with only `slot` changed."""
    params = slot_params(trainable, slot, rank)
    grads = slot_params(grads_acc, slot, rank)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    trainable = {m: {"a": v["a"].at[:, slot, :, :rank].set(params[m]["a"]),
                     "b": v["b"].at[:, slot, :rank, :].set(params[m]["b"])} for m, v in trainable.items()}
    grads_acc = {m: {k: x.at[:, slot].set(0) for k, x in v.items()} for m, v in grads_acc.items()}
    return trainable, grads_acc, opt_state
