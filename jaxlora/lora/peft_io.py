"""PEFT-format adapters in and out: `adapter_config.json` + `adapter_model.safetensors`, with PEFT's
key names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), for our Llama family.
On a model whose checkpoint fuses projections (Phi-3's `qkv_proj`, `gate_up_proj`), PEFT's LoRA on
the fused module is LoRA on each part with the same A and its rows of B: loaded that way.

Loading validates everything before returning, so a refused adapter changes nothing anywhere."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import threading

import numpy as np
from safetensors.numpy import save_file

from jaxlora.lora.adapter import LoraAdapter, check_finite, empty_module
from jaxlora.jsonfile import read_json_file
from jaxlora.lora.adapter_config import AdapterError, LoraConfig, module_key
from jaxlora.lora import safetensors_io
from jaxlora.lora.safetensors_io import SafetensorsError, TensorFile
from jaxlora.nn.model_config import FUSED_CHECKPOINT_PROJECTIONS, PROJECTIONS, LlamaConfig, fused_parts

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])\.weight$")


def load_peft_adapter(path: str, base: LlamaConfig, name: str | None = None,
                      keep_dtype: bool = False, host_dtype=None) -> LoraAdapter:
    """Reads a PEFT LoRA adapter directory for the base model `base`; AdapterError if unusable.
    The weights are float32, or with `keep_dtype` in the dtype they are stored in (float16 or
    bfloat16 stay so: a host cache of many adapters holds their own bytes) when all share one.
    host_dtype: stored dtype -> the dtype to hold A/B in (a pool's `AdapterPool.host_dtype`;
    implies keep_dtype): the cast happens while the tensors are placed, in the same pass.

    The file is read in one call and its tensors placed from views of that buffer by the layout's
    placement plan (`_placement_plan`: checked and worked out once per file header, adapter config
    and base model), one numpy assignment per module, part and tensor shape, and checked finite
    on its sum (`TensorFile.maybe_nonfinite`): little Python and few calls that release the GIL,
    which is what a read costs beside a busy engine thread (`jaxlora.lora.safetensors_io`)."""
    config = read_adapter_config(path, base)
    weights = read_weights(os.path.join(path, WEIGHTS_FILE))
    name = name or os.path.basename(os.path.normpath(path))
    plan = _placement_plan(config, weights, base, path)
    adapter = _zero_adapter(name, config, base, _placed_dtype(plan.stored_dtype, keep_dtype, host_dtype))
    plan.place(adapter.modules, weights.buffer)
    if weights.maybe_nonfinite():
        check_finite(adapter, path)
    return adapter


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where one file layout's tensors go (`_placement_plan`): per group of one module, part and shape,
    the destination layers and the source views as (byte offset in the file, shape, strides, dtype):
    one view [G, *shape] of all G tensors when they lie at equal steps, else one per layer."""

    stored_dtype: np.dtype
    groups: tuple  # ((module, part, rank, layers int array, ((offset, shape, strides, dtype), ...)), ...)

    def place(self, modules: dict, buffer: np.ndarray) -> None:
        """Writes the tensors of a file with this layout (`buffer`: the file's bytes) transposed into
        `modules`' A [L, k, r] / B [L, r, n]: one numpy assignment per view."""
        for module, part, rank, layers, views in self.groups:
            _assign(modules[module], part, rank, layers, [np.ndarray(shape, dtype, buffer=buffer, offset=offset,
                                                                     strides=strides)
                                                          for offset, shape, strides, dtype in views])


_PLANS: "collections.OrderedDict[tuple, _Placement]" = collections.OrderedDict()
_PLANS_KEPT = 64
_PLANS_LOCK = threading.Lock()


def _placement_plan(config: LoraConfig, weights: TensorFile, base: LlamaConfig, path: str) -> _Placement:
    """The checked placement of `weights`' tensors for an adapter of `config` on `base`, kept per
    (file header, config, base): a server reading many adapters of one config (one header) checks
    and plans the layout once, so its reader threads spend ~0.9 ms of Python a file, not ~3.7 ms of
    per-tensor work that holds the GIL the engine thread waits for (bench/NOTES_serve.md, issue 34).
    AdapterError naming `path` if the tensors do not fit."""
    if len(weights.header) > safetensors_io.KEPT_HEADER_BYTES:  # not an adapter's usual header: not kept
        return _make_plan(config, weights, base, path)
    key = (weights.header, weights.data_start, repr(config), base)
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan
    plan = _make_plan(config, weights, base, path)
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    return plan


