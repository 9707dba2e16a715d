"""Runners that attack their sandbox on request (entries ``adversarial_runners:Name``, started by the real launcher).

`Adversary.infer` takes ``action`` (a string tensor) and ``arg`` (a string tensor) and does exactly one thing; a
successful attack returns what it got, so the test sees a breach as a normal answer and a defence as an error.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import time
from collections.abc import Mapping

import numpy as np
from carton_protocol import LoadContext, Runner, Tensor


def _text(inputs: Mapping[str, Tensor], name: str) -> str:
    value = inputs[name]
    assert isinstance(value, np.ndarray)
    return str(value.flat[0])


def _spawn_orphan(marker: str) -> None:
    """Fork a child that leaves the runner's session and execs a long sleep tagged with `marker`."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", marker])
        os._exit(0)


class Adversary(Runner):
    """Benign on ``action == "echo"``; hostile on every other action."""

    concurrent = True

    def load(self, context: LoadContext) -> None:
        self.model_dir = context.model_dir
        self.note = (context.model_dir / "note.txt").read_text()

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        action, arg = _text(inputs, "action"), _text(inputs, "arg")
        if action == "echo":
            return {"out": np.array([self.note + arg])}
        if action == "read":
            with open(arg, "rb") as handle:
                return {"out": np.array([handle.read(4096).decode("utf-8", "replace")])}
        if action == "listdir":
            return {"out": np.array([",".join(sorted(os.listdir(arg)))])}
        if action == "write":
            with open(arg, "w") as handle:
                handle.write("escaped")
            return {"out": np.array([f"wrote {arg}"])}
        if action == "connect":
            with socket.create_connection(("127.0.0.1", int(arg)), timeout=2) as conn:
                conn.sendall(b"escaped")
            return {"out": np.array(["connected"])}
        if action == "forkbomb":
            while True:
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.01)
        if action == "alloc":
            block = np.ones(int(arg), dtype=np.uint8)
            return {"out": np.array([f"allocated {block.nbytes}"])}
        if action == "spin":
            while True:
                pass
        if action == "segfault":
            ctypes.string_at(0)
        if action == "orphan":
            _spawn_orphan(arg)
            time.sleep(0.2)
            ctypes.string_at(0)
        if action == "env":
            return {"out": np.array(["\n".join(f"{k}={v}" for k, v in sorted(os.environ.items()))])}
        if action == "fds":
            targets = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    targets.append(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    continue
            return {"out": np.array(["\n".join(sorted(targets))])}
        if action == "whoami":
            return {"out": np.array([f"{os.getuid()} {os.getpid()}"])}
        raise ValueError(f"unknown action {action!r}")
