"""Fixtures for the protocol tests: start real runner processes from `runners_for_tests` and always close them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from carton._runtime._process import RunnerProcess
from carton_protocol import RunnerSpec

HERE = Path(__file__).resolve().parent
TEST_ENV = {"PYTHONPATH": str(HERE)}


def make_spec(entry: str, *, concurrent: bool = False) -> RunnerSpec:
    return RunnerSpec(
        runner_name="test", framework_version="1.0.0", runner_compat_version=1, entry=entry, concurrent=concurrent
    )


@pytest.fixture
def start_runner() -> Iterator[Callable[..., RunnerProcess]]:
    started: list[RunnerProcess] = []

    def start(entry: str, *, load: bool = True, opts: dict[str, Any] | None = None, **kwargs: Any) -> RunnerProcess:
        kwargs.setdefault("extra_env", TEST_ENV)
        runner = RunnerProcess.start(make_spec(f"runners_for_tests:{entry}" if ":" not in entry else entry), **kwargs)
        started.append(runner)
        if load:
            runner.load(model_dir=HERE, opts=opts or {}, inputs=(), outputs=())
        return runner

    yield start
    for runner in started:
        runner.close(timeout=2)
