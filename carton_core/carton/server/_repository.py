"""The model repository at run time: which versions are served, their states, loads, unloads and in-flight requests.

States and reasons are reported as Triton reports them (``READY``, ``LOADING``, ``UNLOADING``, ``UNAVAILABLE`` with
a reason such as ``unloaded`` or the load error). Concurrency rules:

- Loads and unloads of one model are serialized by that model's lock; different models load in parallel.
- A (re)load builds the new versions while the old ones keep serving, then swaps them in one step; old versions
  are retired: no new request reaches them, in-flight ones complete, then their runners are closed.
- A request holds its version from lookup to response (`ServedVersion.enter`/`exit`), so an unload never closes a
  model under a running request; after an unload, lookups fail with `ModelNotFound` (404).
- A load never hangs: the loader runs in a thread under ``load_timeout``; on timeout the version is reported
  ``UNAVAILABLE`` with the reason, and whatever the loader eventually returns is closed.
- Server readiness is false while any load or unload is in progress; with ``strict_readiness`` (Triton's
  ``--strict-readiness``) also while any model that was asked for is not ``READY``, unless it was unloaded.
- A load that fails before any version is chosen (a bad ``config.json``, no version folder) is reported for the
  model as a whole: ``UNAVAILABLE`` with the reason, and no version.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from carton_protocol import Tensor, TensorSpec

from ..errors import CartonError
from ._batcher import DynamicBatcher
from ._config import ModelConfig, parse_config
from ._handle import LendingInfer, LoadSpec, ModelHandle, ModelLoader
from ._layout import Scrubber, list_models, scan_model_folder, scan_versions, validate_model_name, write_upload
from ._stats import ServerMetrics, VersionStats
from .errors import BadRequest, ModelNotFound, RepositoryError, ServerError, UploadDisabled

__all__ = ["ModelRepository", "ModelState", "RepositoryOptions", "ServedVersion"]

_log = logging.getLogger("carton.server")


class ModelState(enum.StrEnum):
    """A model version's state, as the repository index reports it."""

    READY = "READY"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True, slots=True, kw_only=True)
class RepositoryOptions:
    """How the repository loads models (`carton serve` fills these from its flags)."""

    workers: int = 1
    sandbox: str | None = None
    upload_sandbox: str | None = "best_effort"
    allow_upload: bool = True
    explicit: bool = True
    load_timeout: float = 300.0
    unload_timeout: float = 60.0
    #: Triton's ``--strict-readiness``: the server is not ready while a model that was asked for failed to load.
    strict_readiness: bool = False


#: The reason of a version (or model) that is unavailable because it was unloaded, as Triton words it.
_UNLOADED = "unloaded"


