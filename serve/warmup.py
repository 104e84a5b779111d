"""An engine's start-up compile (issue 35): which step programs compile before the server turns
ready, which compile in the background while it serves, and where (this process or the compile
worker's child, `serve.compile_worker`).

`Warmup.run` (what `Engine.warmup` calls) compiles the first programs (`StepBuilder.compile_first`:
those that can serve any step, scanned stand-ins below `scan_layers_from_tokens`), then the adapter
pool's slot update, the adapter window's fill and the inference modes' switch, and starts the
background thread (`StepBuilder.compile_rest`) for the rest; beside the compile, a thread grows the pinned
host memory that adapters read from a directory will use (`Residency.reserve_host`), joined before `run`
returns. `Warmup.start` (`Engine.start_warmup`)
starts the first programs early, lowered over the weights' shapes alone, while the caller writes the
weights (`serve.warm_start`). The engine holds one `Warmup` (`Engine.startup`) and stops its
worker when it stops (`Warmup.stop`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from serve.compile_worker import CompileWorker
from serve.placement import abstract_state
from serve.step import StepShape
from serve.step_inputs import forward_inputs

if TYPE_CHECKING:
    from serve.engine import Engine

log = logging.getLogger("jaxlora.serve")


class Warmup:
    """The start-up compile of one `Engine` (module doc): its early first programs (a Future), the
    background thread and its compile worker."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.worker: CompileWorker | None = None  # its child process (`config.compile_worker`)
        self.early = None  # `start`'s first programs (a Future)
        self.lowering_state = None  # while `start`'s programs compile: the weights' shapes
        self.reserve = None  # the pinned host reserve's thread (`Residency.reserve_host`), beside the compile

    @property
    def background(self) -> threading.Thread | None:
        """The background compile's thread (held by the step builder, whose bucket choice asks it)."""
        return self.engine.builder.background

    def run(self, shapes: list[StepShape] | None = None, threads: int | None = None,
            background: bool | None = None) -> dict:
        """`Engine.warmup` (its doc)."""
        engine = self.engine
        self.start_reserve()
        early = self.early if (shapes, threads, background) == (None, None, None) else None
        if early is not None:
            self.early = None
            started, before, rest = early.result()
        else:
            background = engine.config.background_compile if background is None else background
            if background and shapes is None:
                self.start_worker()
            started, before, rest = engine.builder.compile_first(shapes, threads, background, self.padding_args)
        self.lowering_state = None  # the weights are written by now: lower over them
        free = engine.pool.free_slot()
        if free is not None:  # an empty slot written with zeros: compiles the update, changes nothing
            engine.pool.evict(free)
        if engine.window_fill is not None:  # the window's fill: compiled, not run
            engine.window_fill.program()
        if engine.modes is not None:
            engine.modes.warmup(engine)
        self._input_copies()
        self.reserve.join()  # before the first step: the reserve's allocation would hold up the step's calls
        seconds = time.perf_counter() - started
        programs = engine.programs
        log.info("step programs ready: %d compiled in %.1f s (summed over threads: lowering %.1f s, compiling or "
                 "loading from the cache %.1f s)", len(programs) - before, seconds, programs.lower_s,
                 programs.compile_s)
        if self.worker is not None and not rest:
            self.worker.close()
        if rest:
            engine.builder.background = threading.Thread(
                target=self.compile_rest, args=(rest,), daemon=True, name="jaxlora-compile-background")
            engine.builder.background.start()
        return {"programs": len(programs) - before, "seconds": seconds, "background": len(rest)}

    def _input_copies(self) -> None:
        """The copies of each forward's small inputs into their held buffers (`serve.step_inputs`),
        compiled now rather than at a step's first use."""
        engine = self.engine
        if not engine.step_inputs.enabled:
            return
        for shape in engine.step_shapes():
            if shape.program == "forward":
                engine.step_inputs.prepare(shape, forward_inputs(*self.padding_args(shape)[2:6]))

    def start_reserve(self) -> None:
        """Starts growing the pinned host memory for adapter reads (`Residency.reserve_host`) on a
        thread of its own, beside the compile (page-locking takes time in proportion to the bytes, which
        a start-up would otherwise wait for), once per engine; `run` joins it before it returns. An error is
        logged, not raised: without the reserve reads still work (they grow the memory as they go)."""
        if self.reserve is not None:
            return
        residency = self.engine.residency

        def reserve():
            started = time.perf_counter()
            try:
                reserved = residency.reserve_host()
            except Exception:  # noqa: BLE001 (see the doc)
                log.exception("reserving pinned host memory for adapter reads failed")
                return
            if reserved:
                log.info("pinned host memory for adapter reads: %.2f GiB reserved in %.2f s", reserved / 2**30,
                         time.perf_counter() - started)

        self.reserve = threading.Thread(target=reserve, daemon=True, name="jaxlora-pinned-reserve")
        self.reserve.start()

    def start(self) -> None:
        """`Engine.start_warmup` (its doc)."""
        engine = self.engine
        self.start_reserve()
        self.lowering_state = abstract_state(engine._state)
        if engine.config.background_compile:
            self.start_worker()
        self.early = engine.builder.start_first(engine.config.background_compile, self.padding_args)
        if engine.window_fill is not None:  # its fill beside them (split layers: 14 x 32 arguments, ~5 s on an H200)
            threading.Thread(target=self._window_program, daemon=True, name="jaxlora-window-fill").start()

    def _window_program(self) -> None:
        """The adapter window's fill program compiled on `start`'s thread; an error here is raised again
        where `run` compiles it."""
        try:
            self.engine.window_fill.program()
        except Exception:  # noqa: BLE001 (`run` compiles it again and raises)
            log.debug("the window fill's early compile failed", exc_info=True)

    def start_worker(self) -> None:
        """Starts the background compile's child process (`config.compile_worker`) if not yet: it
        imports jax and opens the devices while the first programs compile."""
        if self.engine.config.compile_worker and self.worker is None:
            try:
                self.worker = CompileWorker.start()
            except OSError as err:  # no child process here: the background compile runs in-process
                log.warning("compile worker not started (%s: %s); compiling in-process", type(err).__name__, err)

    def padding_args(self, shape: StepShape) -> tuple:
        """Dynamic arguments of the program `shape` for a step of padding only (writes nothing)."""
        engine = self.engine
        state = engine._state if self.lowering_state is None else self.lowering_state
        return engine.builder.padding_args(shape, state, engine.cache, engine._last_tokens)

    def compile_rest(self, shapes: list[StepShape]) -> None:
        """The background thread of `run` (`StepBuilder.compile_rest`, in the compile worker where
        the config has one); stops with the engine, and ends the worker."""
        try:
            self.engine.builder.compile_rest(shapes, self.padding_args, lambda: self.engine._stopping, self.worker)
        finally:
            if self.worker is not None:
                self.worker.close()

    def stop(self) -> None:
        """Ends the compile worker: a compile there is abandoned (the background thread returns)."""
        if self.worker is not None:
            self.worker.close()
