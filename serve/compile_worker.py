"""A child process that compiles step programs for the server (issue 35: background compiles that
do not stall serving).

Lowering a step program is seconds of Python that holds the GIL, and XLA's compile beside it takes
CPU; on the server's own process both slow the steps that serve meanwhile (2.0x completion latency
in the first 30 s after ready on an H100, bench/NOTES_serve.md). `CompileWorker` runs them in a
child process with its own interpreter at a lower CPU priority: the server sends a program's name,
its static arguments and the shapes, dtypes and shardings of its dynamic ones (`abstract`), the
child lowers and compiles it and sends back the serialized executable
(`jax.experimental.serialize_executable`, as `serve.executables` keeps them on disk), which the
server loads. The child opens the same devices without preallocating their memory (the server holds
its share already); a GPU lets two processes share it, a TPU does not (`Programs.compile` falls back
to compiling in-process wherever the child fails).

Messages are pickles on the child's stdin and on a copy of its stdout (its own stdout goes to
stderr, so nothing it prints corrupts them): a start message (jax's configuration), then one request
(name, static, args, compiler options) and one reply (the serialized executable, or the error's text)
at a time. The child ends when its stdin closes."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import serialize_executable

log = logging.getLogger("jaxlora.serve")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NICE = 10  # the child's CPU priority below the server's (os.nice increment)
# The child's environment: the server's, with device memory allocated on demand (the server's
# process holds its share of the device already).
CHILD_ENVIRONMENT = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
# The child's program: this module imported by its name (run as __main__ its classes would not be
# those the requests' pickles name).
CHILD_MAIN = "from serve.compile_worker import main; main()"


class WorkerClosed(Exception):
    """`CompileWorker.compile` after (or during) `close`: the compile is abandoned, not moved in-process."""


class NotPortable(Exception):
    """An argument the child cannot rebuild (a sharding of a kind `abstract` does not describe)."""


# ---- arguments as the child rebuilds them -------------------------------------------------------
def _sharding_spec(sharding) -> tuple | None:
    """A picklable description of `sharding` (device ids, not devices); NotPortable for a kind it
    does not describe."""
    if sharding is None:
        return None
    memory = getattr(sharding, "memory_kind", None)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return ("single", device.id, memory)
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)
        return ("named", ids, tuple(mesh.axis_names), tuple(sharding.spec), memory)
    raise NotPortable(f"a {type(sharding).__name__}")


def _sharding(spec: tuple | None):
    """The sharding `_sharding_spec` described, over this process's devices."""
    if spec is None:
        return None
    devices = {device.id: device for device in jax.devices()}
    if spec[0] == "single":
        return jax.sharding.SingleDeviceSharding(devices[spec[1]], memory_kind=spec[2])
    _, ids, axes, partition, memory = spec
    mesh = jax.sharding.Mesh(np.vectorize(devices.__getitem__, otypes=[object])(ids), axes)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*partition), memory_kind=memory)


class _Spec(tuple):
    """A leaf of `abstract`'s tree: (shape, dtype name (bfloat16's `str` is a void type's), sharding spec)."""


def abstract(args):
    """`args` (a tree of arrays, `jax.ShapeDtypeStruct`s and Python values) with every array leaf
    as a picklable (shape, dtype, sharding) spec: jax arrays keep their sharding where committed (an
    uncommitted one lands on the default device, as in the server's call), numpy arrays none."""
    def leaf(x):
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            committed = getattr(x, "_committed", True)
            sharding = getattr(x, "sharding", None) if committed else None
            return _Spec((tuple(x.shape), np.dtype(x.dtype).name, _sharding_spec(sharding)))
        if isinstance(x, np.ndarray):
            return _Spec((x.shape, x.dtype.name, None))
        return x

    return jax.tree.map(leaf, args)


def concrete(args):
    """`abstract`'s tree with `jax.ShapeDtypeStruct`s for its specs (what lowering needs)."""
    def leaf(x):
        if isinstance(x, _Spec):
            shape, dtype, sharding = x
            return jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype), sharding=_sharding(sharding))
        return x

    return jax.tree.map(leaf, args, is_leaf=lambda x: isinstance(x, _Spec))


def _config_values() -> dict:
    """jax's configuration values that are plain Python values (what the child applies)."""
    return {name: value for name, value in jax.config.values.items()
            if value is None or isinstance(value, (bool, int, float, str))}


