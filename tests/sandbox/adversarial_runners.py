"""Runners that attack their sandbox on request (entries ``adversarial_runners:Name``, started by the real launcher).

`Adversary.infer` takes ``action`` (a string tensor) and ``arg`` (a string tensor) and does exactly one thing; a
successful attack returns what it got, so the test sees a breach as a normal answer and a defence as an error.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

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


_PR_SET_PDEATHSIG = 1
#: What a daemonized descendant runs: it ignores every polite signal and disarms its parent-death signal.
_STUBBORN_SLEEPER = (
    "import ctypes, signal, time\n"
    "for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):\n"
    "    signal.signal(signum, signal.SIG_IGN)\n"
    "ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)\n"
    "time.sleep(600)\n"
)


def _become_stubborn() -> None:
    """Ignore SIGTERM/SIGHUP/SIGINT, disarm the parent-death signal, and leave the supervisor's session."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
    # The runner loop's own ways out (its host watch and its SIGTERM handler end in _die): disabled.
    import carton_protocol._loop as loop

    loop._die = lambda code: None  # type: ignore[assignment]
    with contextlib.suppress(OSError):  # already a session leader
        os.setsid()


def _daemonize(marker: str, count: int) -> None:
    """Double-fork `count` stubborn sleepers tagged with `marker`, each in a session of its own."""
    for _ in range(count):
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", _STUBBORN_SLEEPER, marker])
            os._exit(0)


def _swap_for_link(path: Path, target: str) -> str:
    """Replace `path` by a symlink to `target`; what happened, for the test to see."""
    try:
        path.unlink()
        path.symlink_to(target)
    except OSError as exc:
        return f"refused: {type(exc).__name__}"
    return "swapped"


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
        if action == "swap_log":
            # Its log (in the runtime folder, above scratch) becomes a link to a host file; then a crash makes the
            # host quote the log.
            print(_swap_for_link(Path.cwd().parent / "runner.log", arg), flush=True)
            ctypes.string_at(0)
        if action == "swap_socket":
            return {"out": np.array([_swap_for_link(Path.cwd().parent / "runner.sock", arg)])}
        if action == "plant_links":
            # Links in scratch to a host folder and a host file: removing scratch must not follow them.
            os.symlink(arg, "folder-link")
            os.symlink(os.path.join(arg, "keep.txt"), "file-link")
            os.mkdir("sub")
            os.symlink(arg, os.path.join("sub", "deeper-link"))
            return {"out": np.array(["planted"])}
        if action == "suicide":
            time.sleep(float(arg or 0.5))
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "kill_supervisor":
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(1.0)
            return {"out": np.array(["supervisor killed"])}
        if action == "spin_past_sigxcpu":
            signal.signal(signal.SIGXCPU, signal.SIG_IGN)  # the kernel's SIGKILL at the hard limit then ends it
            while True:
                pass
        if action == "outlive":
            # Everything a runner can do to its own tree to survive close() and the host: stubborn, daemonized
            # descendants, then the supervisor killed.
            _become_stubborn()
            if arg:
                _daemonize(arg, 2)
            threading.Timer(0.2, os.kill, (os.getppid(), signal.SIGKILL)).start()  # once this reply is out
            return {"out": np.array([str(os.getpid())])}
        if action == "whoami":
            return {"out": np.array([f"{os.getuid()} {os.getpid()}"])}
        raise ValueError(f"unknown action {action!r}")
