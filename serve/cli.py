"""`jaxlora-serve` / `python -m serve`: load a model and adapters, start the engine and the HTTP API."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import jax

from jaxlora.lora import backends
from jaxlora.lora.backends import LoraBackend
from jaxlora.scheduler.serving import INFERENCE_MODES, SCHEDULE_POLICIES
from jaxlora.dtypes import DTYPES

DEFAULT_COMPILE_CACHE = "~/.cache/jaxlora/jit"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxlora-serve", description="OpenAI-compatible multi-LoRA server (jaxlora).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="default", help='"default" (embedded SmolLM2-135M-Instruct), a HF dir or .gguf')
    p.add_argument("--served-model-name", default=None, help="the base model's name in the API")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the weights' dtype; auto: bfloat16 on a GPU or TPU (the checkpoint's bfloat16, or float32 "
                        "cast), float32 on a CPU")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH", help="a PEFT adapter to serve")
    p.add_argument("--compressed", default=None, metavar="PATH",
                   help="a compressed collection (jaxlora-compress): every adapter in it is served by name; JD "
                        "collections from their shared bases (the compressed LoRA backend, mixed with --adapter "
                        "adapters), SVD collections as ordinary adapters")
    p.add_argument("--adapter-dir", default=None, metavar="DIR",
                   help="serve every PEFT adapter folder directly under DIR by its folder name, read on the first "
                        "request that names it (thousands of adapters: see --max-cpu-adapter-memory)")
    p.add_argument("--max-cpu-adapter-memory", default=None, metavar="BYTES",
                   help="bound of the host cache of adapters read from disk, e.g. 8G, 512M (LRU; evicted adapters "
                        "are read again when needed); default unbounded")
    p.add_argument("--max-cpu-adapters", type=int, default=None, metavar="N",
                   help="bound of the host cache in adapters (with or instead of --max-cpu-adapter-memory)")
    p.add_argument("--allowed-adapter-dir", action="append", default=[], metavar="DIR",
                   help="directory under which /v1/load_lora_adapter may read adapters (repeatable)")
    p.add_argument("--max-adapters-on-device", type=int, default=4, help="adapter pool slots on the device")
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest servable rank (default: 16 or the "
                                                                  "largest startup adapter's rank)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=2048, help="context length (prompt + output tokens)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-kv-pages", type=int, default=None,
                   help="KV pages (default: as many as fit in --gpu-memory-utilization of the device memory after "
                        "the weights and the adapter pool; 8 full contexts on a CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of each device's memory, in (0, 1], for weights, adapters and KV pages (the rest: "
                        "a step's activations); sizes the KV cache when --num-kv-pages is not given")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="rows (requests) per step, in [1, 1024] (default: 256 on a GPU/TPU, 32 on a CPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step, in [1, 65536] (default: 2048 on a GPU/TPU, 128 on a CPU)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="most prompt tokens of one request per step (default: the token budget on a GPU/TPU, 64 on "
                        "a CPU)")
    p.add_argument("--background-compile", choices=("auto", "on", "off"), default="auto",
                   help="on: /health turns ready once the step programs that can serve any step are compiled, the "
                        "rest compile while serving (steps meanwhile run in larger compiled buckets); off: compile "
                        "every step program first; auto: on for a GPU/TPU")
    p.add_argument("--compile-worker", choices=("auto", "on", "off"), default="auto",
                   help="on: the background compile runs in a child process (its Python and CPU off the serving "
                        "process), in-process wherever the child fails; auto: on for a GPU")
    p.add_argument("--scan-layers-from-tokens", type=int, default=None,
                   help="steps of at least this many tokens run the layers as one compiled scan body (5-10x faster "
                        "to compile), smaller ones unrolled (default: 512 on a GPU/TPU, 1 on a CPU; the server's first "
                        "programs are compiled scanned and their unrolled ones in the background)")
    p.add_argument("--split-layers", action="store_true",
                   help="hold each decoder layer's weights as arrays of their own, every step program unrolled over "
                        "them: ~5x faster GPU compiles of unrolled programs (unmerged inference, one device)")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="largest max_tokens a request may ask")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-grammar-bytes", type=int, default=32 << 10,
                   help="largest structured-output grammar (JSON schema, regex, choices, grammar; serialized)")
    p.add_argument("--max-images", type=int, default=8, help="image_url parts in one chat request")
    p.add_argument("--max-image-bytes", type=int, default=1 << 20,
                   help="largest image (decoded PNG/JPEG bytes of a data: URL; the body bound applies too)")
    p.add_argument("--max-image-pixels", type=int, default=4096 * 4096, help="largest image, width x height")
    p.add_argument("--max-waiting", type=int, default=1024, help="queued sequences before 429")
    p.add_argument("--lora-backend", default=backends.AUTO, choices=(backends.AUTO,) + backends.names(serves=True),
                   help="how LoRA rows are computed: XLA (gather, onehot, ...), the Pallas SGMV/BGMV kernels "
                        "(pallas), or BGMV on decode-only steps and one-hot GEMMs otherwise (hybrid); auto: "
                        "hybrid on one GPU, onehot with tensor parallel or on a TPU, gather on a CPU")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the model over the first N devices (Megatron weights, S-LoRA adapters, KV heads); "
                        "needs an XLA LoRA backend (gather, onehot, ...) when N > 1")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="one engine per local device on the first N devices, behind this one API: each request goes "
                        "to the busiest replica with room (Punica), a replica short of KV migrates its newest request "
                        "to another; GET /state, POST /drain")
    p.add_argument("--grow-kv", action="store_true",
                   help="admit a request with the KV pages of its prompt and grow them with its output (more requests "
                        "fit) instead of reserving prompt + max_tokens; when pages run out the newest request is "
                        "preempted: recomputed later, or migrated to another replica")
    p.add_argument("--unified-paging", action="store_true",
                   help="S-LoRA unified paging: KV pages and adapters in one page budget (idle adapters evicted for "
                        "KV), each adapter in exactly its rank of device rows read through a row table (one device)")
    p.add_argument("--adapter-rows", type=int, default=None, metavar="N",
                   help="--unified-paging: device rows for adapters (default: max-adapters-on-device x max rank)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="turn off prefix caching (on by default: a request reuses the KV pages of the full blocks of "
                        "its leading tokens that an earlier request of the same adapter computed)")
    p.add_argument("--schedule-policy", default="fcfs", choices=tuple(SCHEDULE_POLICIES),
                   help="the waiting queue's order: fcfs (arrival), or lof (longest output first, as SGLang's: the "
                        "request with the most max_tokens still to come starts first; shortens a batch's tail when "
                        "requests wait for adapter slots, and lets short requests wait behind long ones)")
    p.add_argument("--inference-mode", default="unmerged", choices=INFERENCE_MODES,
                   help="unmerged: every adapter as LoRA; merged: one adapter's ΔW folded into the base weights a "
                        "step (the others wait); mixed: the most requested adapter merged, the others beside it "
                        "(deLoRA); auto: V-LoRA's policy picks each step (keeps a copy of the base kernels)")
    p.add_argument("--ttft-slo-ms", type=float, default=None, metavar="MS",
                   help="time-to-first-token objective: a queued request that can no longer start within it is "
                        "dropped with 503 (S-LoRA early abort); default off")
    p.add_argument("--compile-cache", default=DEFAULT_COMPILE_CACHE, metavar="DIR",
                   help="JAX's persistent compilation cache: a restarted server loads its step programs from "
                        "here instead of compiling them again (empty: off)")
    p.add_argument("--no-executable-cache", dest="executable_cache", action="store_false",
                   help="with --compile-cache: do not keep the step programs as serialized executables under "
                        "DIR/jaxlora-executables (a restart then traces and lowers each program to find it in "
                        "JAX's cache: most of a warm start's program phase)")
    p.add_argument("--api-key", default=os.environ.get("JAXLORA_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics (default: "
                        "$JAXLORA_API_KEY; none: no authentication)")
    p.add_argument("--metrics-require-key", action="store_true", help="/health and /metrics need the API key too")
    tune = p.add_argument_group("fine-tuning inside the server (the OpenAI fine-tuning API, serve.finetune)")
    tune.add_argument("--data-dir", default=None, metavar="DIR",
                      help="turn on /v1/files and /v1/fine_tuning/jobs: uploads, the job table, checkpoints under DIR "
                           "(needs --adapter-dir: finished adapters are served from there); jobs resume on restart")
    tune.add_argument("--max-file-bytes", default="16M", metavar="BYTES", help="largest training file upload")
    tune.add_argument("--finetune-capacity", type=int, default=512, metavar="TOKENS",
                      help="tokens per training microbatch (one device step that serving may wait for)")
    tune.add_argument("--finetune-checkpoint-every", type=int, default=8, metavar="N",
                      help="checkpoint a job every N microbatches (Orbax)")
    tune.add_argument("--finetune-learning-rate", type=float, default=1e-3,
                      help="the learning rate a job's learning_rate_multiplier multiplies")
    tune.add_argument("--finetune-train-below", type=int, default=0, metavar="N",
                      help="run a training microbatch between serving steps while at most N requests run and none "
                           "waits (0: train only when serving is idle)")
    tune.add_argument("--finetune-tpot-ms", type=float, default=None, metavar="MS",
                      help="with --finetune-train-below: train between serving steps only if a serving step plus a "
                           "microbatch (its measured time) stay within MS per output token")
    p.add_argument("--log-level", default="info")
    return p


def finetune_settings(args):
    """The fine-tuning settings of the arguments (None without --data-dir); SystemExit for bad values."""
    if args.data_dir is None:
        return None
    from serve.finetune import FinetuneSettings
    from serve.finetune_jobs import TrainingSettings

    if args.adapter_dir is None:
        raise SystemExit("jaxlora-serve: --data-dir needs --adapter-dir (finished jobs' adapters are served from there)")
    for option, value in (("--finetune-capacity", args.finetune_capacity),
                          ("--finetune-checkpoint-every", args.finetune_checkpoint_every)):
        if value < 1:
            raise SystemExit(f"jaxlora-serve: {option} must be >= 1, got {value}")
    if args.finetune_train_below < 0 or not args.finetune_learning_rate > 0:
        raise SystemExit("jaxlora-serve: --finetune-train-below must be >= 0 and --finetune-learning-rate > 0")
    if args.finetune_tpot_ms is not None and not args.finetune_tpot_ms > 0:
        raise SystemExit(f"jaxlora-serve: --finetune-tpot-ms must be > 0, got {args.finetune_tpot_ms}")
    if args.replicas > 1 or args.tensor_parallel > 1 or args.inference_mode != "unmerged":
        raise SystemExit("jaxlora-serve: --data-dir (fine-tuning) runs on one engine on one device with "
                         "--inference-mode unmerged (not with --replicas, --tensor-parallel or merged modes)")
    os.makedirs(args.data_dir, exist_ok=True)
    training = TrainingSettings(args.finetune_capacity, args.finetune_checkpoint_every, args.model, args.dtype)
    return FinetuneSettings(os.path.abspath(args.data_dir), parse_bytes(args.max_file_bytes),
                            base_learning_rate=args.finetune_learning_rate, train_below=args.finetune_train_below,
                            tpot_target_s=None if args.finetune_tpot_ms is None else args.finetune_tpot_ms / 1e3,
                            training=training)


def parse_adapters(specs: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--adapter expects NAME=PATH, got {spec!r}")
        pairs.append((name, path))
    return pairs


_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str | None) -> int | None:
    """Bytes of "123", "512M", "8G", "1.5GiB" (binary units); SystemExit if unreadable or < 1."""
    if text is None:
        return None
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _BYTE_UNITS and not value[-1:].isdigit() else ""
    try:
        number = float(value[: len(value) - len(unit)]) * _BYTE_UNITS[unit]
    except ValueError:
        number = -1
    if not number >= 1:
        raise SystemExit(f"jaxlora-serve: --max-cpu-adapter-memory expects bytes such as 8G or 512M, got {text!r}")
    return int(number)


def check_host_bound(bound: int | None, adapters: dict, largest_servable: int | None) -> None:
    """SystemExit unless every start-up adapter (name -> compact `PreparedAdapter` bytes) and, with
    --adapter-dir, the largest adapter the server accepts (`largest_servable` bytes) fit in the host
    cache bound: a bound smaller than one adapter could never serve it."""
    if bound is None:
        return
    sizes = dict(adapters) | ({} if largest_servable is None else {"the largest --adapter-dir adapter": largest_servable})
    for name, size in sizes.items():
        if size > bound:
            raise SystemExit(f"jaxlora-serve: --max-cpu-adapter-memory {bound} bytes is smaller than one adapter: "
                             f"{name} needs {size} bytes (for --adapter-dir: rank --max-lora-rank on every "
                             "projection in the served dtype)")


def tensor_parallel_mesh(n: int, lora_backend: LoraBackend | str):
    """The (tensor=n) mesh over the first n devices, None for n == 1; SystemExit with the reason when
    it cannot be built (the model's shapes are checked by the engine)."""
    if n < 1:
        raise SystemExit(f"jaxlora-serve: --tensor-parallel must be >= 1, got {n}")
    if n == 1:
        return None
    import jax

    from jaxlora.sharding import make_mesh

    try:
        backends.get(lora_backend, serves=True, partitionable=True)
    except ValueError as err:
        raise SystemExit(f"jaxlora-serve: --lora-backend: {err}")
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"jaxlora-serve: --tensor-parallel {n} needs {n} devices; {jax.default_backend()} has "
                         f"{len(devices)}")
    return make_mesh(tensor=n, devices=devices[:n])


