"""Reading the small JSON files that describe models, adapters and collections, with errors that
name the file (and what the directory was expected to be when the file is missing)."""

from __future__ import annotations

import json
import os
from typing import Any


def read_json_file(file: str, error: type[Exception], missing_hint: str) -> Any:
    """The JSON value in `file`; raises `error` naming the file when it is missing ("not found
    (<missing_hint>)") or not valid JSON. Read with three system calls (open, read, close: each
    lets other threads take the GIL, and a server reads adapter configs beside its busy engine
    thread), not `open()`'s six or more."""
    try:
        data = _read_small_file(file)
    except FileNotFoundError:
        raise error(f"{file}: not found ({missing_hint})") from None
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{file}: not valid JSON: {err}") from err


def _read_small_file(file: str, chunk: int = 1 << 16) -> bytes:
    """The bytes of `file`: one read when it is shorter than `chunk` (a short read of a regular file
    is its end), more otherwise."""
    fd = os.open(file, os.O_RDONLY)
    try:
        parts = [os.read(fd, chunk)]
        while len(parts[-1]) == chunk:
            parts.append(os.read(fd, chunk))
        return b"".join(parts)
    finally:
        os.close(fd)
