"""`Model`: a loaded model behind one or more runner processes (`carton.load` makes one: `carton._workflows`).

A `Model` owns ``workers`` runner processes (`RunnerProcess`), all running the same model, started as its
`LoadSettings` say. Each call checks its inputs against the declared specs, goes to the least busy process, and
checks the outputs. A process that died (a crash fails its in-flight calls with `RunnerCrashed`) is restarted by the
next call that lands on it.

Unsandboxed runner processes come from the spare pool (`_spares`: a pre-started, handshaken process per runner when
one is ready, else a new one); the first one may have been started by the load itself while the carton was being
extracted (``prestarted``).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING

from carton_protocol import OptValue, RunnerSpec, Tensor

from ..errors import ModelClosed, RunnerCrashed
from ._connection import NotSent
from ._process import RunnerProcess, release_lent
from ._selftest import SelfTestResult, run_self_tests
from ._settings import LoadSettings
from ._spares import spare_pool
from ._validate import Signature

if TYPE_CHECKING:
    from .._format import CartonInfo

__all__ = ["SPARE_START_DELAY", "Model", "close_started"]

#: A spare runner for the next load starts after the model's first call returns, or this many seconds after the
#: load when no call comes first: its start-up (an interpreter and a framework import) then does not compete with
#: the first inference for the CPU.
SPARE_START_DELAY = 1.0


class _Worker:
    """One slot of a model: its current process (``None`` until started or after a failed restart)."""

    __slots__ = ("in_flight", "index", "process", "restart_lock")

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: RunnerProcess | None = None
        self.in_flight = 0
        self.restart_lock = threading.Lock()


def _in_flight(worker: _Worker) -> int:
    return worker.in_flight


def _close_workers(workers: Sequence[_Worker], timeout: float = 5.0) -> None:
    """Close every worker's process, all at once: each may wait ``timeout`` for a graceful exit before a kill."""
    processes = [w.process for w in workers if w.process is not None]
    if len(processes) == 1:
        processes[0].close(timeout)
        return
    threads = [threading.Thread(target=p.close, args=(timeout,), name="carton-close") for p in processes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


class Model:
    """A loaded model. Use `carton.load` or `carton.load_unpacked` to make one; close it (or use ``with``)."""

    def __init__(
        self,
        *,
        info: CartonInfo,
        settings: LoadSettings,
        prestarted: Future[tuple[RunnerProcess, bool]] | None = None,
    ) -> None:
        self._info = info
        self._settings = settings
        self._opts: Mapping[str, OptValue] = MappingProxyType(dict(settings.opts))
        self._signature = Signature(info.inputs, info.outputs)
        self._lock = threading.Lock()
        self._closed = False
        self._workers = tuple(_Worker(i) for i in range(settings.workers))
        self._balanced = len(self._workers) > 1  # calls counted in and out per worker, to pick the least busy
        # A one-worker model's calls take its worker without a call to `_acquire` (nothing to balance).
        self._only = None if self._balanced else self._workers[0]
        self._finalizer = weakref.finalize(self, _close_workers, self._workers)
        # A process `load` started while the carton was being extracted; the first worker takes it.
        self._prestarted = prestarted if settings.wrap is None else None
        if prestarted is not None and settings.wrap is not None:
            prestarted.add_done_callback(close_started)
        self._spare_due = False

    @classmethod
    def start(
        cls,
        *,
        info: CartonInfo,
        settings: LoadSettings,
        prestarted: Future[tuple[RunnerProcess, bool]] | None = None,
    ) -> Model:
        """A model whose every worker's runner process is started and loaded (in parallel when there are several);
        on any failure they are all closed and the error is raised."""
        model = cls(info=info, settings=settings, prestarted=prestarted)
        model._start_all()
        return model

    # --- public attributes ---------------------------------------------------------------------------------------
    @property
    def info(self) -> CartonInfo:
        """Everything carton.toml says (for `load_unpacked`: what was given, with the chosen runner's compat
        version)."""
        return self._info

    @property
    def runner(self) -> RunnerSpec:
        """The runner resolution chose."""
        return self._settings.runner

    @property
    def model_dir(self) -> Path:
        """The folder the runner loads the model from."""
        return self._settings.model_dir

    @property
    def settings(self) -> LoadSettings:
        """How this model's runner processes are started and called (timeouts, sandbox, options)."""
        return self._settings

    @property
    def runner_opts(self) -> Mapping[str, OptValue]:
        """The options the runner was loaded with (carton.toml's, overridden by ``runner_opts``)."""
        return self._opts

    @property
    def workers(self) -> int:
        """How many runner processes serve this model."""
        return len(self._workers)

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    # --- lifecycle -----------------------------------------------------------------------------------------------
    def _start_process(self, started: Future[tuple[RunnerProcess, bool]] | None = None) -> RunnerProcess:
        settings = self._settings
        spare = False
        if started is not None:
            process, spare = started.result()
        elif settings.wrap is None:
            process, spare = spare_pool().take(settings.runner, handshake_timeout=settings.handshake_timeout)
        else:
            process = RunnerProcess.start(
                settings.runner,
                wrap=settings.wrap,
                handshake_timeout=settings.handshake_timeout,
                model_dir=settings.model_dir,
            )
        try:
            self._load_into(process)
        except RunnerCrashed:
            process.close()
            if not spare:
                raise
            # The spare died between the pool's liveness check and the load (killed, OOM): start a fresh one.
            process = RunnerProcess.start(settings.runner, handshake_timeout=settings.handshake_timeout)
            try:
                self._load_into(process)
            except BaseException:
                process.close()
                raise
        except BaseException:
            process.close()
            raise
        if settings.wrap is None:
            self._schedule_spare()
        return process

    def _load_into(self, process: RunnerProcess) -> None:
        process.load(
            model_dir=self._settings.model_dir,
            opts=self._opts,
            inputs=self._info.inputs,
            outputs=self._info.outputs,
            timeout=self._settings.load_timeout,
        )

    def _schedule_spare(self) -> None:
        """Have the spare pool start a runner like this one after the next call returns (or after a delay)."""
        self._spare_due = True
        timer = threading.Timer(SPARE_START_DELAY, _replenish_later, args=(weakref.ref(self),))
        timer.daemon = True
        timer.start()

    def _replenish_spare(self) -> None:
        with self._lock:
            due, self._spare_due = self._spare_due, False
        if due and not self._closed:
            spare_pool().replenish(self._settings.runner)

    def _start_all(self) -> None:
        """Start every worker (in parallel when there are several); on any failure close them all and raise."""
        started, self._prestarted = self._prestarted, None
        if len(self._workers) == 1:
            self._workers[0].process = self._start_process(started)
            return
        with ThreadPoolExecutor(max_workers=len(self._workers), thread_name_prefix="carton-start") as pool:
            futures = [pool.submit(self._start_process, started if i == 0 else None) for i in range(len(self._workers))]
            errors: list[BaseException] = []
            for worker, future in zip(self._workers, futures, strict=True):
                try:
                    worker.process = future.result()
                except BaseException as exc:
                    errors.append(exc)
        if errors:
            _close_workers(self._workers)
            raise errors[0]

    def _acquire(self) -> _Worker:
        workers = self._workers
        if len(workers) == 1:
            # Nothing to balance: no count to keep, so no lock to take (`close` only ever sets `_closed`).
            if self._closed:
                raise ModelClosed("the model is closed")
            return workers[0]
        with self._lock:
            if self._closed:
                raise ModelClosed("the model is closed")
            worker = min(workers, key=_in_flight)
            worker.in_flight += 1
            return worker

    def _release(self, worker: _Worker) -> None:
        """Count a call `_acquire` let in out again (only several workers keep counts: `_balanced`)."""
        with self._lock:
            worker.in_flight -= 1

    def _process_for(self, worker: _Worker) -> RunnerProcess:
        """The worker's live process, restarting it if it died (one restart at a time per worker)."""
        process = worker.process
        if process is not None and process.alive:
            return process
        with worker.restart_lock:
            process = worker.process
            if process is not None and process.alive:
                return process
            if self._closed:
                raise ModelClosed("the model is closed")
            if process is not None:
                process.close()
                worker.process = None
            fresh = self._start_process()
            with self._lock:
                closed = self._closed
                if not closed:
                    worker.process = fresh
            if closed:  # close() ran while this process was starting: it must not outlive the model
                fresh.close()
                raise ModelClosed("the model was closed while its runner restarted")
            return fresh

    def close(self, timeout: float = 5.0) -> None:
        """Stop every runner process of this model; idempotent. Calls in flight fail with `ModelClosed`.

        Each runner gets ``timeout`` seconds to finish its requests and exit before its process tree is killed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer.detach()
        _close_workers(self._workers, timeout)

    def __enter__(self) -> Model:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        # Ctrl-C means now: a runner busy with the interrupted request would only answer close when done with it.
        self.close(timeout=0.0 if exc_type is not None and issubclass(exc_type, KeyboardInterrupt) else 5.0)

    def __repr__(self) -> str:
        name = self._info.model_name or self._settings.model_dir.name
        state = "closed" if self._closed else f"{len(self._workers)} worker(s)"
        runner = self._settings.runner
        return f"<carton.Model {name!r} runner={runner.runner_name} {runner.framework_version} {state}>"

    # --- inference -----------------------------------------------------------------------------------------------
    def infer(
        self, inputs: Mapping[str, object] | Sequence[object], *, timeout: float | None = None
    ) -> dict[str, Tensor]:
        """Run one inference. ``inputs`` is a dict of name -> tensor, or a list in the declared input order.

        Tensors are numpy arrays (strings as ``str`` arrays) or, for nested tensors, lists of arrays. Inputs are
        checked against the declared specs before they leave the host (`InvalidInput`) and outputs after they
        return (`InvalidOutput`). Thread-safe; ``timeout`` (seconds) overrides the model's per-request limit
        (`LoadSettings.request_timeout`).
        """
        tensors, checked = self._signature.prepare_inputs(inputs)
        worker = self._only
        if worker is None or self._closed:
            worker = self._acquire()
        try:
            process = worker.process
            if process is None or not process.alive:
                process = self._process_for(worker)
            outputs, reply_layout = process.infer_with_layouts(
                tensors,
                timeout=self._settings.request_timeout if timeout is None else timeout,
                layout_key=checked.layout_key,
            )
        finally:
            if self._balanced:
                self._release(worker)
            if self._spare_due:
                self._replenish_spare()
        return self._signature.check_outputs(outputs, checked, reply_layout)

    async def infer_async(
        self, inputs: Mapping[str, object] | Sequence[object], *, timeout: float | None = None
    ) -> dict[str, Tensor]:
        """`infer` for asyncio: the event loop is never blocked (restarts included)."""
        return await self._infer_async(inputs, timeout, None)

    async def infer_async_lent(
        self, inputs: Mapping[str, object] | Sequence[object], *, timeout: float | None = None
    ) -> tuple[dict[str, Tensor], Callable[[], None] | None]:
        """`infer_async` for a caller that is done with the outputs soon and says when (a server writing them out).
        Outputs the runner placed in shared memory (large ones) are lent, as read-only views of that memory instead
        of copies; the second item, when not None, gives them back: call it once, when nothing reads those arrays
        any more (the runner may then overwrite them). Until then the runner writes later outputs elsewhere.

            outputs, release = await model.infer_async_lent(inputs)
            try:
                send(outputs)
            finally:
                if release is not None:
                    release()
        """
        lent: list[Callable[[], None]] = []
        outputs = await self._infer_async(inputs, timeout, lent)
        if not lent:
            return outputs, None
        return outputs, functools.partial(release_lent, lent)

    async def _infer_async(
        self,
        inputs: Mapping[str, object] | Sequence[object],
        timeout: float | None = None,
        lent: list[Callable[[], None]] | None = None,
    ) -> dict[str, Tensor]:
        """`infer_async`, and with `lent` `infer_async_lent` (what it lends is given back here if the call fails).
        Called as ``_infer_async(inputs)`` it is `infer_async` without the coroutine in front of it: the server's
        model handle calls it so (`carton.server._handle`)."""
        tensors, checked = self._signature.prepare_inputs(inputs)
        worker = self._only
        if worker is None or self._closed:
            worker = self._acquire()
        try:
            process = worker.process
            if process is None:
                process = await asyncio.to_thread(self._process_for, worker)
            limit = self._settings.request_timeout if timeout is None else timeout
            try:
                # The liveness check is the send's own: it reads the runner's pidfd in the poll it makes anyway.
                # The process's call in its steps (`RunnerProcess.infer_async_with_layouts` says what each does),
                # awaited here: no coroutine of the process's between this one and the reply's future.
                started = process.start_infer_async(tensors, limit, checked.layout_key, True)
                if started is None:
                    outputs, reply_layout = await process.infer_async_with_layouts(
                        tensors, timeout=limit, layout_key=checked.layout_key, unsent=True, lent=lent
                    )
            except NotSent:
                # The runner had exited (or was closed) before the request left: restart it and send it once more.
                process = await asyncio.to_thread(self._process_for, worker)
                started = None
                outputs, reply_layout = await process.infer_async_with_layouts(
                    tensors, timeout=limit, layout_key=checked.layout_key, lent=lent
                )
            if started is not None:
                try:
                    answer = await started[2]
                except BaseException as exc:
                    await process.fail_infer_async(started, exc, limit)
                    raise  # (`fail_infer_async` always raises)
                outputs, reply_layout = process.finish_infer_async(started, answer, lent, limit)
            return self._signature.check_outputs(outputs, checked, reply_layout)
        except BaseException:
            if lent is not None:
                release_lent(lent)
            raise
        finally:
            if self._balanced:
                self._release(worker)
            if self._spare_due:
                self._replenish_spare()

    def run_self_tests(self) -> tuple[SelfTestResult, ...]:
        """Run carton.toml's ``[[self_test]]`` entries; floats compare with allclose, everything else exactly.

        Failures (wrong outputs or errors) are reported in the results, not raised.
        """
        return run_self_tests(self, self._info.self_tests)


def _replenish_later(model: weakref.ref[Model]) -> None:
    target = model()
    if target is not None:
        target._replenish_spare()


def close_started(future: Future[tuple[RunnerProcess, bool]]) -> None:
    """A done-callback for a runner started ahead of time that nobody will use: close it once it is up."""
    if not future.cancelled() and future.exception() is None:
        future.result()[0].close()
