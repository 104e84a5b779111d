"""Runs tests/serve/test_finetune.py in a Python process of its own (see the note there): all of its
tests must pass in it."""

import os
import subprocess
import sys


def test_finetune_in_its_own_process():
    here = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             os.path.join(here, "test_finetune.py")],
                            env={**os.environ, "JAXLORA_ISOLATED_CHILD": "1"}, capture_output=True, text=True,
                            timeout=1200, cwd=os.path.dirname(os.path.dirname(here)))
    assert result.returncode == 0 and " passed" in result.stdout and "skipped" not in result.stdout, \
        result.stdout[-3000:] + result.stderr[-3000:]
