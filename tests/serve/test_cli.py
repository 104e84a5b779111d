"""`jaxlora-serve` command-line options reach the engine configuration."""

import pytest

from jaxlora.lora import backends
from jaxlora.lora.backends import resolve as resolve_lora_backend
from serve.cli import build_parser


def test_lora_backend_option():
    args = build_parser().parse_args(["--lora-backend", "pallas"])
    assert args.lora_backend == "pallas" and "pallas" in backends.names(serves=True)
    assert build_parser().parse_args([]).lora_backend == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--lora-backend", "fused"])


def test_auto_lora_backend_per_platform():
    assert resolve_lora_backend("auto", "gpu") == "hybrid"
    assert resolve_lora_backend("auto", "gpu", tensor_parallel=2) == "onehot"
    assert resolve_lora_backend("auto", "tpu") == "onehot"
    assert resolve_lora_backend("auto", "cpu") == "gather"
    assert resolve_lora_backend("pallas", "cpu") == "pallas"  # an explicit choice is kept


def test_tensor_parallel_option_errors():
    import jax

    from serve.cli import tensor_parallel_mesh

    assert build_parser().parse_args([]).tensor_parallel == 1
    assert build_parser().parse_args(["--tensor-parallel", "2"]).tensor_parallel == 2
    assert tensor_parallel_mesh(1, "pallas") is None  # one device: nothing changes
    too_many = jax.device_count() + 1
    with pytest.raises(SystemExit, match=f"--tensor-parallel {too_many} needs {too_many} devices"):
        tensor_parallel_mesh(too_many, "gather")
    with pytest.raises(SystemExit, match="use one of gather, onehot"):
        tensor_parallel_mesh(2, "pallas")
    with pytest.raises(SystemExit, match=">= 1"):
        tensor_parallel_mesh(0, "gather")


@pytest.mark.parametrize("option, value, message", [
    ("--max-num-seqs", "0", r"--max-num-seqs must be in \[1, 1024\], got 0"),
    ("--max-num-seqs", "1025", r"--max-num-seqs must be in \[1, 1024\], got 1025"),
    ("--max-num-batched-tokens", "0", r"--max-num-batched-tokens must be in \[1, 65536\], got 0"),
    ("--prefill-chunk", "100000", r"--prefill-chunk must be in \[1, 65536\], got 100000"),
    ("--gpu-memory-utilization", "0", r"--gpu-memory-utilization must be in \(0, 1\], got 0.0"),
    ("--gpu-memory-utilization", "1.5", r"--gpu-memory-utilization must be in \(0, 1\], got 1.5"),
    ("--scan-layers-from-tokens", "-1", r"--scan-layers-from-tokens must be >= 0, got -1"),
])
def test_step_size_and_memory_options_are_bounded(option, value, message):
    from serve.cli import check_engine_options

    args = build_parser().parse_args([])
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.num_kv_pages) == (None, None, None)
    assert args.gpu_memory_utilization == 0.9
    check_engine_options(args)  # the defaults pass
    with pytest.raises(SystemExit, match=message):
        check_engine_options(build_parser().parse_args([option, value]))


def test_compile_cache_option_turns_on_jax_persistent_cache(tmp_path):
    """`--compile-cache DIR` points JAX's persistent compilation cache at DIR; empty leaves it off."""
    import jax

    from serve.cli import build_parser, use_compile_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        use_compile_cache("")
        assert jax.config.jax_compilation_cache_dir == before
        args = build_parser().parse_args(["--compile-cache", str(tmp_path / "jit")])
        use_compile_cache(args.compile_cache)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jit")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_host_cache_bound_options():
    from serve.cli import parse_bytes

    assert [parse_bytes(v) for v in ("4096", "512M", "8G", "1.5GiB", "64kb")] == [4096, 512 << 20, 8 << 30,
                                                                                 3 << 29, 64 << 10]
    assert parse_bytes(None) is None
    for bad in ("lots", "-1G", "0", "G"):
        with pytest.raises(SystemExit, match="expects bytes"):
            parse_bytes(bad)
    args = build_parser().parse_args(["--adapter-dir", "/tmp", "--max-cpu-adapters", "100"])
    assert (args.adapter_dir, args.max_cpu_adapters, args.max_cpu_adapter_memory) == ("/tmp", 100, None)


