"""Fixtures of the runtime tests: a plugin shipping the test runners, and small real model folders."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from carton._runtime import plugin_manager
from carton.errors import CartonWarning
from carton_protocol import RunnerSpec, hookimpl

HERE = Path(__file__).resolve().parent


def runner_spec(entry: str, *, name: str = "affine", version: str = "1.0.0", compat: int = 1,
              concurrent: bool = True) -> RunnerSpec:
    return RunnerSpec(runner_name=name, framework_version=version, runner_compat_version=compat,
                      entry=f"runtime_test_runners:{entry}", concurrent=concurrent,
                      env=(("PYTHONPATH", str(HERE)),))


class RuntimeTestPlugin:
    """Ships ``affine`` (1.0.0 and 1.1.0, compat 1; 2.0.0 compat 2), ``affine-serial`` and ``passthrough``."""

    @hookimpl
    def carton_runners(self) -> list[RunnerSpec]:
        return [
            runner_spec("Affine", version="1.0.0"),
            runner_spec("Affine", version="1.1.0"),
            runner_spec("Affine", version="2.0.0", compat=2),
            runner_spec("SerialAffine", name="affine-serial", concurrent=False),
            runner_spec("Passthrough", name="passthrough"),
        ]


@pytest.fixture
def runtime_plugin() -> Iterator[RuntimeTestPlugin]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CartonWarning)  # a built-in runner's plugin may be broken mid-development
        manager = plugin_manager()
    plugin = RuntimeTestPlugin()
    manager.register(plugin, name="runtime-tests")
    yield plugin
    if manager.is_registered(plugin):
        manager.unregister(plugin)


@pytest.fixture
def affine_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "affine-model"
    folder.mkdir()
    (folder / "offset.txt").write_text("0.5")
    return folder