class ServedVersion:
    """One loaded model version: the handle, its config, its counters and its in-flight requests."""

    __slots__ = (
        "_drained", "batcher", "config", "direct", "form_places", "handle", "in_flight", "input_plans", "input_specs",
        "last_plan", "lending", "model", "output_specs", "request_plans", "response_heads", "state", "stats",
        "version", "version_str",
    )  # fmt: skip

    def __init__(self, *, model: str, version: int, handle: ModelHandle, config: ModelConfig, stats: VersionStats):
        self.model = model
        self.version = version
        self.version_str = str(version)
        self.handle = handle
        self.config = config
        self.input_specs: dict[str, TensorSpec] = {spec.name: spec for spec in handle.inputs}
        self.output_specs: tuple[TensorSpec, ...] = tuple(handle.outputs)
        self.state = ModelState.READY
        self.stats = stats
        self.in_flight = 0
        #: What `retire` waits on while requests are in flight, set by the last one's `exit`: made only then, so that
        #: a request does not clear and set an event of its own.
        self._drained: asyncio.Future[None] | None = None
        self.batcher: DynamicBatcher | None = None
        #: The handle's `infer`, for a caller that runs every request as an execution of its own (batch size 1); the
        #: request's end (`_inference.request_succeeded` or `request_failed`) counts the execution with it. None
        #: when the model batches, and every request must go through `infer`.
        self.direct = handle.infer if config.max_batch_size == 0 else None
        #: `direct` lending its large outputs (the handle's ``infer_lent``), when the handle has it.
        self.lending: LendingInfer | None = getattr(handle, "infer_lent", None) if self.direct is not None else None
        #: Binary inference headers already checked against this version, by their bytes (see ``_http_codec``).
        self.request_plans: dict[bytes, Any] = {}
        #: The header of the last request decoded from one of those, and its plan.
        self.last_plan: tuple[bytes, Any] | None = None
        #: gRPC raw inputs already checked against this version, by their names, datatypes and shapes (see ``_grpc``).
        self.input_plans: dict[tuple[Any, ...], Any] = {}
        #: Where each learnt gRPC request form's inputs lie, by the form (by identity), once checked against this
        #: version's input plan and declared outputs (see ``_grpc``).
        self.form_places: dict[Any, Any] = {}
        #: JSON headers of all-binary inference responses, by the request's id and the outputs' layouts.
        self.response_heads: dict[tuple[Any, ...], bytes] = {}
        batching = config.dynamic_batching
        if batching is not None:
            self.batcher = DynamicBatcher(
                run=handle.infer,
                max_batch_size=config.max_batch_size,
                max_queue_delay_us=batching.max_queue_delay_microseconds,
                preferred_batch_sizes=batching.preferred_batch_sizes,
                concurrency=config.instance_count or 1,
                stats=stats,
            )

    def enter(self) -> None:
        """A request starts using this version (an unload waits for it to `exit`)."""
        self.in_flight += 1
        self.stats.series.in_flight += 1

    def exit(self) -> None:
        """A request is done with this version."""
        self.in_flight -= 1
        self.stats.series.in_flight -= 1
        if self.in_flight == 0:
            drained = self._drained
            if drained is not None and not drained.done():
                drained.set_result(None)

    def _batch_size(self, inputs: Mapping[str, np.ndarray]) -> int:
        sizes = set()
        for name, array in inputs.items():
            if array.ndim == 0:
                raise BadRequest(f"input {name!r}: the model batches (max_batch_size > 0) but the input is a scalar")
            sizes.add(array.shape[0])
        if len(sizes) > 1:
            raise BadRequest(f"inputs disagree on the batch size (first dimension): {sorted(sizes)}")
        batch = sizes.pop() if sizes else 1
        if batch > self.config.max_batch_size:
            raise BadRequest(
                f"batch size {batch} is larger than the model's max_batch_size {self.config.max_batch_size}"
            )
        return batch

    async def infer(self, inputs: dict[str, np.ndarray]) -> tuple[Mapping[str, Tensor], int]:
        """Run the model (through the batcher when configured); returns the outputs and the queue time in ns."""
        if self.config.max_batch_size > 0:
            batch = self._batch_size(inputs)
            if self.batcher is not None:
                return await self.batcher.submit(inputs, batch)
            size = batch
        else:
            size = 1
        started = time.perf_counter_ns()
        outputs = await self.handle.infer(inputs)
        self.stats.record_execution(batch_size=size, infer_ns=time.perf_counter_ns() - started)
        return outputs, 0

    async def retire(self, timeout: float) -> None:
        """Let in-flight requests finish (up to `timeout`), then close the runner."""
        self.state = ModelState.UNLOADING
        try:
            if self.in_flight:
                drained = self._drained
                if drained is None or drained.done():
                    drained = self._drained = asyncio.get_running_loop().create_future()
                # Shielded: another retirement may wait on the same future.
                await asyncio.wait_for(asyncio.shield(drained), timeout)
        except TimeoutError:
            _log.warning(
                "model %r version %s: %d requests still running after %.0fs; closing it under them",
                self.model, self.version, self.in_flight, timeout,
            )  # fmt: skip
        if self.batcher is not None:
            await self.batcher.close()
        await asyncio.get_running_loop().run_in_executor(None, _close_quietly, self.handle)
        self.state = ModelState.UNAVAILABLE


