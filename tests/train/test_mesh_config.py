"""The job file's `mesh:` and `remat:`: parsing, overrides, and bad meshes refused before anything
is compiled, with a message naming the setting."""

import dataclasses

import jax
import pytest

from jaxlora.models import presets
from tests.train.tiny_jobs import write_tiny_jobs
from train.cli import main
from train.config import ConfigError, MeshConfig, load_train_config
from train.mesh import check_mesh

MODEL = dataclasses.replace(presets.TINY, num_heads=6, num_kv_heads=2, intermediate_size=99, num_layers=4)


@pytest.fixture
def jobs(tmp_path):
    return write_tiny_jobs(str(tmp_path))


def test_mesh_and_remat_from_file_and_overrides(jobs):
    config = load_train_config(jobs, ["mesh.data=4", "mesh.tensor=2", "mesh.fsdp=true", "remat=save_dots"])
    assert config.mesh == MeshConfig(data=4, tensor=2, pipeline=1, fsdp=True) and config.mesh.size == 8
    assert config.remat == "save_dots"
    assert load_train_config(jobs).mesh == MeshConfig()


@pytest.mark.parametrize("overrides, expected", [
    (["mesh.datta=2"], r"unknown mesh key 'datta'"),
    (["mesh.data=0"], r"mesh.data must be a positive integer"),
    (["mesh.fsdp=2"], r"mesh.fsdp must be true or false"),
    (["remat=sometimes"], r"remat='sometimes' is not one of none, layer, save_dots"),
    (["pipeline_stages=2"], r"'pipeline_stages' is replaced by mesh.pipeline"),
])
def test_bad_mesh_settings(jobs, overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_train_config(jobs, overrides)


@pytest.mark.parametrize("overrides, devices, expected", [
    (["mesh.data=4"], 8, r"mesh.data=4 x mesh.tensor=1 x mesh.pipeline=1 = 4 devices, but 8 are available"),
    (["mesh.tensor=4", "mesh.data=2"], 8, r"mesh.tensor=4 does not divide the model's num_heads=6"),
    (["mesh.tensor=3"], 3, r"mesh.tensor=3 does not divide the model's num_kv_heads=2"),
    (["mesh.tensor=2", "mesh.pipeline=4"], 8, r"mesh.tensor=2 does not divide the model's intermediate_size=99"),
    (["mesh.pipeline=8"], 8, r"mesh.pipeline=8 is more stages than the model's 4 layers"),
    (["mesh.data=8", "lora_backend=fused"], 8, r"lora_backend='fused' cannot run with mesh.data=8"),
    (["mesh.pipeline=2", "jobs.1.lora.dropout=0.1"], 2, r"jobs.1.lora.dropout=0.1 with mesh.pipeline=2"),
    (["mesh.pipeline=2", "remat=save_dots"], 2, r"remat='save_dots' with mesh.pipeline=2"),
    (["mesh.data=8", "mesh.fsdp=true"], 8, None),
])
def test_mesh_checks_name_the_setting(jobs, overrides, devices, expected):
    config = load_train_config(jobs, overrides)
    if expected is None:
        check_mesh(config, MODEL, devices)
        return
    with pytest.raises(ConfigError, match=expected):
        check_mesh(config, MODEL, devices)


def test_pipeline_refused_across_processes(jobs):
    with pytest.raises(ConfigError, match=r"mesh.pipeline=2: the MPMD pipeline drives its stages from one process"):
        check_mesh(load_train_config(jobs, ["mesh.pipeline=2"]), MODEL, 2, process_count=2)


def test_cli_refuses_a_bad_mesh_before_compiling(jobs, capsys):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *args, **kwargs: compiles.append(event) if "compile" in event else None)
    devices = jax.device_count()
    assert main([jobs, f"mesh.data={devices + 1}"]) == 2
    assert (f"mesh.data={devices + 1} x mesh.tensor=1 x mesh.pipeline=1 = {devices + 1} devices, "
            f"but {devices} are available") in capsys.readouterr().err
    assert compiles == []
