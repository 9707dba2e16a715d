"""`carton.load`, `carton.load_unpacked` and `Model`: a loaded model behind one or more runner processes.

A `Model` owns ``workers`` runner processes (`RunnerProcess`), all running the same model. Each call checks its
inputs against the declared specs, goes to the least busy process, and checks the outputs. A process that died (a
crash fails its in-flight calls with `RunnerCrashed`) is restarted by the next call that lands on it.

Load time: unsandboxed runner processes come from the spare pool (`_spares`: a pre-started, handshaken process per
runner when one is ready, else a new one), and `load` starts the runner while the carton is being extracted and
verified (the runner's name and version come from carton.toml, read without touching the model bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING

from carton_protocol import OptValue, RunnerSpec, Tensor, TensorSpec

from ..errors import CartonError, FormatError, ModelClosed, RunnerCrashed
from ._isolation import LaunchWrapper, RunnerLimits, SandboxPolicy, launch_wrapper
from ._process import RunnerProcess
from ._resolve import RunnerRequest, requirement_source, resolve_runner
from ._selftest import SelfTestResult, run_self_tests
from ._spares import spare_pool
from ._validate import Signature

if TYPE_CHECKING:
    from .._format import CartonInfo, ReadLimits, Verification

__all__ = ["Model", "load", "load_unpacked"]

#: Default time for a runner to load its model (framework import + model load).
DEFAULT_LOAD_TIMEOUT = 300.0
#: Default time for a started runner to answer the version handshake.
DEFAULT_HANDSHAKE_TIMEOUT = 30.0
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
        model_dir: Path,
        runner: RunnerSpec,
        opts: Mapping[str, OptValue],
        workers: int,
        wrap: LaunchWrapper | None,
        timeout: float | None,
        load_timeout: float | None,
        handshake_timeout: float,
        prestarted: Future[tuple[RunnerProcess, bool]] | None = None,
    ) -> None:
        self._info = info
        self._model_dir = model_dir
        self._runner = runner
        self._opts: Mapping[str, OptValue] = MappingProxyType(dict(opts))
        self._signature = Signature(info.inputs, info.outputs)
        self._wrap = wrap
        self._timeout = timeout
        self._load_timeout = load_timeout
        self._handshake_timeout = handshake_timeout
        self._lock = threading.Lock()
        self._closed = False
        self._workers = tuple(_Worker(i) for i in range(workers))
        self._finalizer = weakref.finalize(self, _close_workers, self._workers)
        # A process `load` started while the carton was being extracted; the first worker takes it.
        self._prestarted = prestarted if wrap is None else None
        if prestarted is not None and wrap is not None:
            prestarted.add_done_callback(_close_started)
        self._spare_due = False

    # --- public attributes ---------------------------------------------------------------------------------------
    @property
    def info(self) -> CartonInfo:
        """Everything carton.toml says (for `load_unpacked`: what was given, with the chosen runner's compat
        version)."""
        return self._info

    @property
    def runner(self) -> RunnerSpec:
        """The runner resolution chose."""
        return self._runner

    @property
    def model_dir(self) -> Path:
        """The folder the runner loads the model from."""
        return self._model_dir

    @property
    def runner_opts(self) -> Mapping[str, OptValue]:
        """The options the runner was loaded with (carton.toml's, overridden by ``runner_opts``)."""
        return self._opts

    @property
    def workers(self) -> int:
        return len(self._workers)

    @property
    def closed(self) -> bool:
        return self._closed

    # --- lifecycle -----------------------------------------------------------------------------------------------
    def _start_process(self, started: Future[tuple[RunnerProcess, bool]] | None = None) -> RunnerProcess:
        spare = False
        if started is not None:
            process, spare = started.result()
        elif self._wrap is None:
            process, spare = spare_pool().take(self._runner, handshake_timeout=self._handshake_timeout)
        else:
            process = RunnerProcess.start(
                self._runner, wrap=self._wrap, handshake_timeout=self._handshake_timeout, model_dir=self._model_dir
            )
        try:
            self._load_into(process)
        except RunnerCrashed:
            process.close()
            if not spare:
                raise
            # The spare died between the pool's liveness check and the load (killed, OOM): start a fresh one.
            process = RunnerProcess.start(self._runner, handshake_timeout=self._handshake_timeout)
            try:
                self._load_into(process)
            except BaseException:
                process.close()
                raise
        except BaseException:
            process.close()
            raise
        if self._wrap is None:
            self._schedule_spare()
        return process

    def _load_into(self, process: RunnerProcess) -> None:
        process.load(
            model_dir=self._model_dir,
            opts=self._opts,
            inputs=self._info.inputs,
            outputs=self._info.outputs,
            timeout=self._load_timeout,
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
            spare_pool().replenish(self._runner)

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
        with self._lock:
            if self._closed:
                raise ModelClosed("the model is closed")
            worker = min(self._workers, key=lambda w: w.in_flight)
            worker.in_flight += 1
            return worker

    def _release(self, worker: _Worker) -> None:
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
        name = self._info.model_name or self._model_dir.name
        state = "closed" if self._closed else f"{len(self._workers)} worker(s)"
        return f"<carton.Model {name!r} runner={self._runner.runner_name} {self._runner.framework_version} {state}>"

    # --- inference -----------------------------------------------------------------------------------------------
    def infer(
        self, inputs: Mapping[str, object] | Sequence[object], *, timeout: float | None = None
    ) -> dict[str, Tensor]:
        """Run one inference. ``inputs`` is a dict of name -> tensor, or a list in the declared input order.

        Tensors are numpy arrays (strings as ``str`` arrays) or, for nested tensors, lists of arrays. Inputs are
        checked against the declared specs before they leave the host (`InvalidInput`) and outputs after they
        return (`InvalidOutput`). Thread-safe; ``timeout`` (seconds) overrides the model's per-request limit.
        """
        tensors, bindings = self._signature.prepare_inputs(inputs)
        worker = self._acquire()
        try:
            process = self._process_for(worker)
            outputs = process.infer(tensors, timeout=self._timeout if timeout is None else timeout)
        finally:
            self._release(worker)
            if self._spare_due:
                self._replenish_spare()
        return self._signature.check_outputs(outputs, bindings)

    async def infer_async(
        self, inputs: Mapping[str, object] | Sequence[object], *, timeout: float | None = None
    ) -> dict[str, Tensor]:
        """`infer` for asyncio: the event loop is never blocked (restarts included)."""
        tensors, bindings = self._signature.prepare_inputs(inputs)
        worker = self._acquire()
        try:
            process = worker.process
            if process is None or not process.alive:
                process = await asyncio.to_thread(self._process_for, worker)
            outputs = await process.infer_async(tensors, timeout=self._timeout if timeout is None else timeout)
        finally:
            self._release(worker)
            if self._spare_due:
                self._replenish_spare()
        return self._signature.check_outputs(outputs, bindings)

    def run_self_tests(self) -> tuple[SelfTestResult, ...]:
        """Run carton.toml's ``[[self_test]]`` entries; floats compare with allclose, everything else exactly.

        Failures (wrong outputs or errors) are reported in the results, not raised.
        """
        return run_self_tests(self, self._info.self_tests)


# --- constructors ------------------------------------------------------------------------------------------------


def _check_workers(workers: int) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    return workers


def _merge_opts(declared: Mapping[str, OptValue], overrides: Mapping[str, OptValue] | None) -> dict[str, OptValue]:
    merged = dict(declared)
    if overrides:
        for key in overrides:
            if not isinstance(key, str):
                raise TypeError(f"runner_opts keys must be strings, got {type(key).__name__} {key!r}")
        merged.update(overrides)
    return merged


def _timeouts(limits: RunnerLimits | None, timeout: float | None) -> float | None:
    if timeout is not None:
        return timeout
    return limits.request_seconds if limits is not None else None


def _replenish_later(model: weakref.ref[Model]) -> None:
    target = model()
    if target is not None:
        target._replenish_spare()


def _close_started(future: Future[tuple[RunnerProcess, bool]]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result()[0].close()


def _unsandboxed(sandbox: SandboxPolicy | str | None, limits: RunnerLimits | None) -> bool:
    """Whether runner processes start unwrapped (what `launch_wrapper` returns ``None`` for): they may then be
    started before the model folder is known."""
    try:
        policy = SandboxPolicy(sandbox) if sandbox is not None else SandboxPolicy.NONE
    except ValueError:
        return False  # launch_wrapper reports the bad policy
    return policy is SandboxPolicy.NONE and (limits is None or not limits.needs_sandbox())


def _start_in_background(runner: RunnerSpec, handshake_timeout: float) -> Future[tuple[RunnerProcess, bool]]:
    """Take a spare (or start a runner) on a helper thread; the caller collects ``(process, was a spare)`` with
    ``result()``."""
    future: Future[tuple[RunnerProcess, bool]] = Future()

    def start() -> None:
        try:
            taken = spare_pool().take(runner, handshake_timeout=handshake_timeout)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(taken)

    threading.Thread(target=start, name="carton-prestart", daemon=True).start()
    return future


def _open(
    *,
    info: CartonInfo,
    model_dir: Path,
    runner: RunnerSpec,
    opts: dict[str, OptValue],
    workers: int,
    sandbox: SandboxPolicy | str | None,
    limits: RunnerLimits | None,
    timeout: float | None,
    load_timeout: float | None,
    handshake_timeout: float,
    prestarted: Future[tuple[RunnerProcess, bool]] | None = None,
    verification: Verification | None = None,
) -> Model:
    """Start the model's runners; with a ``verification`` still running, return or raise only after it ends."""
    try:
        wrap = launch_wrapper(sandbox, limits, model_dir=model_dir)
        model = Model(
            info=info,
            model_dir=model_dir,
            runner=runner,
            opts=opts,
            workers=workers,
            wrap=wrap,
            timeout=_timeouts(limits, timeout),
            load_timeout=load_timeout,
            handshake_timeout=handshake_timeout,
            prestarted=prestarted,
        )
    except BaseException as exc:
        if prestarted is not None:
            prestarted.add_done_callback(_close_started)
        _raise_if_unverified(verification, exc)
        raise
    try:
        model._start_all()
    except BaseException as exc:
        _raise_if_unverified(verification, exc)
        raise
    if verification is not None:
        try:
            verification.wait()
        except BaseException:
            model.close()
            raise
    return model


def _raise_if_unverified(verification: Verification | None, load_error: BaseException) -> None:
    """A load that failed on files still being verified: a failed verification is the error to report (the
    runner read bytes that do not match MANIFEST), with the runner's failure as a note."""
    if verification is None:
        return
    try:
        verification.wait()
    except CartonError as bad:
        bad.add_note(f"while the model's files were being verified, its runner failed: {load_error}")
        raise bad from None


def load(
    path_or_url: str | Path,
    *,
    runner_opts: Mapping[str, OptValue] | None = None,
    override_runner_name: str | None = None,
    override_required_framework_version: str | None = None,
    workers: int = 1,
    sandbox: SandboxPolicy | str | None = None,
    limits: RunnerLimits | None = None,
    timeout: float | None = None,
    load_timeout: float | None = DEFAULT_LOAD_TIMEOUT,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    read_limits: ReadLimits | None = None,
) -> Model:
    """Load a carton (a ``.carton`` file, an unpacked carton folder, or an http(s) URL) and start its runner.

    The runner is resolved from carton.toml's ``[runner]`` (or the overrides: with ``override_runner_name`` the
    model's ``runner_compat_version`` is not enforced, since it belongs to the original runner). ``runner_opts``
    override carton.toml's options key by key. ``workers`` runner processes serve the model; ``timeout`` is the
    default per-request limit in seconds (``None``: no limit, or ``limits.request_seconds``). ``sandbox`` and
    ``limits`` choose the isolation of the runner processes (see docs/sandbox.md); a carton loaded from an
    http(s) URL defaults to ``sandbox="best_effort"``, any other to ``"none"``. ``read_limits`` caps reading the
    package (total uncompressed size, compression ratio, ...: `carton.ReadLimits`, docs/format.md).
    """
    from .._format import get_model_info, open_carton

    workers = _check_workers(workers)
    is_url = str(path_or_url).startswith(("http://", "https://"))
    if sandbox is None and is_url:
        sandbox = SandboxPolicy.BEST_EFFORT  # a carton from a URL is untrusted unless the caller says otherwise
    where = requirement_source(path_or_url, override_required_framework_version)

    def request_for(info: CartonInfo) -> RunnerRequest:
        return RunnerRequest.for_carton(
            info,
            override_runner_name=override_runner_name,
            override_required_framework_version=override_required_framework_version,
        )

    # Overlap: carton.toml names the runner without the model bytes being read, so an unsandboxed runner starts
    # (interpreter, imports, framework) while open_carton extracts and verifies the model.
    early: RunnerRequest | None = None
    early_runner: RunnerSpec | None = None
    prestarted: Future[tuple[RunnerProcess, bool]] | None = None
    verification: Verification | None = None
    if not is_url and _unsandboxed(sandbox, limits):
        with contextlib.suppress(CartonError):  # open_carton below reports a bad carton with its own error
            early = request_for(get_model_info(path_or_url, limits=read_limits))
            early_runner = resolve_runner(early, where=where)
            prestarted = _start_in_background(early_runner, handshake_timeout)
    try:
        # The runner reads the model folder while its files are hashed; `_open` returns or raises only after
        # the verification has ended (docs/format.md, "Verification while loading").
        opened = open_carton(path_or_url, limits=read_limits, defer_verification=True)
        verification = opened.verification
        info = opened.info
        request = request_for(info)
        if prestarted is not None and early_runner is not None and request == early:
            runner = early_runner
        else:
            if prestarted is not None:  # the file changed between the two reads
                prestarted.add_done_callback(_close_started)
                prestarted = None
            runner = resolve_runner(request, where=where)
        opts = _merge_opts(info.runner.opts, runner_opts)
    except BaseException as exc:
        if prestarted is not None:
            prestarted.add_done_callback(_close_started)
        if verification is not None:
            _raise_if_unverified(verification, exc)
        raise
    return _open(
        info=info,
        model_dir=Path(opened.model_dir),
        runner=runner,
        opts=opts,
        workers=workers,
        sandbox=sandbox,
        limits=limits,
        timeout=timeout,
        load_timeout=load_timeout,
        handshake_timeout=handshake_timeout,
        prestarted=prestarted,
        verification=verification,
    )


def load_unpacked(
    model_dir: str | Path,
    *,
    runner_name: str,
    required_framework_version: str,
    runner_compat_version: int | None = None,
    inputs: Sequence[TensorSpec] | None = None,
    outputs: Sequence[TensorSpec] | None = None,
    runner_opts: Mapping[str, OptValue] | None = None,
    required_platforms: Sequence[str] = (),
    model_name: str | None = None,
    workers: int = 1,
    sandbox: SandboxPolicy | str | None = None,
    limits: RunnerLimits | None = None,
    timeout: float | None = None,
    load_timeout: float | None = DEFAULT_LOAD_TIMEOUT,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
) -> Model:
    """Load a model folder (what would be a carton's ``model/``) without packing it.

    Only the runner name and framework requirement are needed. ``inputs``/``outputs`` (`carton.TensorSpec`),
    when given, are checked on every call exactly as a packed carton's. ``runner_compat_version=None`` accepts
    any compat version (the highest wins).
    """
    from .._format import CartonInfo, RunnerInfo

    workers = _check_workers(workers)
    folder = Path(model_dir)
    if not folder.is_dir():
        raise FormatError(f"model folder {folder} does not exist or is not a directory")
    folder = folder.resolve()
    specs_in, specs_out = tuple(inputs or ()), tuple(outputs or ())
    for spec in (*specs_in, *specs_out):
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"inputs/outputs must be carton.TensorSpec, got {type(spec).__name__}")
    request = RunnerRequest(
        runner_name=runner_name,
        required_framework_version=required_framework_version,
        runner_compat_version=runner_compat_version,
        required_platforms=tuple(required_platforms),
    )
    opts = _merge_opts({}, runner_opts)
    runner = resolve_runner(request, where="load_unpacked(required_framework_version=...)")
    info = CartonInfo(
        spec_version=1,
        model_name=model_name,
        required_platforms=tuple(required_platforms),
        inputs=specs_in,
        outputs=specs_out,
        runner=RunnerInfo(
            runner_name=runner_name,
            required_framework_version=required_framework_version,
            runner_compat_version=runner.runner_compat_version
            if runner_compat_version is None
            else runner_compat_version,
            opts=MappingProxyType(dict(opts)),
        ),
        manifest_sha256="",
    )
    return _open(
        info=info,
        model_dir=folder,
        runner=runner,
        opts=opts,
        workers=workers,
        sandbox=sandbox,
        limits=limits,
        timeout=timeout,
        load_timeout=load_timeout,
        handshake_timeout=handshake_timeout,
    )
