"""Waiting for a server started as a subprocess (`carton serve`, `serve run`) to answer."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable


def wait_answering(
    process: subprocess.Popen[bytes], ready: Callable[[], bool], *, timeout: float, what: str = "the server"
) -> None:
    """Poll `ready` (a failing call counts as not ready) until it is true. Fails with the process's stderr if it
    exits first, or saying `what` did not answer within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready():
                return
        except Exception:
            pass
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, f"{what} did not answer within {timeout} s"
        time.sleep(0.2)
