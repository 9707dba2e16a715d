"""``python cli_with_test_runners.py ARGS...``: the ``carton`` command with the runtime tests' runners registered.

Tests run it as a real subprocess (for signals); the runners get ``CARTON_TEST_SLEEP_STARTED`` from this process's
environment so that the test can see when a request is inside the runner.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from carton._runtime import plugin_manager
from carton.cli import main
from carton_protocol import RunnerSpec, hookimpl
from runtime_test_runners import STARTED_MARKER

HERE = Path(__file__).resolve().parent


class _Plugin:
    @hookimpl
    def carton_runners(self) -> list[RunnerSpec]:
        env = [("PYTHONPATH", str(HERE))]
        if STARTED_MARKER in os.environ:
            env.append((STARTED_MARKER, os.environ[STARTED_MARKER]))
        return [
            RunnerSpec(runner_name="affine", framework_version="1.0.0", runner_compat_version=1,
                       entry="runtime_test_runners:Affine", concurrent=True, env=tuple(env))
        ]  # fmt: skip


if __name__ == "__main__":
    plugin_manager().register(_Plugin(), name="cli-test-runners")
    sys.exit(main(sys.argv[1:]))
