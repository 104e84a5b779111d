"""Reading the small JSON files that describe models, adapters and collections, with errors that
name the file (and what the directory was expected to be when the file is missing)."""

from __future__ import annotations

import json
import os
from typing import Any


def read_json_file(file: str, error: type[Exception], missing_hint: str) -> Any:
    """The JSON value in `file`; raises `error` naming the file when it is missing ("not found
    (<missing_hint>)") or not valid JSON."""
    if not os.path.exists(file):
        raise error(f"{file}: not found ({missing_hint})")
    try:
        with open(file) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{file}: not valid JSON: {err}") from err
