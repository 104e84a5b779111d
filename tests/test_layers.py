"""The layer contract of pyproject.toml ([tool.importlinter]): dependencies point down only.

`lint-imports` checks every import, function-level and TYPE_CHECKING ones included; a jaxlora
module that no layer names would escape it, so each one must fall inside a layer."""

import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT = "from importlinter.cli import lint_imports; raise SystemExit(lint_imports(no_cache=True, no_logo=True))"


def _layer_modules() -> set[str]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return {name.strip() for contract in contracts for layer in contract["layers"] for name in re.split("[|:]", layer)}


def test_imports_point_down():
    result = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


def test_every_jaxlora_module_is_in_a_layer():
    layers = _layer_modules()
    modules = {".".join(path.relative_to(ROOT).with_suffix("").parts) for path in (ROOT / "jaxlora").rglob("*.py")
               if path.name != "__init__.py"}
    outside = sorted(m for m in modules if not any(m == layer or m.startswith(layer + ".") for layer in layers))
    assert not outside, f"add these modules to a layer in pyproject.toml: {outside}"
