"""Uploaded training files (`POST /v1/files`, purpose "fine-tune"): validated line by line against
the training data formats `jaxlora-train` reads (`train.data.parse_jsonl`: `text`,
`prompt`/`completion` or chat `messages`, no other keys), bounded in size, stored under the
server's data directory as `files/<id>.jsonl` with their table in `files.json`.

Nothing is half-written: a file is validated in memory, written to a temporary name and renamed,
and only then entered in the table (itself written to a temporary file and renamed); a refused
upload leaves nothing behind."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

from train.config import ConfigError
from train.data import parse_jsonl

PURPOSE = "fine-tune"
FORMAT_KEYS = ({"text"}, {"prompt", "completion"}, {"messages"})  # each record: exactly one of these
MAX_FILENAME = 256


class FileError(ValueError):
    """An upload the server refuses; the message says why."""


def write_json_atomic(path: str, value) -> None:
    """`value` as JSON in `path`, written whole or not at all (a temporary file renamed)."""
    temporary = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(temporary, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def read_json_table(path: str) -> dict:
    """The JSON object in `path` ({} if there is none yet)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def check_training_lines(data: bytes, filename: str) -> int:
    """The number of records of a JSONL upload; FileError naming filename:line otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileError(f"{filename}: not UTF-8 text (byte {err.start})") from None
    try:
        records = parse_jsonl(text.splitlines(), filename)
    except ConfigError as err:
        raise FileError(f"{err} (not a JSONL training file)") from None
    for number, record in records:
        keys = set(record)
        if keys not in FORMAT_KEYS:
            extra = sorted(keys - next(k for k in FORMAT_KEYS if k & keys))
            raise FileError(f"{filename}:{number}: unknown field(s) {', '.join(map(repr, extra))} (a record has "
                            "'text', or 'prompt' and 'completion', or 'messages', and nothing else)")
    return len(records)


class FileStore:
    """The uploaded training files of one data directory (thread-safe)."""

    def __init__(self, data_dir: str, max_file_bytes: int):
        self.directory = os.path.join(data_dir, "files")
        self.table_path = os.path.join(data_dir, "files.json")
        self.max_file_bytes = max_file_bytes
        os.makedirs(self.directory, exist_ok=True)
        self._lock = threading.Lock()
        self._files: dict[str, dict] = read_json_table(self.table_path)

    def add(self, data: bytes, filename: str, purpose: str) -> dict:
        """Validates and stores an upload; its file object. FileError for a refused upload."""
        if purpose != PURPOSE:
            raise FileError(f"purpose must be {PURPOSE!r} (this server stores training files only), got {purpose!r}")
        if not filename or len(filename) > MAX_FILENAME:
            raise FileError(f"the file needs a name of 1 to {MAX_FILENAME} characters")
        if len(data) > self.max_file_bytes:
            raise FileError(f"{filename} has {len(data)} bytes, more than this server's limit of "
                            f"{self.max_file_bytes} bytes")
        if not data.strip():
            raise FileError(f"{filename} is empty")
        count = check_training_lines(data, filename)
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        entry = {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                 "filename": os.path.basename(filename), "purpose": PURPOSE, "status": "processed",
                 "status_details": None, "records": count}
        path = self.path(file_id)
        temporary = f"{path}.tmp"
        try:
            with open(temporary, "wb") as f:
                f.write(data)
            os.replace(temporary, path)
            with self._lock:
                table = dict(self._files, **{file_id: entry})
                write_json_atomic(self.table_path, table)
                self._files = table
        except BaseException:
            for leftover in (temporary, path):
                if os.path.exists(leftover):
                    os.remove(leftover)
            raise
        return dict(entry)

    def path(self, file_id: str) -> str:
        return os.path.join(self.directory, f"{file_id}.jsonl")

    def get(self, file_id: str) -> dict | None:
        """The file object of `file_id` (OpenAI's, plus our record count), None if there is none."""
        with self._lock:
            entry = self._files.get(file_id)
        return None if entry is None else dict(entry)

    def list(self) -> list[dict]:
        """Every file object, newest first."""
        with self._lock:
            entries = list(self._files.values())
        return [dict(e) for e in sorted(entries, key=lambda e: (e["created_at"], e["id"]), reverse=True)]