def _close_quietly(handle: ModelHandle) -> None:
    try:
        handle.close()
    except Exception:  # a crashed runner may fail to close; the version is going away regardless
        _log.exception("closing a model failed")


class _Model:
    __slots__ = ("failure", "latest", "lock", "name", "serving", "statuses", "upload_dir", "users")

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = asyncio.Lock()
        # Loads, unloads and retirements holding or waiting for `lock`; the entry is not forgotten while any runs.
        self.users = 0
        self.serving: dict[int, ServedVersion] = {}
        #: The highest version of `serving` (None when it is empty), kept by `serve` so that a request for the latest
        #: version finds it without a `max` of the versions (a builtin that parses its keywords on every call).
        self.latest: ServedVersion | None = None
        # What the index reports per version, including versions that are not serving (failed, unloaded).
        self.statuses: dict[int, tuple[ModelState, str]] = {}
        # Why the last load failed before any version was chosen (a bad config.json, no version folder), or
        # `_UNLOADED` once an unload has cleared that; None when the model's versions say it all.
        self.failure: str | None = None
        self.upload_dir: Path | None = None

    def serve(self, versions: dict[int, ServedVersion]) -> None:
        """Serve `versions` from now on (never changed in place afterwards: the next change is another `serve`)."""
        self.serving = versions
        self.latest = versions[max(versions)] if versions else None

    def failed(self) -> bool:
        """Whether a load of this model failed and no later load or unload settled it (strict readiness)."""
        if self.failure not in (None, _UNLOADED):
            return True
        return any(state is not ModelState.READY and reason != _UNLOADED for state, reason in self.statuses.values())