def replica_devices(n: int, tensor_parallel: int) -> list | None:
    """The devices of `--replicas n` (None for n == 1); SystemExit when they are not there."""
    if n < 1:
        raise SystemExit(f"jaxlora-serve: --replicas must be >= 1, got {n}")
    if n == 1:
        return None
    if tensor_parallel > 1:
        raise SystemExit("jaxlora-serve: --replicas and --tensor-parallel cannot be combined (one device per replica)")
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"jaxlora-serve: --replicas {n} needs {n} devices; {jax.default_backend()} has {len(devices)}")
    return devices[:n]


def default_model_name(model: str) -> str:
    if model in ("default", ""):
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def check_engine_options(args) -> None:
    """SystemExit naming the option for a step size out of its range (`EngineConfig.BOUNDS`) or a
    memory fraction outside (0, 1]; checked before the model loads."""
    from serve.engine import EngineConfig

    sizes = {"--max-num-seqs": ("max_num_seqs", args.max_num_seqs),
             "--max-num-batched-tokens": ("token_budget", args.max_num_batched_tokens),
             "--prefill-chunk": ("prefill_chunk", args.prefill_chunk)}
    for option, (field, value) in sizes.items():
        low, high = EngineConfig.BOUNDS[field]
        if value is not None and not low <= value <= high:
            raise SystemExit(f"jaxlora-serve: {option} must be in [{low}, {high}], got {value}")
    if args.scan_layers_from_tokens is not None and args.scan_layers_from_tokens < 0:
        raise SystemExit(f"jaxlora-serve: --scan-layers-from-tokens must be >= 0, got {args.scan_layers_from_tokens}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise SystemExit(f"jaxlora-serve: --gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.ttft_slo_ms is not None and not args.ttft_slo_ms > 0:
        raise SystemExit(f"jaxlora-serve: --ttft-slo-ms must be > 0, got {args.ttft_slo_ms}")


def configure_logging(level: str) -> None:
    """The server's log at `level` on stderr; below debug, without jax's backend probes ("Unable to
    initialize backend 'tpu'" on every start of a machine without one)."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr)
    probes = logging.getLogger("jax._src.xla_bridge")
    probes.setLevel(logging.NOTSET if level.lower() == "debug" else logging.WARNING)


def resolve_dtype(args) -> None:
    """Replaces `args.dtype` ("auto" or a dtype) by the dtype the weights load in, once, and logs it
    with the reason (`jaxlora.dtypes.choose_dtype`: bfloat16 on a GPU or TPU, float32 on a CPU)."""
    import jax

    from jaxlora.dtypes import checkpoint_dtype, choose_dtype

    args.dtype, why = choose_dtype(args.dtype, jax.default_backend(), checkpoint_dtype(args.model))
    logging.getLogger("jaxlora.serve").info("weights in %s (%s)", args.dtype, why)


def build_app(args):
    """Loads everything the arguments name and returns the FastAPI app (errors exit with a message)."""
    import jax.numpy as jnp

    from jaxlora.lora.adapter_config import AdapterError
    from jaxlora.lora.peft_io import load_peft_adapter
    from serve.adapter_store import largest_adapter_bytes
    from jaxlora.models.packed import pack_projections
    from jaxlora.vision.loading import is_vlm_dir
    from jaxlora.weights import WeightsError, load_model, load_tokenizer
    from serve import warm_start
    from serve.app import ServerSettings, create_app
    from serve.protocol import Limits
    from serve.engine import Engine
    from serve.placement import Handover
    from serve.replicas import ReplicaSet

    check_engine_options(args)
    resolve_dtype(args)
    finetune = finetune_settings(args)
    if args.metrics_require_key and not args.api_key:
        raise SystemExit("jaxlora-serve: --metrics-require-key needs --api-key (or JAXLORA_API_KEY)")
    import jax

    host_bound = parse_bytes(args.max_cpu_adapter_memory)
    if args.max_cpu_adapters is not None and args.max_cpu_adapters < 1:
        raise SystemExit(f"jaxlora-serve: --max-cpu-adapters must be >= 1, got {args.max_cpu_adapters}")
    if args.adapter_dir is not None and not os.path.isdir(args.adapter_dir):
        raise SystemExit(f"jaxlora-serve: --adapter-dir {args.adapter_dir} is not a directory")
    collection = read_compressed(args)
    args.lora_backend = backends.resolve(args.lora_backend, jax.default_backend(), args.tensor_parallel)
    mesh = tensor_parallel_mesh(args.tensor_parallel, args.lora_backend)
    devices = replica_devices(args.replicas, args.tensor_parallel)
    if devices is not None and collection is not None and collection.method != "svd":
        raise SystemExit("jaxlora-serve: a compressed JD collection is served by one engine (no --replicas)")
    images = None  # a vision-language model's tower and preprocessing (`serve.vision`)
    plan = None  # the weights' plan when they are written into the built engine (`serve.warm_start`)
    try:
        started = time.perf_counter()
        dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
        if is_vlm_dir(args.model):  # LLaVA-1.5, Idefics3: its language model served by the engine, its tower beside it
            if finetune is not None:
                raise SystemExit("jaxlora-serve: fine-tuning inside the server (--data-dir) is not built for a "
                                 "vision-language model")
            if mesh is not None or devices is not None or collection is not None:
                raise SystemExit("jaxlora-serve: a vision-language model is served by one engine on one device "
                                 "(no --tensor-parallel, --replicas or --compressed)")
            from jaxlora.vision.loading import load_vlm
            from serve.vision import ImageServing

            vlm, tokenizer, processor = load_vlm(args.model, dtype)
            images = ImageServing(vlm, processor)
            model = vlm.language
        elif warm_start.applies(args, mesh, devices, collection, vlm=False):  # weights written once programs load
            (model, plan), tokenizer = warm_start.placeholder_model(args.model, dtype), load_tokenizer(args.model)
        else:
            model, tokenizer = load_model(args.model, dtype)
        logging.getLogger("jaxlora.serve").info("model %s in %.1f s (%d layers, %s)", "loaded" if plan is None else
                                                "planned (headers read, zero weights)", time.perf_counter() - started,
                                                model.config.num_layers, args.dtype)
        paths = dict(parse_adapters(args.adapter))
        read = images.read_adapter if images is not None else (
            lambda path, name: load_peft_adapter(path, model.config, name, keep_dtype=True))
        adapters = {name: read(path, name) for name, path in paths.items()}
    except (WeightsError, AdapterError, OSError) as err:
        raise SystemExit(f"jaxlora-serve: {err}")
    shared = None
    if collection is not None and collection.method == "svd":
        adapters |= {name: collection.as_adapter(name) for name in collection.names}
    elif collection is not None:
        shared = collection.serving_set()
    max_rank = args.max_lora_rank or max([16] + [a.max_rank for a in adapters.values()])
    context = min(args.max_model_len, model.config.max_position_embeddings)
    built = time.perf_counter()
    try:
        config = engine_config(args, max_rank, context, host_bound)
        if devices is not None:  # each replica places its own copy on its device
            engine = ReplicaSet.on_devices(model, tokenizer.eos_token_ids, config, None, devices)
            first = engine.engines[0]
        else:
            if mesh is None:  # packed here so that the separate kernels are freed before the KV cache is sized
                model = pack_projections(model)
            # zero placeholders (the warm start): the engine remakes its arrays side by side and frees ours
            handover = Handover.KEEP if plan is None else Handover.ZEROS
            engine = first = Engine(model, tokenizer.eos_token_ids, config, mesh=mesh, compressed=shared, images=images,
                                    handover=handover)
        prepared = {name: first.prepare_adapter(adapter) for name, adapter in adapters.items()}
        largest = None if args.adapter_dir is None else largest_adapter_bytes(first.pool, model.dtype)
        check_host_bound(host_bound, {name: p.nbytes for name, p in prepared.items()}, largest)
        for name, adapter in adapters.items():  # from their folders (evictable); SVD ones held
            engine.add_adapter(name, adapter, paths.get(name))
        logging.getLogger("jaxlora.serve").info("engine built in %.1f s (%d KV pages)", time.perf_counter() - built,
                                                first.config.num_pages)
        if args.compile_cache and args.executable_cache and devices is None and mesh is None:
            use_executable_store(engine, args.compile_cache)
        if plan is not None:
            warm_start.load_into(engine, plan, started, args.dtype)
    except (AdapterError, ValueError, WeightsError, OSError) as err:  # bad sizes, TP shapes, a checkpoint's read
        raise SystemExit(f"jaxlora-serve: {err}")
    for option, value, least in (("--max-images", args.max_images, 0), ("--max-image-bytes", args.max_image_bytes, 1),
                                 ("--max-image-pixels", args.max_image_pixels, 1)):
        if value < least:
            raise SystemExit(f"jaxlora-serve: {option} must be >= {least}, got {value}")
    limits = Limits(max_tokens=args.max_tokens_limit, max_body_bytes=args.max_body_bytes,
                    max_grammar_bytes=args.max_grammar_bytes, max_images=args.max_images,
                    max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels)
    settings = ServerSettings(args.served_model_name or default_model_name(args.model),
                              tuple(args.allowed_adapter_dir), limits, api_key=args.api_key,
                              metrics_require_key=args.metrics_require_key, finetune=finetune)
    try:
        return create_app(engine, tokenizer, settings)
    except ValueError as err:  # fine-tuning on an engine that cannot train
        raise SystemExit(f"jaxlora-serve: {err}")


def engine_config(args, max_rank: int, context: int, host_bound: int | None):
    """The `EngineConfig` the parsed arguments describe (`max_rank`: the pool's rank, `context`: the
    model length capped by the model's positions, `host_bound`: the host cache's bytes or None)."""
    from serve.engine import EngineConfig

    return EngineConfig(
        max_adapters_on_device=args.max_adapters_on_device, max_lora_rank=max_rank, page_size=args.page_size,
        num_pages=args.num_kv_pages, max_model_len=context, max_num_seqs=args.max_num_seqs,
        token_budget=args.max_num_batched_tokens, prefill_chunk=args.prefill_chunk, max_waiting=args.max_waiting,
        lora_backend=args.lora_backend, ttft_slo_s=None if args.ttft_slo_ms is None else args.ttft_slo_ms / 1e3,
        gpu_memory_utilization=args.gpu_memory_utilization, adapter_dir=args.adapter_dir,
        max_host_adapter_bytes=host_bound, max_host_adapters=args.max_cpu_adapters,
        reserve_output_kv=not args.grow_kv, inference_mode=args.inference_mode,
        unified_paging=args.unified_paging, adapter_rows=args.adapter_rows, prefix_caching=args.prefix_caching,
        schedule_policy=args.schedule_policy, scan_layers_from_tokens=args.scan_layers_from_tokens,
        split_layers=args.split_layers,
        background_compile={"auto": None, "on": True, "off": False}[args.background_compile],
        compile_worker={"auto": None, "on": True, "off": False}[args.compile_worker])


def read_compressed(args):
    """The collection of --compressed (None without it); a JD collection sets --lora-backend to
    `compressed` (SystemExit for another explicit backend, or an unreadable collection)."""
    if args.compressed is None:
        return None
    from jaxlora.compress import store

    try:
        collection = store.load(args.compressed)
    except store.CollectionError as err:
        raise SystemExit(f"jaxlora-serve: --compressed: {err}")
    if collection.method != "svd":
        shared = backends.names(serves=True, shared_basis=True)
        if args.lora_backend not in (backends.AUTO, *shared):
            raise SystemExit(f"jaxlora-serve: --compressed {collection.method} collections need --lora-backend "
                             f"{' or '.join(shared)} (or auto), got {args.lora_backend!r}")
        args.lora_backend = shared[0]
    if collection.base_model and collection.base_model != args.model:
        logging.getLogger("jaxlora.serve").warning(
            "--compressed %s was made for base model %r, serving %r (shapes are checked)", args.compressed,
            collection.base_model, args.model)
    return collection


def use_executable_store(engine, directory: str) -> None:
    """The engine's programs kept as serialized executables under `directory`/jaxlora-executables
    (`serve.executables`; one engine on the default device); a directory that cannot be made is
    logged and the programs are traced as before."""
    from serve.executables import ExecutableStore

    try:
        engine.programs.store = ExecutableStore(os.path.join(os.path.expanduser(directory), "jaxlora-executables"))
    except OSError as err:
        logging.getLogger("jaxlora.serve").warning("no executable cache in %s: %s", directory, err)


def use_compile_cache(directory: str) -> None:
    """Turns on JAX's persistent compilation cache in `directory` (nothing if empty): the server's
    warm-up compiles every step program, which for a large model takes minutes the first time."""
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    logging.getLogger("jaxlora.serve").info("starting: %s", args.model)
    use_compile_cache(args.compile_cache)
    app = build_app(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30)


if __name__ == "__main__":
    main()
