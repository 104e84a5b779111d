"""Runs tests/serve/test_model_families.py in a Python process of its own (see the note there):
every family's test must pass in it."""

import os
import subprocess
import sys


def test_model_families_in_their_own_process():
    here = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             os.path.join(here, "test_model_families.py")],
                            env={**os.environ, "JAXLORA_ISOLATED_CHILD": "1"}, capture_output=True, text=True,
                            timeout=900, cwd=os.path.dirname(os.path.dirname(here)))
    assert result.returncode == 0 and "3 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