# ---- the server's side ------------------------------------------------------------------------
class CompileWorker:
    """The child process (module doc). `compile` returns a loaded executable, or None once the
    child has failed (the caller compiles in-process); thread-safe, one compile at a time."""

    def __init__(self, process: subprocess.Popen):
        self._process = process
        self._lock = threading.Lock()
        self._ready = False
        self.failed: str | None = None  # why the child failed (then no longer used)
        self.closed = False  # ended by `close` (the background compile's end, the engine's stop)
        self.compiled = 0
        self.seconds = 0.0  # the child's compiles, summed (as the server waited for them)

    @classmethod
    def start(cls) -> "CompileWorker":
        """Starts the child (it imports jax and opens the devices meanwhile) and sends it jax's
        configuration."""
        env = dict(os.environ, **CHILD_ENVIRONMENT)
        env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
        process = subprocess.Popen([sys.executable, "-c", CHILD_MAIN], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=env, cwd=ROOT)
        worker = cls(process)
        try:
            pickle.dump(_config_values(), process.stdin)
            process.stdin.flush()
        except OSError as err:  # the child ended at once
            worker._fail(f"the child ended at start ({type(err).__name__}: {err})")
            return worker
        log.info("compile worker started (pid %d)", process.pid)
        return worker

    @property
    def alive(self) -> bool:
        return self.failed is None and not self.closed and self._process.poll() is None

    def compile(self, name: str, static: tuple, args: tuple, options: dict):
        """The program `name` (a `serve.step.PROGRAMS` key) over `static` and `args` (arrays or
        `jax.ShapeDtypeStruct`s), compiled with XLA `options` in the child and loaded here; None if
        the child failed now or before (logged once) or this program does not go there; WorkerClosed
        once `close` was called (the engine stopping)."""
        try:
            request = pickle.dumps((name, static, abstract(args), options))
        except (NotPortable, pickle.PicklingError, TypeError, AttributeError) as err:
            log.info("program %s compiled in-process: %s is not portable (%s)", name, type(err).__name__, err)
            return None
        with self._lock:
            if self.closed and self.failed is None:
                raise WorkerClosed
            if not self.alive:
                if self.failed is None and not self.closed:
                    self._fail(f"the child ended (exit code {self._process.poll()})")
                return None
            started = time.perf_counter()
            try:
                self._process.stdin.write(request)
                self._process.stdin.flush()
                payload, error = pickle.load(self._process.stdout)
            except (OSError, EOFError, pickle.UnpicklingError) as err:
                if self.closed and self.failed is None:  # closed meanwhile
                    raise WorkerClosed from err
                self._fail(f"the child ended ({type(err).__name__}: {err}; exit code {self._process.poll()})")
                return None
            self.seconds += time.perf_counter() - started
        if error is not None:
            log.warning("compile worker could not compile program %s (%s); compiling it in-process", name, error)
            return None
        try:
            program = serialize_executable.deserialize_and_load(*payload)
        except Exception as err:  # another device assignment, say: this program in-process
            log.warning("program %s from the compile worker did not load (%s: %s); compiling it in-process",
                        name, type(err).__name__, err)
            return None
        self.compiled += 1
        return program

    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            log.warning("compile worker stopped: %s; the background compile goes on in-process", why)
        self.close()

    def close(self) -> None:
        """Ends the child (closing its stdin, then killing it if it lingers); `compile` then returns None."""
        self.closed = True
        process = self._process
        if process.poll() is not None:
            return
        try:
            process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---- the child's side -------------------------------------------------------------------------
def _compile(name: str, static: tuple, args, options: dict) -> tuple:
    """The serialized executable of program `name` (`serve.step.PROGRAMS`) over `static` and the
    `abstract` `args`, compiled with `options`."""
    from serve.step import PROGRAMS

    lowered = PROGRAMS[name].lower(*static, *concrete(args))
    return serialize_executable.serialize(lowered.compile(compiler_options=options or None))


def main() -> None:
    """The child's loop (module doc)."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the child prints goes to stderr
    os.nice(NICE)
    requests = sys.stdin.buffer
    try:
        config = pickle.load(requests)
    except EOFError:
        return
    for name, value in config.items():
        if jax.config.values.get(name, value) != value:
            try:
                jax.config.update(name, value)
            except Exception:  # a read-only or unknown option: the environment set it the same
                pass
    while True:
        try:
            name, static, args, options = pickle.load(requests)
        except EOFError:
            return
        try:
            reply = (_compile(name, static, args, options), None)
        except Exception as err:
            reply = (None, f"{type(err).__name__}: {err}")
        pickle.dump(reply, replies)
        replies.flush()
