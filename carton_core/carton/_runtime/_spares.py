"""Spare runner processes: started and handshaken ahead of time, so the next `carton.load` skips the start-up.

Starting a runner costs an interpreter start plus the imports of numpy, pyzmq, carton_protocol, the runner module
and its framework (the runner entry is imported before the handshake answers): most of what `carton.load` of an
already extracted model costs (docs/runners.md, "Load time"; docs/performance.md, "Built-in runners"). After a
runner is used by an unsandboxed load, the pool starts one idle process for that runner in the background; the next
load for the same `RunnerSpec` takes it (waiting for it if it is still starting) and only sends ``load``.

Only unsandboxed starts use the pool: a sandbox binds the model folder into the runner's view when the process
starts, so a process cannot be started before its model is known. ``CARTON_SPARE_RUNNERS`` is the most spare
processes kept at once, one per runner, most recently used runners first (default 2; ``0`` disables the pool and
closes the spares). Spares are closed at interpreter exit, and like every runner they also exit when the host dies.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import warnings
from collections import OrderedDict
from concurrent.futures import Future

from carton_protocol import RunnerSpec

from ..errors import CartonWarning
from ._process import RunnerProcess

__all__ = ["DEFAULT_SPARE_RUNNERS", "SPARE_RUNNERS_ENV", "SparePool", "spare_limit", "spare_pool"]

#: Environment variable: the most spare runner processes kept (one per runner; ``0`` disables).
SPARE_RUNNERS_ENV = "CARTON_SPARE_RUNNERS"
#: Spare processes kept when ``CARTON_SPARE_RUNNERS`` is unset.
DEFAULT_SPARE_RUNNERS = 2
#: Handshake limit of a spare's start (nobody waits on it unless a load takes it early).
_SPARE_HANDSHAKE_TIMEOUT = 60.0


def spare_limit() -> int:
    """How many spare processes to keep, from ``CARTON_SPARE_RUNNERS`` (read at every load)."""
    text = os.environ.get(SPARE_RUNNERS_ENV)
    if text is None or not text.strip():
        return DEFAULT_SPARE_RUNNERS
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        warnings.warn(
            f"{SPARE_RUNNERS_ENV}={text!r} is not a count of spare runner processes (an integer >= 0); "
            f"using {DEFAULT_SPARE_RUNNERS}",
            CartonWarning,
            stacklevel=3,
        )
        return DEFAULT_SPARE_RUNNERS
    return value


def _poolable(spec: RunnerSpec) -> bool:
    """Specs are pool keys; one a plugin built with unhashable fields (``env`` as a dict) just gets no spares."""
    try:
        hash(spec)
    except TypeError:
        return False
    return True


def _close_quietly(process: RunnerProcess, timeout: float = 2.0) -> None:
    with contextlib.suppress(Exception):
        process.close(timeout)


class SparePool:
    """Idle, handshaken runner processes by `RunnerSpec`; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # spec -> the spare being started or ready; insertion order = least recently used first.
        self._spares: OrderedDict[RunnerSpec, Future[RunnerProcess]] = OrderedDict()
        self._closed = False

    def take(self, spec: RunnerSpec, *, handshake_timeout: float) -> tuple[RunnerProcess, bool]:
        """A started runner for ``spec`` and whether it was a spare: the spare when there is a live one (waiting for
        it if it is still starting), else a new process. Starting a new one raises what `RunnerProcess.start`
        raises. A spare can still die right after this check: callers retry a spare that fails with a fresh start."""
        if not _poolable(spec):
            return RunnerProcess.start(spec, handshake_timeout=handshake_timeout), False
        with self._lock:
            pending = self._spares.pop(spec, None)
        if pending is not None:
            try:
                process = pending.result(timeout=handshake_timeout)
            except TimeoutError:  # still starting: whoever finishes it closes it; this caller starts its own
                pending.add_done_callback(_close_done)
                process = None
            except Exception:  # a spare that failed to start: start one for this caller instead
                process = None
            if process is not None and process.alive:
                return process, True
            if process is not None:
                _close_quietly(process)
        return RunnerProcess.start(spec, handshake_timeout=handshake_timeout), False

    def take_later(self, spec: RunnerSpec, *, handshake_timeout: float) -> Future[tuple[RunnerProcess, bool]]:
        """`take` on a helper thread: the caller collects ``(process, was a spare)`` (or the start's error) with
        ``result()``, and owns the process (a done-callback must close it if the caller gives up)."""
        future: Future[tuple[RunnerProcess, bool]] = Future()

        def start() -> None:
            try:
                taken = self.take(spec, handshake_timeout=handshake_timeout)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(taken)

        threading.Thread(target=start, name="carton-prestart", daemon=True).start()
        return future

    def replenish(self, spec: RunnerSpec) -> Future[RunnerProcess] | None:
        """Make sure a spare for ``spec`` exists or is starting (in a background thread); evict the least recently
        used spares beyond the limit. Returns the spare's future (it completes when the process is up, or with the
        start's error), or ``None`` when the pool is disabled or closed or ``spec`` cannot be a pool key. The future
        is the pool's: callers may wait on it, never take its process."""
        if not _poolable(spec):
            return None
        limit = spare_limit()
        evicted: list[Future[RunnerProcess]] = []
        started: Future[RunnerProcess] | None = None
        kept: Future[RunnerProcess] | None = None
        with self._lock:
            if self._closed:
                return None
            if limit == 0:
                evicted = list(self._spares.values())
                self._spares.clear()
            elif spec in self._spares:
                self._spares.move_to_end(spec)
                kept = self._spares[spec]
            else:
                kept = started = Future()
                self._spares[spec] = started
            while len(self._spares) > limit:
                evicted.append(self._spares.popitem(last=False)[1])
        for future in evicted:
            future.add_done_callback(_close_done)
        if started is not None:
            threading.Thread(target=self._start, args=(spec, started), name="carton-spare-runner", daemon=True).start()
        return kept

    def _start(self, spec: RunnerSpec, future: Future[RunnerProcess]) -> None:
        # Whoever holds the future when it completes owns the process: the pool (kept), a `take` (used), or an
        # eviction/`close`, whose done-callback closes it.
        try:
            process = RunnerProcess.start(spec, handshake_timeout=_SPARE_HANDSHAKE_TIMEOUT)
        except BaseException as exc:  # reported to a taker, who then starts its own process
            with self._lock:
                if self._spares.get(spec) is future:
                    del self._spares[spec]  # a later load retries (and reports the error itself)
            future.set_exception(exc)
            return
        future.set_result(process)

    def ready(self, spec: RunnerSpec) -> RunnerProcess | None:
        """The spare for ``spec`` if it has finished starting (for tests and diagnostics); it stays in the pool."""
        if not _poolable(spec):
            return None
        with self._lock:
            future = self._spares.get(spec)
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()

    def wait(self, spec: RunnerSpec, timeout: float) -> RunnerProcess | None:
        """Wait up to ``timeout`` for the spare of ``spec`` to be scheduled and ready; it stays in the pool."""
        if not _poolable(spec):
            return None
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                future = self._spares.get(spec)
            if future is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if future is None:
            return None
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # a failed or slow spare is simply not ready
            return None

    def close(self) -> None:
        """Close every spare (those still starting are closed when they are up); the pool stays usable."""
        with self._lock:
            futures = list(self._spares.values())
            self._spares.clear()
        for future in futures:
            future.add_done_callback(_close_done)

    def shutdown(self) -> None:
        """At interpreter exit: close every spare and start no more."""
        with self._lock:
            self._closed = True
        self.close()

    def _forget_after_fork(self) -> None:
        # The child must neither use nor close the parent's processes: start over with an empty pool.
        self._lock = threading.Lock()
        self._spares = OrderedDict()


def _close_done(future: Future[RunnerProcess]) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    _close_quietly(future.result())


_pool = SparePool()
atexit.register(_pool.shutdown)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pool._forget_after_fork)


def spare_pool() -> SparePool:
    """The process-wide pool of spare runner processes."""
    return _pool