def _make_plan(config: LoraConfig, weights: TensorFile, base: LlamaConfig, path: str) -> _Placement:
    """`_placement_plan` worked out from the tensors: the checks of `adapter_from_peft` and each
    group's views (`_stacked`) as offsets into the file's buffer."""
    tensors = weights.tensors()
    groups = _grouped(_zero_adapter("", config, base, np.float32), tensors, base, path)  # the shapes it checks
    _check_all_present(config, base, {(l, m, p) for (m, p, _), pieces in groups.items() for l, _ in pieces}, path)
    origin = weights.buffer.__array_interface__["data"][0]

    def spec(view: np.ndarray) -> tuple:
        return view.__array_interface__["data"][0] - origin, view.shape, view.strides, view.dtype

    planned = []
    for (module, part, _), pieces in groups.items():
        rank = pieces[0][1].shape[0 if part == "A" else 1]
        stacked = _stacked([tensor for _, tensor in pieces])
        if stacked is None:
            layers, views = [layer for layer, _ in pieces], tuple(spec(tensor) for _, tensor in pieces)
        else:
            view, order = stacked
            layers, views = [pieces[i][0] for i in order], (spec(view),)
        planned.append((module, part, rank, np.array(layers, np.intp), views))
    return _Placement(np.dtype(_common_float_dtype(tensors)) if tensors else np.dtype(np.float32), tuple(planned))


def _placed_dtype(stored: np.dtype, keep_dtype: bool, host_dtype) -> np.dtype:
    """The dtype an adapter stored in `stored` is placed in (see `load_peft_adapter`)."""
    if not (keep_dtype or host_dtype is not None):
        return np.dtype(np.float32)
    return stored if host_dtype is None else np.dtype(host_dtype(stored))


def adapter_from_peft(config: LoraConfig, tensors: dict[str, np.ndarray], base: LlamaConfig, name: str, path: str,
                      keep_dtype: bool = False, host_dtype=None, check_finite_values: bool = True) -> LoraAdapter:
    """The adapter of a checked config and its tensors (PEFT's key names); `path` names the
    adapter in errors. (`jaxlora.vision.adapters` maps a vision-language model's names onto
    these first.) keep_dtype, host_dtype: as `load_peft_adapter`. check_finite_values=False: the
    caller found every tensor finite (the placed arrays hold only their values and zeros)."""
    adapter = _zero_adapter(name, config, base, _held_dtype(tensors, keep_dtype, host_dtype))
    groups = _grouped(adapter, tensors, base, path)
    _check_all_present(config, base, {(l, m, p) for (m, p, _), pieces in groups.items() for l, _ in pieces}, path)
    for (module, part, _), pieces in groups.items():
        _place_group(adapter.modules[module], part, pieces)
    if check_finite_values:
        check_finite(adapter, path)
    return adapter


def _zero_adapter(name: str, config: LoraConfig, base: LlamaConfig, dtype) -> LoraAdapter:
    """An adapter of `config` on `base` with zero A/B of `dtype` (its ranks and scales set), to be placed into."""
    return LoraAdapter(name, config, {module: empty_module(base, config, module, dtype)
                                      for module in config.target_modules})


def _held_dtype(tensors: dict[str, np.ndarray], keep_dtype: bool, host_dtype) -> np.dtype:
    """The dtype the adapter's A/B are placed in (see `load_peft_adapter`)."""
    return _placed_dtype(np.dtype(_common_float_dtype(tensors)), keep_dtype, host_dtype)


def read_adapter_config(path: str, base: LlamaConfig) -> LoraConfig:
    """Parses and checks `adapter_config.json`; refuses options jaxlora does not support. Fused
    module names (Phi-3) become their parts in targets and patterns."""
    return lora_config_from_peft(read_raw_adapter_config(path), base, os.path.join(path, CONFIG_FILE))


def read_raw_adapter_config(path: str) -> dict:
    """The JSON object of `adapter_config.json` in `path`, unchecked."""
    file = os.path.join(path, CONFIG_FILE)
    raw = read_json_file(file, AdapterError, f"is {path} a PEFT adapter directory?")
    if not isinstance(raw, dict):
        raise AdapterError(f"{file}: expected a JSON object")
    return raw


