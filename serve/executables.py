"""Compiled step programs kept on disk as serialized executables, keyed without tracing (issue 35's
warm start).

JAX's persistent compilation cache is keyed by the lowered program, so a warm start still traces
and lowers every step program before it finds the executable: on the CPU most of a warm start's
program phase (`Programs.lower_s` against `compile_s` in the start-up log). `ExecutableStore` keys
an executable by what determines the program without lowering it: a hash of this code (every .py
file of jaxlora/, serve/, pallas_kernels/), jax's and jaxlib's versions, the devices, XLA_FLAGS
and jax's configuration, the program's name and static arguments (their repr, functions by name:
their code is in the hash), and its arguments' shapes,
dtypes, shardings and tree; a hit is `jax.experimental.serialize_executable.deserialize_and_load`,
no trace. A file that does not load (another jaxlib, a corrupt file) is a miss, never an error."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import tempfile

import jax
from jax.experimental import serialize_executable

log = logging.getLogger("jaxlora.serve")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_FOLDERS = ("jaxlora", "serve", "pallas_kernels")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a function's address in a repr: differs between processes


@functools.cache
def code_hash() -> str:
    """sha256 of every .py file under `CODE_FOLDERS` (paths and contents, sorted)."""
    digest = hashlib.sha256()
    for folder in CODE_FOLDERS:
        for directory, subdirs, files in sorted(os.walk(os.path.join(ROOT, folder))):
            subdirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(directory, name)
                digest.update(os.path.relpath(path, ROOT).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def _leaf(value) -> tuple:
    """What an argument leaf contributes to the program: shape, dtype, and a committed sharding."""
    sharding = getattr(value, "sharding", None)
    committed = getattr(value, "_committed", sharding is not None)
    return (tuple(getattr(value, "shape", ())), str(getattr(value, "dtype", type(value).__name__)),
            repr(sharding) if committed else None)


@functools.cache
def _environment() -> str:
    import jaxlib

    devices = jax.devices()
    return repr((jax.__version__, jaxlib.__version__, devices[0].platform, devices[0].device_kind, len(devices),
                 os.environ.get("XLA_FLAGS", ""),  # jax's options but where caches live (a moved cache still hits)
                 sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)))


class ExecutableStore:
    """Serialized executables under `directory` (module doc); `load` / `save` by `key`."""

    def __init__(self, directory: str):
        self.directory = os.path.expanduser(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.hits = self.misses = 0

    @staticmethod
    def key(name: str, static: tuple, args: tuple) -> str:
        """The key of program `name` over `static` arguments and dynamic `args` (arrays or
        `jax.ShapeDtypeStruct`s: only their shapes, dtypes and shardings count)."""
        leaves, tree = jax.tree.flatten(args)
        text = repr((code_hash(), _environment(), name, repr(static), str(tree), [_leaf(x) for x in leaves]))
        return hashlib.sha256(_ADDRESS.sub("", text).encode()).hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + ".bin")

    def load(self, key: str):
        """The executable stored under `key` (a `jax.stages.Compiled`), None if there is none or it
        does not load."""
        try:
            with open(self._path(key), "rb") as f:
                payload = pickle.load(f)
            program = serialize_executable.deserialize_and_load(*payload)
        except FileNotFoundError:
            self.misses += 1
            return None
        except Exception as err:  # another jaxlib's or a truncated file: compiled again
            log.warning("compiled program %s not loaded (%s: %s); compiling it", key[:12], type(err).__name__, err)
            self.misses += 1
            return None
        self.hits += 1
        return program

    def save(self, key: str, program) -> None:
        """Stores `program` under `key` (written whole, then renamed); a failure is logged only."""
        try:
            payload = pickle.dumps(serialize_executable.serialize(program))
            handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(handle, "wb") as f:
                f.write(payload)
            os.replace(temporary, self._path(key))
        except Exception as err:
            log.warning("compiled program %s not stored (%s: %s)", key[:12], type(err).__name__, err)
