"""Starting `carton serve` as a subprocess on a port the kernel chose, waiting for a server started as a
subprocess (`carton serve`, `serve run`) to answer, and the process tree it leaves (read from /proc)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_BANNER = re.compile(r"^carton server: HTTP on [^ ]+:(\d+)")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Serving:
    """A `carton serve` subprocess and the HTTP port its banner named; its stderr is read as it comes."""

    process: subprocess.Popen[bytes]
    http_port: int
    _lines: list[str]
    _reader: threading.Thread

    def stderr_lines(self) -> list[str]:
        """The lines the process wrote to stderr; every one of them once it has exited."""
        if self.process.poll() is not None:
            self._reader.join(30)
        return list(self._lines)

    def stderr_text(self) -> str:
        return "\n".join(self.stderr_lines())


def start_serving(command: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 120) -> Serving:
    """Start `command` (a `carton serve` with `--http-port 0`) and return once its banner names the port it bound.

    The kernel picks the port at the bind, so no other process can take it between a test choosing a free port and
    the server binding it. Fails with the process's stderr if it exits or stays silent for `timeout` seconds."""
    process = subprocess.Popen(list(command), stderr=subprocess.PIPE, env=None if env is None else dict(env))
    lines: list[str] = []
    ports: list[int] = []
    banner = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for raw in process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            lines.append(line)
            if not ports and (match := _BANNER.match(line)):
                ports.append(int(match[1]))
                banner.set()
        banner.set()

    reader = threading.Thread(target=read, name="serve-stderr", daemon=True)
    reader.start()
    if not banner.wait(timeout) or not ports:
        process.kill()
        process.wait(30)
        reader.join(30)
        raise AssertionError(f"carton serve named no HTTP port within {timeout} s:\n" + "\n".join(lines))
    return Serving(process=process, http_port=ports[0], _lines=lines, _reader=reader)


def wait_answering(
    process: subprocess.Popen[bytes] | Serving,
    ready: Callable[[], bool],
    *,
    timeout: float,
    what: str = "the server",
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
        if isinstance(process, Serving):
            assert process.process.poll() is None, process.stderr_text()
        else:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, f"{what} did not answer within {timeout} s"
        time.sleep(0.2)


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    pending = [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
