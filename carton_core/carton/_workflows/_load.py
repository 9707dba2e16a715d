"""`carton.load` and `carton.load_unpacked`: from a carton (or a model folder) to a started `Model`.

The pipeline: read carton.toml (once), resolve the runner, and start it at once when it runs unsandboxed, while the
carton is extracted and verified (`_format.open_carton`); then choose the sandbox (`_sandbox.launch_wrapper`), fix
everything about the runner processes in one `LoadSettings`, start the model's workers, and return only after the
model files are verified (docs/format.md, "Verification while loading").
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import MappingProxyType

from carton_protocol import OptValue, RunnerSpec, TensorSpec

from .._format import CartonInfo, ReadLimits, RunnerInfo, Verification, open_carton
from .._runtime import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_LOAD_TIMEOUT,
    LoadSettings,
    Model,
    RunnerLimits,
    RunnerProcess,
    RunnerRequest,
    SandboxPolicy,
    check_limits,
    close_started,
    requirement_source,
    resolve_runner,
    sandbox_policy,
    spare_pool,
)
from .._runtime._launch import LaunchWrapper
from .._sandbox import launch_wrapper
from ..errors import CartonError, FormatError

__all__ = ["Prestarted", "load", "load_unpacked"]

Prestarted = Future[tuple[RunnerProcess, bool]]


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
    workers = _check_workers(workers)
    is_url = str(path_or_url).startswith(("http://", "https://"))
    if sandbox is None and is_url:
        sandbox = SandboxPolicy.BEST_EFFORT  # a carton from a URL is untrusted unless the caller says otherwise
    early = _EarlyStart(
        where=requirement_source(path_or_url, override_required_framework_version),
        override_runner_name=override_runner_name,
        override_required_framework_version=override_required_framework_version,
        start=not is_url and _unsandboxed(sandbox, limits),
        handshake_timeout=handshake_timeout,
    )
    verification: Verification | None = None
    try:
        # The runner reads the model folder while its files are hashed; `_open` returns or raises only after
        # the verification has ended.
        opened = open_carton(path_or_url, limits=read_limits, defer_verification=True, on_info=early.resolve)
        verification = opened.verification
        runner = early.runner()
        model_dir = Path(opened.model_dir)
        settings = LoadSettings(
            model_dir=model_dir,
            runner=runner,
            opts=_merge_opts(opened.info.runner.opts, runner_opts),
            workers=workers,
            wrap=_launch_wrapper(sandbox, limits, model_dir),
            request_timeout=_request_timeout(timeout, limits),
            load_timeout=load_timeout,
            handshake_timeout=handshake_timeout,
        )
    except BaseException as exc:
        early.abandon()
        _raise_if_unverified(verification, exc)
        raise
    return _open(opened.info, settings, prestarted=early.prestarted, verification=verification)


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
            runner_compat_version=runner.runner_compat_version if runner_compat_version is None
            else runner_compat_version,
            opts=opts,
        ),
        manifest_sha256="",
    )  # fmt: skip
    settings = LoadSettings(
        model_dir=folder,
        runner=runner,
        opts=opts,
        workers=workers,
        wrap=_launch_wrapper(sandbox, limits, folder),
        request_timeout=_request_timeout(timeout, limits),
        load_timeout=load_timeout,
        handshake_timeout=handshake_timeout,
    )
    return _open(info, settings)


class _EarlyStart:
    """Resolves the runner from carton.toml as soon as `open_carton` has read it, and starts an unsandboxed one on
    a helper thread (a spare if one is ready) while the carton is extracted and verified."""

    def __init__(
        self,
        *,
        where: str,
        override_runner_name: str | None,
        override_required_framework_version: str | None,
        start: bool,
        handshake_timeout: float,
    ) -> None:
        self._where = where
        self._override_runner_name = override_runner_name
        self._override_required_framework_version = override_required_framework_version
        self._start = start
        self._handshake_timeout = handshake_timeout
        self._runner: RunnerSpec | None = None
        self._error: CartonError | None = None
        self.prestarted: Prestarted | None = None

    def resolve(self, info: CartonInfo) -> None:
        request = RunnerRequest.for_carton(
            info,
            override_runner_name=self._override_runner_name,
            override_required_framework_version=self._override_required_framework_version,
        )
        try:
            self._runner = resolve_runner(request, where=self._where)
        except CartonError as exc:
            # Raised once the carton is open: a carton whose bytes are bad reports that first (`_raise_if_unverified`).
            self._error = exc
            return
        if self._start:
            self.prestarted = _start_in_background(self._runner, self._handshake_timeout)

    def runner(self) -> RunnerSpec:
        """The resolved runner, or the resolution's error."""
        if self._error is not None:
            raise self._error
        if self._runner is None:
            raise FormatError("the carton's info was never read")  # open_carton always reads it first
        return self._runner

    def abandon(self) -> None:
        """The load failed: a runner started for it is closed once it is up."""
        prestarted, self.prestarted = self.prestarted, None
        if prestarted is not None:
            prestarted.add_done_callback(close_started)


def _start_in_background(runner: RunnerSpec, handshake_timeout: float) -> Prestarted:
    return spare_pool().take_later(runner, handshake_timeout=handshake_timeout)


def _open(
    info: CartonInfo,
    settings: LoadSettings,
    *,
    prestarted: Prestarted | None = None,
    verification: Verification | None = None,
) -> Model:
    """Start the model's runners; with a ``verification`` still running, return or raise only after it ends."""
    try:
        model = Model.start(info=info, settings=settings, prestarted=prestarted)
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


def _check_workers(workers: int) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    return workers


def _merge_opts(declared: Mapping[str, OptValue], overrides: Mapping[str, OptValue] | None) -> Mapping[str, OptValue]:
    merged = dict(declared)
    if overrides:
        for key in overrides:
            if not isinstance(key, str):
                raise TypeError(f"runner_opts keys must be strings, got {type(key).__name__} {key!r}")
        merged.update(overrides)
    return MappingProxyType(merged)


def _request_timeout(timeout: float | None, limits: RunnerLimits | None) -> float | None:
    """The one default limit of every call: the ``timeout`` argument, else the limits' ``request_seconds``."""
    if timeout is not None:
        return timeout
    return limits.request_seconds if limits is not None else None


def _unsandboxed(sandbox: SandboxPolicy | str | None, limits: RunnerLimits | None) -> bool:
    """Whether runner processes start unwrapped (what `launch_wrapper` returns ``None`` for): they may then be
    started before the model folder is known."""
    try:
        policy = sandbox_policy(sandbox)
    except ValueError:
        return False  # _launch_wrapper reports the bad policy
    return policy is SandboxPolicy.NONE and (limits is None or not limits.needs_sandbox())


def _launch_wrapper(
    sandbox: SandboxPolicy | str | None, limits: RunnerLimits | None, model_dir: str | os.PathLike[str]
) -> LaunchWrapper | None:
    """The sandbox's ``wrap`` for every runner process of the model (``None``: run them unwrapped)."""
    return launch_wrapper(sandbox_policy(sandbox), check_limits(limits), model_dir=Path(model_dir))
