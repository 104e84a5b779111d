"""The notebooks under notebooks/: executed top to bottom on the CPU (nbclient, a kernel of this
test environment's Python), committed without outputs, each opened by a markdown cell that says
what it shows and how long it takes, and each linked from the README with a Colab badge."""

import os
import pathlib
import re
import sys

import pytest

nbformat = pytest.importorskip("nbformat", reason="the test extra installs nbformat")

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {"quickstart.ipynb", "serve_many_adapters.ipynb", "tpu_vm_multi_adapter.ipynb"}
CELL_TIMEOUT_S = 300


def _read(path):
    return nbformat.read(path, as_version=4)


def test_the_three_notebooks_are_there():
    assert EXPECTED <= {path.name for path in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_outputs_are_committed(path):
    """Outputs (plots, logs, timings) are produced by running, never stored: clear them before committing."""
    for index, cell in enumerate(_read(path).cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"{path.name} cell {index} has stored outputs: clear them"
            assert cell.execution_count is None, f"{path.name} cell {index} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_says_what_and_how_long(path):
    first = _read(path).cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    for platform in ("CPU", "GPU", "TPU"):
        assert platform in first.source, f"{path.name}: the first cell gives no time for {platform}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_readme_links_it_with_a_colab_badge(path):
    readme = (ROOT / "README.md").read_text()
    badge = rf"\(https://colab\.research\.google\.com/github/[\w.-]+/[\w.-]+/blob/main/notebooks/{re.escape(path.name)}\)"
    assert re.search(badge, readme), f"README has no Colab badge for notebooks/{path.name}"


def _kernel_manager():
    """A kernel running this very interpreter (`sys.executable`), whatever kernelspecs the machine
    has installed: the notebooks test the code of this checkout in this environment."""
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name="jaxlora tests", language="python")

    return AsyncKernelManager(kernel_name="jaxlora-tests", kernel_spec_manager=ThisPython())


def execute(path: pathlib.Path, workdir: pathlib.Path):
    """Runs the notebook in `workdir` on the CPU; CellExecutionError (with the cell and its
    traceback) when a cell raises. Returns the executed notebook."""
    from nbclient import NotebookClient

    notebook = _read(path)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    client = NotebookClient(notebook, km=_kernel_manager(), timeout=CELL_TIMEOUT_S, coalesce_streams=True,
                            resources={"metadata": {"path": str(workdir)}})
    client.execute(env=env, cwd=str(workdir))
    return notebook


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_on_cpu(path, tmp_path):
    notebook = execute(path, tmp_path)
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot was drawn"