def lora_config_from_peft(raw: dict, base: LlamaConfig, file: str) -> LoraConfig:
    """`read_adapter_config` of a parsed config; `file` names it in errors."""
    _refuse_unsupported(raw, file)
    raw = _unfused(raw, base)
    target_modules, layers = _targets(raw.get("target_modules"), raw.get("layers_to_transform"), base, file)
    try:
        return LoraConfig(
            r=int(raw.get("r", 8)),
            lora_alpha=float(raw.get("lora_alpha", 8)),
            lora_dropout=float(raw.get("lora_dropout", 0.0)),
            target_modules=target_modules,
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern={k: int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
            alpha_pattern={k: float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
            layers_to_transform=layers,
        )
    except (TypeError, ValueError) as err:
        raise AdapterError(f"{file}: {err}") from err


def _refuse_unsupported(raw: dict, file: str) -> None:
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type {raw['peft_type']!r} is not supported (only LORA)")
    if raw.get("use_dora"):
        raise AdapterError(f"{file}: DoRA (use_dora=true) is not supported")
    if raw.get("modules_to_save"):
        raise AdapterError(f"{file}: modules_to_save {raw['modules_to_save']} is not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias={raw['bias']!r} is not supported (only 'none')")
    if raw.get("fan_in_fan_out"):
        raise AdapterError(f"{file}: fan_in_fan_out=true is not supported")
    for option in ("target_parameters", "trainable_token_indices", "layer_replication"):
        if raw.get(option):
            raise AdapterError(f"{file}: {option} is not supported")
    for option in ("use_qalora", "use_bdlora", "lora_bias"):
        if raw.get(option):
            raise AdapterError(f"{file}: {option}=true is not supported")


def _fused_names(base: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """Fused module name -> its projections, for a base whose checkpoint fuses them (Phi-3)."""
    return dict(FUSED_CHECKPOINT_PROJECTIONS) if base.model_type == "phi3" else {}


def _unfused(raw: dict, base: LlamaConfig) -> dict:
    """The adapter config with fused module names replaced by their parts: target_modules list
    entries, and in a target regex or rank/alpha pattern the name becomes an alternation."""
    fused = _fused_names(base)
    if not fused:
        return raw

    def regex(pattern: str) -> str:
        for name, parts in fused.items():
            pattern = pattern.replace(name, f"(?:{'|'.join(parts)})")
        return pattern

    targets = raw.get("target_modules")
    if isinstance(targets, list):
        targets = [part for t in targets for part in fused.get(str(t).split(".")[-1], (t,))]
    elif isinstance(targets, str):
        targets = regex(targets)
    patterns = {key: {regex(k): v for k, v in (raw.get(key) or {}).items()} for key in ("rank_pattern", "alpha_pattern")}
    return {**raw, "target_modules": targets, **patterns}


def _targets(target_modules, layers_to_transform, base: LlamaConfig, file: str):
    """(module names, layer indices or None) from PEFT's target_modules (list or regex)."""
    embeddings = {"embed_tokens", "lm_head", "wte", "word_embeddings"}
    if isinstance(target_modules, str):
        matched = {(l, m) for l in range(base.num_layers) for m in PROJECTIONS
                   if re.fullmatch(target_modules, module_key(l, m))}
        if not matched:
            raise AdapterError(f"{file}: target_modules regex {target_modules!r} matches no projection")
        modules = sorted({m for _, m in matched}, key=PROJECTIONS.index)
        layer_sets = {m: {l for l, mm in matched if mm == m} for m in modules}
        if len({frozenset(s) for s in layer_sets.values()}) != 1:
            raise AdapterError(f"{file}: target_modules regex targets different layers for different modules")
        layers = sorted(next(iter(layer_sets.values())))
        return tuple(modules), (None if len(layers) == base.num_layers else tuple(layers))
    if not isinstance(target_modules, list) or not target_modules:
        raise AdapterError(f"{file}: target_modules must be a non-empty list or a regex string")
    names = [str(t).split(".")[-1] for t in target_modules]
    if embeddings & set(names):
        raise AdapterError(f"{file}: LoRA on embeddings/lm_head ({sorted(embeddings & set(names))}) is not supported")
    unknown = sorted(set(names) - set(PROJECTIONS))
    if unknown:
        raise AdapterError(f"{file}: target_modules {unknown} are not supported (use {', '.join(PROJECTIONS)})")
    if isinstance(layers_to_transform, int):
        layers_to_transform = [layers_to_transform]
    layers = None if layers_to_transform is None else tuple(int(l) for l in layers_to_transform)
    return tuple(sorted(set(names), key=PROJECTIONS.index)), layers


def _common_float_dtype(tensors: dict[str, np.ndarray]):
    """The one dtype of `tensors` if it is float16, bfloat16 or float32, else float32."""
    dtypes = {t.dtype for t in tensors.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else np.float32
    return dtype if dtype.name in ("float16", "bfloat16", "float32") else np.float32


def read_weights(file: str) -> TensorFile:
    """The adapter's safetensors file read whole (`jaxlora.lora.safetensors_io`); AdapterError if
    it is missing, truncated or corrupt."""
    try:
        return safetensors_io.load(file)
    except FileNotFoundError:
        other = os.path.join(os.path.dirname(file), "adapter_model.bin")
        hint = " (only safetensors is read, not adapter_model.bin)" if os.path.exists(other) else ""
        raise AdapterError(f"{file}: not found{hint}") from None
    except (SafetensorsError, OSError) as err:
        raise AdapterError(f"{file}: cannot read safetensors (truncated or corrupt?): {err}") from err


def _parse_key(key: str, path: str, base: LlamaConfig) -> tuple[int, str, str]:
    match = _KEY.match(key)
    names = PROJECTIONS + tuple(_fused_names(base))
    if not match or match.group(2) not in names:
        raise AdapterError(f"{path}: unexpected tensor {key!r} (jaxlora reads LoRA A/B of {', '.join(names)})")
    return int(match.group(1)), match.group(2), match.group(3)


def _pieces(base: LlamaConfig, name: str, part: str, tensor: np.ndarray, key: str, path: str):
    """[(projection, tensor)] of one PEFT tensor: itself, or for a fused module the same A for
    every part and B [sum of parts' outputs, r] split by rows."""
    parts = fused_parts(base, name) if name in _fused_names(base) else None
    if parts is None:
        return [(name, tensor)]
    if part == "A":
        return [(module, tensor) for module, _ in parts]
    total = sum(size for _, size in parts)
    if tensor.ndim != 2 or tensor.shape[0] != total:
        raise AdapterError(f"{path}: tensor {key} has shape {tensor.shape}, expected ({total}, rank): "
                           f"{name} is {' + '.join(f'{m} ({n})' for m, n in parts)}")
    bounds = np.cumsum([0] + [size for _, size in parts])
    return [(module, tensor[start:stop]) for (module, _), start, stop in zip(parts, bounds[:-1], bounds[1:])]


def _grouped(adapter: LoraAdapter, tensors: dict[str, np.ndarray], base: LlamaConfig, path: str) -> dict:
    """{(module, part, shape): [(layer, tensor)]} of every tensor (fused modules split), each
    checked against the config's targets and the shape its layer's rank and the module give."""
    groups: dict = {}
    for key, tensor in tensors.items():
        layer, name, part = _parse_key(key, path, base)
        for module, piece in _pieces(base, name, part, tensor, key, path):
            if not (layer < base.num_layers and adapter.config.targets(layer, module)):
                raise AdapterError(f"{path}: tensor {key} is for a module the adapter config does not target")
            _check_shape(adapter.modules[module], layer, module, part, piece, key, path)
            groups.setdefault((module, part, piece.shape), []).append((layer, piece))
    return groups


def _check_shape(weights, layer, module, part, tensor, key, path) -> None:
    rank = int(weights.rank[layer])
    fan_in, fan_out = weights.a.shape[1], weights.b.shape[2]
    want = (rank, fan_in) if part == "A" else (fan_out, rank)
    if tensor.shape != want:
        raise AdapterError(f"{path}: tensor {key} has shape {tensor.shape}, expected {want} "
                           f"(rank {rank} from the adapter config; the base model's {module} is {fan_in}->{fan_out})")


def _place_group(weights, part: str, pieces: list) -> None:
    """Writes `pieces` [(layer, tensor)] of one shape (A [r, k] or B [n, r] as PEFT stores them)
    transposed into a [L, k, r] or b [L, r, n]: one numpy assignment over a strided view of all of
    them when they lie at equal steps in one buffer (`_stacked`; a safetensors file of uniform
    layers), else one per layer."""
    rank = pieces[0][1].shape[0 if part == "A" else 1]
    stacked = _stacked([tensor for _, tensor in pieces])
    if stacked is None:
        _assign(weights, part, rank, [layer for layer, _ in pieces], [tensor for _, tensor in pieces])
        return
    view, order = stacked
    _assign(weights, part, rank, np.array([pieces[i][0] for i in order]), [view])


def _assign(weights, part: str, rank: int, layers, sources: list[np.ndarray]) -> None:
    """Writes PEFT-layout `sources` (A [r, k] / B [n, r] each, or one strided view [G, ...] of all)
    transposed into the `layers` of `weights`' a [L, k, r] / b [L, r, n], at rank `rank`."""
    dest = weights.a[:, :, :rank] if part == "A" else weights.b[:, :rank, :]
    if len(sources) == 1 and sources[0].ndim == 3:
        dest[layers] = sources[0].transpose(0, 2, 1)
        return
    for layer, source in zip(layers, sources):
        dest[layer] = source.T


def _stacked(arrays: list[np.ndarray]):
    """(a strided view [G, *shape] of `arrays` in memory order, their indices in that order), or
    None unless they are views of one buffer with the same shape, dtype and strides at equal steps."""
    first = arrays[0]
    roots = {id(_root(a)) for a in arrays}
    if len(roots) != 1 or any(a.strides != first.strides or a.dtype != first.dtype for a in arrays):
        return None
    addresses = [a.__array_interface__["data"][0] for a in arrays]
    order = sorted(range(len(arrays)), key=addresses.__getitem__)
    steps = {addresses[j] - addresses[i] for i, j in zip(order, order[1:])} or {0}
    step = steps.pop()
    if steps or (len(arrays) > 1 and step <= 0):
        return None
    view = np.lib.stride_tricks.as_strided(arrays[order[0]], (len(arrays), *first.shape), (step, *first.strides),
                                           writeable=False)
    return view, order


def _root(array: np.ndarray):
    """The object that owns `array`'s memory (the end of its chain of bases)."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array


def _check_all_present(config: LoraConfig, base: LlamaConfig, seen: set, path: str) -> None:
    missing = [f"{module_key(l, m)}.lora_{p}" for l in range(base.num_layers) for m in config.target_modules
               for p in "AB" if config.targets(l, m) and (l, m, p) not in seen]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise AdapterError(f"{path}: missing tensors {', '.join(missing[:3])}{more}")


def save_peft_adapter(adapter: LoraAdapter, path: str, base_model_name: str = "", rename=None) -> None:
    """Writes `adapter` so that `peft.PeftModel.from_pretrained(hf_model, path)` loads it.
    rename: the HF model's name of each module (`module_key`'s `model.layers.N...` -> its
    name, e.g. a vision-language model's `model.language_model.layers.N...`; None: as is); the
    config then targets exactly the renamed modules (a regex) and its pattern keys are renamed."""
    os.makedirs(path, exist_ok=True)
    config = adapter.config
    tensors, names = {}, []
    for module, weights in adapter.modules.items():
        for layer, rank in enumerate(weights.rank):
            if rank == 0:
                continue
            names.append(module_key(layer, module) if rename is None else rename(module_key(layer, module)))
            prefix = f"base_model.model.{names[-1]}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(weights.a[layer, :, :rank].T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(weights.b[layer, :rank, :].T)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    raw = _peft_config_dict(config, base_model_name)
    if rename is not None:
        raw["target_modules"] = "(?:" + "|".join(re.escape(name) for name in sorted(names)) + ")"
        raw["layers_to_transform"] = None  # PEFT ignores it beside a regex: the regex names the layers
        for key in ("rank_pattern", "alpha_pattern"):
            raw[key] = {rename(k) if k.startswith("model.layers.") else k: v for k, v in raw[key].items()}
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(raw, f, indent=2)


def _peft_config_dict(config: LoraConfig, base_model_name: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": list(config.target_modules),
        "use_rslora": config.use_rslora,
        "rank_pattern": dict(config.rank_pattern),
        "alpha_pattern": dict(config.alpha_pattern),
        "layers_to_transform": None if config.layers_to_transform is None else list(config.layers_to_transform),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "init_lora_weights": True,
    }