class ModelRepository:
    """Serves the models of a repository folder (and uploaded ones) through `loader`."""

    def __init__(
        self,
        root: Path,
        *,
        loader: ModelLoader,
        metrics: ServerMetrics,
        upload_root: Path,
        options: RepositoryOptions = RepositoryOptions(),
    ) -> None:
        # Absolute, so that every path handed to the loader (and so every path in its errors) is one the scrubber
        # recognises, whatever form the repository was given in.
        self.root = root.absolute()
        self.options = options
        self._loader = loader
        self._metrics = metrics
        self._upload_root = upload_root
        # Models with a state to report: names that resolve in the repository, uploads, and (briefly) names a load
        # or unload is working on. Names that turn out to exist nowhere are forgotten once that work ends, so what a
        # client tries does not accumulate here.
        self._models: dict[str, _Model] = {}
        self._transitions = 0
        self._background: set[asyncio.Task[None]] = set()
        self.scrub = Scrubber(self.root, upload_root)

    # ---- lookups (hot path) --------------------------------------------------------------------------------------
    def get(self, name: str, version: str = "") -> ServedVersion:
        """The version serving requests for `name` (the highest when `version` is empty); `ModelNotFound` if none."""
        model = self._models.get(name)
        serving = model.serving if model is not None else None
        if not serving:
            validate_model_name(name)
            if model is None and not self.exists(name):
                raise ModelNotFound(f"Request for unknown model: {name!r} is not found")
            raise ModelNotFound(f"Request for unknown model: {name!r} has no available versions")
        if not version:
            return serving[max(serving)]
        found = serving.get(int(version)) if version.isdigit() else None
        if found is None:
            raise ModelNotFound(f"Request for unknown model: {name!r} version {version} is not found")
        return found

    def exists(self, name: str) -> bool:
        """Whether the repository folder holds a model called `name` (a valid name: see `validate_model_name`)."""
        return (self.root / name).is_dir() or (self.root / f"{name}.carton").exists()

    def acquire(self, name: str, version: str = "") -> ServedVersion:
        """The ready version serving `name` (the given one, else the latest), entered for one request: the caller
        must `ServedVersion.exit` it. `ModelNotFound` if there is none."""
        model = self._models.get(name)
        # The usual request, for the latest version, without a call of `get`.
        served = model.latest if model is not None and not version else None
        if served is None:
            served = self.get(name, version)
        served.in_flight += 1  # (`ServedVersion.enter`, inline)
        served.stats.series.in_flight += 1
        return served

    def is_ready(self) -> bool:
        """No load or unload in progress; under ``strict_readiness`` also no model asked for that is not ready."""
        if self._transitions:
            return False
        if not self.options.strict_readiness:
            return True
        return not any(model.failed() for model in self._models.values())

    def model_ready(self, name: str, version: str = "") -> bool:
        """Whether `name` (at `version`, else its latest) is ready to serve."""
        try:
            return self.get(name, version).state is ModelState.READY
        except (ModelNotFound, BadRequest):
            return False

    def versions(self, name: str) -> list[ServedVersion]:
        """The versions `name` serves, in ascending order (none for an unknown model)."""
        model = self._models.get(name)
        return [model.serving[v] for v in sorted(model.serving)] if model is not None else []

    def all_served(self) -> list[ServedVersion]:
        """Every version of every model being served, by model name then version."""
        return [version for name in sorted(self._models) for version in self.versions(name)]

    # ---- index ---------------------------------------------------------------------------------------------------
    def index(self, *, ready_only: bool = False) -> list[dict[str, str]]:
        """Every model of the repository folder or loaded by upload, one entry per version it has a state for."""
        entries: list[dict[str, str]] = []
        known = {name for name, model in self._models.items() if model.statuses or model.failure}
        for name in sorted(set(list_models(self.root)) | known):
            model = self._models.get(name)
            if model is None or not (model.statuses or model.failure):
                if not ready_only:
                    entries.append({"name": name})
                continue
            if model.failure is not None and not model.serving and not ready_only:
                entries.append({"name": name, "state": ModelState.UNAVAILABLE.value, "reason": model.failure})
            for version, (state, reason) in sorted(model.statuses.items()):
                if ready_only and state is not ModelState.READY:
                    continue
                entry = {"name": name, "version": str(version), "state": state.value}
                if reason:
                    entry["reason"] = reason
                entries.append(entry)
        return entries

    # ---- load ----------------------------------------------------------------------------------------------------
    async def load(self, name: str, *, config: str | None = None, files: Mapping[str, bytes] | None = None) -> None:
        """Load or reload `name`, optionally with a JSON config override and ``file:`` payloads (a new folder)."""
        validate_model_name(name)
        if not self.options.explicit:
            raise RepositoryError(
                "model control mode is 'none': models cannot be loaded or unloaded through the API "
                "(start the server with --model-control-mode explicit)"
            )
        if files:
            if not self.options.allow_upload:
                raise UploadDisabled("model upload ('file:' load parameters) is disabled on this server")
            if config is None:
                raise RepositoryError(f"failed to load {name!r}: a 'config' parameter is required with 'file:' ones")
        await self._load(name, config=config, files=files)

    async def load_at_startup(self, name: str) -> None:
        """Load `name` from the repository as the server starts (its files as they are on disk)."""
        await self._load(validate_model_name(name), config=None, files=None)

    async def _load(self, name: str, *, config: str | None, files: Mapping[str, bytes] | None) -> None:
        model = self._use(name)
        try:
            await self._load_locked(model, config=config, files=files)
        finally:
            self._release(model)

    def _use(self, name: str) -> _Model:
        model = self._models.get(name)
        if model is None:
            model = self._models[name] = _Model(name)
        model.users += 1
        return model

    def _release(self, model: _Model) -> None:
        """End one piece of work on `model`; forget it if nothing of it is left to report."""
        model.users -= 1
        if model.users or model.serving or self._models.get(model.name) is not model:
            return
        if not (model.statuses or model.failure) or not self.exists(model.name):
            # A name that resolved nowhere, or an upload that is not serving (failed or unloaded; the load answer
            # carried the reason): nothing is kept for it, so a client cannot grow the index with names.
            del self._models[model.name]

    async def _load_locked(self, model: _Model, *, config: str | None, files: Mapping[str, bytes] | None) -> None:
        name = model.name
        async with model.lock:
            self._transitions += 1
            upload_dir: Path | None = None
            versions_chosen = False
            try:
                source = "the 'config' parameter"
                if files:
                    upload_dir = await asyncio.get_running_loop().run_in_executor(
                        None, write_upload, self._upload_root, name, dict(files)
                    )
                    available = scan_model_folder(upload_dir, name)
                    sandbox = self.options.upload_sandbox
                else:
                    available, config_file = scan_versions(self.root, name)
                    sandbox = self.options.sandbox
                    if config is None and config_file is not None:
                        config = config_file.read_text(encoding="utf-8", errors="replace")
                        source = "config.json"
                parsed = parse_config(config, model=name, source=source) if config is not None else ModelConfig()
                chosen = parsed.version_policy.select(list(available))
                if not chosen:
                    raise RepositoryError(
                        f"failed to load {name!r}: its version_policy selects none of versions {sorted(available)}"
                    )
                versions_chosen = True
                loaded = await self._load_versions(model, parsed, {v: available[v] for v in chosen}, sandbox)
            except CartonError as exc:
                if upload_dir is not None:
                    shutil.rmtree(upload_dir, ignore_errors=True)
                if isinstance(exc, ServerError):
                    failure: ServerError = exc  # composed by the server from names: client names stay verbatim
                else:
                    failure = RepositoryError(f"failed to load {name!r}: {self.scrub(str(exc))}")
                if not versions_chosen and not files:
                    model.failure = str(failure)
                if failure is exc:
                    raise
                raise failure from exc
            finally:
                self._transitions -= 1
            model.failure = None
            previous, old_upload = model.serving, model.upload_dir
            model.serve(loaded)
            model.upload_dir = upload_dir
            for version in loaded:
                model.statuses[version] = (ModelState.READY, "")
            retiring = list(previous.values())
            for old in retiring:
                if old.version not in loaded:
                    model.statuses[old.version] = (ModelState.UNLOADING, "")
            if retiring or old_upload is not None:
                self._spawn_retire(model, retiring, old_upload, keep=set(loaded))

    async def _load_versions(
        self, model: _Model, config: ModelConfig, paths: Mapping[int, Path], sandbox: str | None
    ) -> dict[int, ServedVersion]:
        for version in paths:
            if version not in model.serving:
                model.statuses[version] = (ModelState.LOADING, "")
        workers = config.instance_count or self.options.workers
        results = await asyncio.gather(
            *(self._load_one(model.name, version, path, config, workers, sandbox) for version, path in paths.items()),
            return_exceptions=True,
        )
        loaded: dict[int, ServedVersion] = {}
        failures: list[str] = []
        for version, result in zip(paths, results, strict=True):
            if isinstance(result, ServedVersion):
                loaded[version] = result
            elif isinstance(result, BaseException):
                if isinstance(result, ServerError):
                    reason = str(result)
                elif isinstance(result, CartonError):
                    reason = self.scrub(str(result))
                else:
                    reason = "internal error while loading"
                    _log.error("loading %r version %s failed", model.name, version, exc_info=result)
                failures.append(f"version {version}: {reason}")
                if version not in model.serving:
                    model.statuses[version] = (ModelState.UNAVAILABLE, reason)
        if failures:
            for served in loaded.values():
                await served.retire(0)
                if served.version not in model.serving:
                    self._metrics.forget(model.name, served.version_str)
            raise RepositoryError(f"failed to load {model.name!r}: " + "; ".join(failures))
        return loaded

    async def _load_one(
        self, name: str, version: int, path: Path, config: ModelConfig, workers: int, sandbox: str | None
    ) -> ServedVersion:
        spec = LoadSpec(path=path, workers=workers, sandbox=sandbox, runner_opts=config.parameters)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, self._loader, spec)
        try:
            handle = await asyncio.wait_for(asyncio.shield(future), self.options.load_timeout)
        except TimeoutError:
            future.add_done_callback(_close_late)
            raise RepositoryError(f"load timed out after {self.options.load_timeout:g}s") from None
        try:
            config.check_tensors(model=name, inputs=handle.inputs, outputs=handle.outputs)
            stats = VersionStats(name, str(version), self._metrics)
            return ServedVersion(model=name, version=version, handle=handle, config=config, stats=stats)
        except BaseException:
            await loop.run_in_executor(None, _close_quietly, handle)
            raise

    # ---- unload --------------------------------------------------------------------------------------------------
    async def unload(self, name: str, *, unload_dependents: bool = False) -> None:
        """Stop serving `name`; returns once no new request can reach it (in-flight ones finish in the background).

        carton models have no dependents (no ensembles), so `unload_dependents` never widens what is unloaded.
        """
        del unload_dependents
        validate_model_name(name)
        if not self.options.explicit:
            raise RepositoryError(
                "model control mode is 'none': models cannot be loaded or unloaded through the API "
                "(start the server with --model-control-mode explicit)"
            )
        await self.retract(name)

    async def retract(self, name: str) -> None:
        """Unload `name` on the server's own decision, whatever the model control mode (several server processes
        undo a load that succeeded on some of them only)."""
        if name not in self._models:
            return
        model = self._use(name)
        try:
            await self._unload_locked(model)
        finally:
            self._release(model)

    async def _unload_locked(self, model: _Model) -> None:
        async with model.lock:
            retiring = list(model.serving.values())
            old_upload = model.upload_dir
            model.serve({})
            model.upload_dir = None
            # Failed loads are settled too: the model is no longer asked for (Triton keeps their reasons, so its
            # strict readiness stays false until the server restarts).
            if model.failure is not None:
                model.failure = _UNLOADED
            for version, (state, _) in model.statuses.items():
                if state is ModelState.UNAVAILABLE:
                    model.statuses[version] = (ModelState.UNAVAILABLE, _UNLOADED)
            for old in retiring:
                model.statuses[old.version] = (ModelState.UNLOADING, "")
            self._transitions += 1
            self._spawn_retire(model, retiring, old_upload, keep=set(), counted=True)

    def _spawn_retire(
        self,
        model: _Model,
        versions: list[ServedVersion],
        upload_dir: Path | None,
        *,
        keep: set[int],
        counted: bool = False,
    ) -> None:
        model.users += 1  # released when the retirement ends: the entry reports UNLOADING until then
        self._spawn(self._retire(model, versions, upload_dir, keep=keep, counted=counted))

    async def _retire(
        self,
        model: _Model,
        versions: list[ServedVersion],
        upload_dir: Path | None,
        *,
        keep: set[int],
        counted: bool = False,
    ) -> None:
        try:
            await asyncio.gather(*(served.retire(self.options.unload_timeout) for served in versions))
            for served in versions:
                # A version that is serving again (reloaded) keeps its series; the new one records into them.
                if served.version in keep or served.version in model.serving:
                    continue
                self._metrics.forget(model.name, served.version_str)
                if model.statuses.get(served.version, (None,))[0] is not ModelState.READY:
                    model.statuses[served.version] = (ModelState.UNAVAILABLE, _UNLOADED)
            if upload_dir is not None:
                shutil.rmtree(upload_dir, ignore_errors=True)
        finally:
            if counted:
                self._transitions -= 1
            self._release(model)

    def _spawn(self, coroutine: object) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coroutine)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def settle(self) -> None:
        """Wait until the unloads and retirements under way are done (their runners closed)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def close(self) -> None:
        """Unload everything and wait for it (server shutdown)."""
        for name in list(self._models):
            model = self._models[name]
            retiring = list(model.serving.values())
            model.serve({})
            self._spawn_retire(model, retiring, model.upload_dir, keep=set())
            model.upload_dir = None
        await self.settle()


def _close_late(future: asyncio.Future[ModelHandle]) -> None:
    if not future.cancelled() and future.exception() is None:
        _close_quietly(future.result())
