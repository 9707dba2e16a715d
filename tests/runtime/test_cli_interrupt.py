"""Ctrl-C during a long `carton infer`: the command stops at once, kills the runner, says so, and exits 130."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import carton
import numpy as np
import pytest
from serving_process import alive, descendants

from .runtime_test_runners import SLEEP, STARTED_MARKER

pytestmark = pytest.mark.usefixtures("runtime_plugin")

DRIVER = Path(__file__).with_name("cli_with_test_runners.py")
#: How long `Model.close` lets a runner finish before killing it: an interrupted command must not wait for it.
GRACEFUL_CLOSE_SECONDS = 5.0


def _other_thread_taking(pid: int, signum: int) -> int:
    """A thread of process `pid` other than its main one that does not block `signum` (ZeroMQ's own threads block
    every signal; the host's Python threads do not)."""
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        if int(task.name) == pid:
            continue
        found = re.search(r"^SigBlk:\s*([0-9a-f]+)$", (task / "status").read_text(), re.MULTILINE)
        assert found is not None
        if not int(found.group(1), 16) & (1 << (signum - 1)):
            return int(task.name)
    raise AssertionError(f"no thread of {pid} but the main one takes signal {signum}")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
@pytest.mark.parametrize("to_a_thread", [False, True], ids=["to-the-process", "to-another-thread"])
def test_ctrl_c_during_a_long_infer_stops_promptly_and_says_so(
    affine_dir: Path, tmp_path: Path, to_a_thread: bool
) -> None:
    """Ctrl-C stops the command whichever of its threads the kernel hands the signal to: sent to a thread other than
    the main one (as a process-directed signal may be), Python's handler still runs before the runner answers."""
    packed = carton.pack(affine_dir, tmp_path / "affine.carton", runner_name="affine",
                         required_framework_version="^1")  # fmt: skip
    np.save(tmp_path / "x.npy", np.array([[SLEEP, 600.0]], dtype=np.float32))
    started = tmp_path / "started"
    process = subprocess.Popen(
        [sys.executable, str(DRIVER), "infer", str(packed), "-i", f"x={tmp_path / 'x.npy'}"],
        env={**os.environ, STARTED_MARKER: str(started)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the request never reached the runner"
            time.sleep(0.05)
        runners = descendants(process.pid)
        assert runners
        if to_a_thread:
            os.kill(_other_thread_taking(process.pid, signal.SIGINT), signal.SIGINT)
        else:
            process.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        stdout, stderr = process.communicate(timeout=60)
        waited = time.monotonic() - interrupted
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    assert stdout == b""
    assert stderr.decode().strip() == "carton: interrupted", stderr
    # It did not give the runner its graceful close: the request it was running will never be read.
    assert waited < GRACEFUL_CLOSE_SECONDS, waited
    assert not [pid for pid in runners if alive(pid)]