def test_dtype_auto_is_the_default_and_resolves_per_platform(tmp_path, monkeypatch):
    """--dtype auto (the default, shown by --help): float32 on a CPU, bfloat16 on a GPU or TPU (a
    float32 checkpoint cast, a bfloat16 one kept); an explicit dtype is kept; a wrong one is refused."""
    import json

    import jax

    from jaxlora.dtypes import checkpoint_dtype, choose_dtype
    from serve.cli import resolve_dtype

    parser = build_parser()
    assert parser.parse_args([]).dtype == "auto"
    assert "default: auto" in " ".join(parser.format_help().split())
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float64"])
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16"):
        choose_dtype("fp8", "gpu", None)
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert checkpoint_dtype(str(tmp_path)) == "float32" and checkpoint_dtype("default") is None
    assert choose_dtype("auto", "gpu", "float32") == ("bfloat16", "auto: bfloat16 on gpu (checkpoint float32)")
    assert choose_dtype("auto", "tpu", "bfloat16")[0] == "bfloat16"
    assert choose_dtype("auto", "cpu", "bfloat16")[0] == "float32"
    assert choose_dtype("float32", "gpu", "bfloat16")[0] == "float32"
    for platform, expected in (("cpu", "float32"), ("gpu", "bfloat16")):  # the server's resolution, platform mocked
        monkeypatch.setattr(jax, "default_backend", lambda platform=platform: platform)
        args = parser.parse_args(["--model", str(tmp_path)])
        resolve_dtype(args)
        assert args.dtype == expected


def test_start_up_logs_progress_without_backend_noise(smollm2, caplog):
    """Start-up says what it does (issue 36): the engine's warm-up logs the programs to compile, one
    line per compiled program and when they are ready; the server's logging hides jax's backend
    probes ("Unable to initialize backend 'tpu'") unless at debug level."""
    import logging

    from serve.cli import configure_logging
    from serve.engine import Engine, EngineConfig
    from tests.serve.conftest import SMALL_ENGINE

    configure_logging("info")
    assert logging.getLogger("jax._src.xla_bridge").getEffectiveLevel() == logging.WARNING
    configure_logging("debug")
    assert logging.getLogger("jax._src.xla_bridge").level == logging.NOTSET
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(max_adapters_on_device=2, **SMALL_ENGINE))
    shapes = engine.step_shapes()[:2]
    with caplog.at_level(logging.INFO, logger="jaxlora.serve"):
        engine.warmup(shapes, threads=1)
    messages = [record.getMessage() for record in caplog.records if record.name == "jaxlora.serve"]
    assert messages[0] == "compiling 2 step programs (1 threads)"
    assert any(m.startswith("compiled forward program 1/") for m in messages)
    assert messages[-1].startswith("step programs ready:")


def test_start_up_compile_options_reach_the_engine_config():
    from serve.cli import build_parser, engine_config

    for value, expected in (("auto", None), ("on", True), ("off", False)):
        args = build_parser().parse_args(["--background-compile", value, "--scan-layers-from-tokens", "512",
                                          "--lora-backend", "gather"])
        config = engine_config(args, 16, 2048, None)
        assert (config.background_compile, config.scan_layers_from_tokens) == (expected, 512)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--background-compile", "maybe"])
    for value, expected in (("auto", None), ("on", True), ("off", False)):
        args = build_parser().parse_args(["--compile-worker", value, "--lora-backend", "gather"])
        assert engine_config(args, 16, 2048, None).compile_worker is expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--compile-worker", "maybe"])
