"""Suite-wide isolation: every test session gets its own carton cache and data directories, so tests never read or
write the user's ~/.cache/carton or ~/.local/share/carton (tests that want a persistent cache set their own).

On two pytest-xdist workers (``-n 2 --dist loadgroup``, as `.ci/run` runs the suite) each test file runs whole in one
worker, so that its module-scoped fixtures (a Ray cluster, a served model) are made once, and the compiled-kernel
tests (tests/mcf_kernels, tests/mcf_runner) all run in one worker, so that numba compiles each kernel once into its
disk cache instead of in two processes at the same time."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

#: Test folders whose files share one xdist worker (they compile and load the same numba kernels).
_ONE_WORKER = {"mcf_kernels": "compiled-kernels", "mcf_runner": "compiled-kernels"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        path = item.path.relative_to(config.rootpath)
        group = _ONE_WORKER.get(path.parts[1], str(path)) if len(path.parts) > 2 else str(path)
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session", autouse=True)
def _isolated_carton_dirs() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="carton-tests-") as root:
        saved = {key: os.environ.get(key) for key in ("CARTON_CACHE_DIR", "CARTON_DATA_DIR")}
        os.environ["CARTON_CACHE_DIR"] = str(Path(root, "cache"))
        os.environ["CARTON_DATA_DIR"] = str(Path(root, "data"))
        try:
            yield Path(root)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
