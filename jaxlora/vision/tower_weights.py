"""A vision tower's checkpoint tensors laid out and stacked as its model holds them (LLaVA's CLIP
tower and projector, Idefics3's SigLIP tower and connector): `stack_tower_weights`."""

from __future__ import annotations

from typing import Callable, Iterable

import jax.numpy as jnp
import numpy as np

from jaxlora.weights import WeightsError


def laid_out(tensor: np.ndarray, how: str) -> np.ndarray:
    """A checkpoint tensor in the model's layout: "transpose" (torch [out, in] -> [in, out]),
    "patch" (a conv [D, C, p, p] -> [C*p*p, D]) or "as_is"."""
    if how == "transpose":
        return tensor.T
    if how == "patch":
        return tensor.reshape(tensor.shape[0], -1).T
    return tensor


def stack_tower_weights(path: str, mapped: Iterable[tuple[str, tuple[str, int | None, str]]],
                        read: Callable[[str], np.ndarray], shapes: dict, num_layers: int, dtype,
                        model: str, parts: str) -> dict:
    """{flat weight name: array in `dtype`} from `mapped` (checkpoint name, (weight name, layer or
    None, how to lay it out)): each tensor laid out and checked against `shapes` (a layer's
    weight against the stacked shape without its leading axis), per-layer weights stacked over
    `num_layers`. WeightsError for a weight `shapes` lacks ("not part of this {model}"), a wrong
    shape, a missing layer or a missing weight ("missing {parts} weights")."""
    singles: dict[str, np.ndarray] = {}
    layers: dict[str, dict[int, np.ndarray]] = {}
    for name, (weight, layer, how) in mapped:
        if weight not in shapes:
            raise WeightsError(f"{path}: tensor {name} is not part of this {model}")
        tensor = laid_out(read(name), how)
        want = shapes[weight] if layer is None else shapes[weight][1:]
        if tuple(tensor.shape) != tuple(want):
            raise WeightsError(f"{path}: tensor {name} has shape {tuple(read(name).shape)}, but the config implies "
                               f"{tuple(want)} once laid out ({how})")
        if layer is None:
            singles[weight] = tensor
        else:
            layers.setdefault(weight, {})[layer] = tensor
    out = {name: jnp.asarray(tensor, dtype) for name, tensor in singles.items()}
    for name, pieces in layers.items():
        gaps = sorted(set(range(num_layers)) - set(pieces))
        if gaps:
            raise WeightsError(f"{path}: missing vision weights {name} for layers {gaps[:5]}")
        out[name] = jnp.asarray(np.stack([pieces[i] for i in range(num_layers)]), dtype)
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise WeightsError(f"{path}: missing {parts} weights: {', '.join(missing)}")
    return out
