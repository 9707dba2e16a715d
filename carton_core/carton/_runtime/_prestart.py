"""`carton.prestart`: start the runner a later `carton.load` will use, before that load is called.

The first `carton.load` in a process has no spare runner to take, so it pays a runner start (an interpreter, numpy,
pyzmq, the framework: 0.13-0.15 s on an idle machine) on top of the framework's own load. An application that knows
its models at start-up (a server, a worker) can move that cost to a moment of its choosing: ``prestart`` reads only
carton.toml, resolves the runner exactly as `carton.load` would, and has the spare pool (`_spares`) start that
runner in the background. The load then takes the started process like any spare (docs/runners.md, "Load time").
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CartonWarning
from ._process import RunnerProcess
from ._resolve import RunnerRequest, requirement_source, resolve_runner
from ._spares import SPARE_RUNNERS_ENV, spare_limit, spare_pool

if TYPE_CHECKING:
    from .._format import ReadLimits

__all__ = ["prestart"]


def prestart(
    path_or_url: str | Path,
    *,
    override_runner_name: str | None = None,
    override_required_framework_version: str | None = None,
    read_limits: ReadLimits | None = None,
) -> Future[None]:
    """Start, in the background, the runner process that a later ``carton.load`` of this carton will take.

    Returns at once with a future that completes when the runner is up (handshaken, framework imported), or
    raises the start's `RunnerStartError`; waiting on it is optional. Errors in the carton (`FormatError`, ...)
    or in its runner requirement (`NoCompatibleRunner`, `InvalidVersionReq`) are raised here, immediately. The
    overrides must be the ones the load will pass, or the load resolves another runner and starts its own.

    The runner is kept as a spare (``CARTON_SPARE_RUNNERS``, default 2, most recently used runners first): only
    loads without a sandbox take spares, since a sandboxed runner can only start once its model folder is known.
    With ``CARTON_SPARE_RUNNERS=0`` nothing is started and a `CartonWarning` says so.
    """
    from .._format import get_model_info

    info = get_model_info(path_or_url, limits=read_limits)
    request = RunnerRequest.for_carton(
        info,
        override_runner_name=override_runner_name,
        override_required_framework_version=override_required_framework_version,
    )
    spec = resolve_runner(request, where=requirement_source(path_or_url, override_required_framework_version))
    spare = spare_pool().replenish(spec)
    ready: Future[None] = Future()
    if spare is None:
        reason = (
            f"spare runners are disabled ({SPARE_RUNNERS_ENV}=0)"
            if spare_limit() == 0
            else f"runner {spec.runner_name!r} cannot be kept as a spare (its RunnerSpec is not hashable, or the "
            "interpreter is exiting)"
        )
        warnings.warn(
            f"carton.prestart({str(path_or_url)!r}) started nothing: {reason}, so the load will start its own runner",
            CartonWarning,
            stacklevel=2,
        )
        ready.set_result(None)
        return ready

    def report(started: Future[RunnerProcess]) -> None:
        error = None if started.cancelled() else started.exception()
        if error is not None:
            ready.set_exception(error)
        else:
            ready.set_result(None)

    spare.add_done_callback(report)
    return ready
