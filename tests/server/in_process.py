"""`carton serve`'s HTTP app over models that run in the test's own process (no runner): for tests of the HTTP
layer that need a served model but not a model's runner."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from carton.server._handle import ModelLoader
from carton.server._http import HttpApp
from carton.server._repository import ModelRepository, RepositoryOptions
from carton.server._stats import ServerMetrics


def in_process_app(
    root: Path, names: Sequence[str], loader: ModelLoader, run: Callable[[Coroutine[Any, Any, Any]], Any]
) -> tuple[HttpApp, ModelRepository]:
    """An app serving version 1 of each of `names` from `root` (an empty folder), each made by `loader`; `run` runs
    the loads (``asyncio.run``, or an event loop's ``run_until_complete``). The caller closes the repository."""
    for name in names:
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.carton").write_bytes(b"")
    metrics = ServerMetrics()
    repository = ModelRepository(
        root, loader=loader, metrics=metrics, upload_root=root / "uploads", options=RepositoryOptions(explicit=False)
    )
    for name in names:
        run(repository.load_at_startup(name))
    return HttpApp(repository, metrics, max_body_size=1 << 20, server_version="t"), repository
