"""How a `RunnerProcess`'s calls fail (`RunnerFailures`, which it inherits): the one translation of what the layers
below raise while a call waits (the wire, ZeroMQ, the operating system, the host's own wake-ups) into the `carton`
exception the call raises, `RunnerFailures._failure`, and the exceptions for a runner that exited (`RunnerCrashed`,
`RunnerCPULimit`), did not answer in time (`RunnerTimeout`, after killing it), did not start (`RunnerStartError`,
`RunnerMemoryLimit`), reported a failure (`_failures.remote_failure`) or answered amiss (`RunnerProtocolError`),
each naming the runner and quoting its log where it helps.
"""

from __future__ import annotations

import copy
import signal
import threading
from typing import TYPE_CHECKING

from carton_protocol import ErrorReply, ProtocolError, Reply, RunnerSpec, VersionMismatch

from .._environments import rebuild_command
from ..errors import (
    CartonError,
    ModelClosed,
    ProtocolMismatch,
    RunnerCPULimit,
    RunnerCrashed,
    RunnerError,
    RunnerMemoryLimit,
    RunnerProtocolError,
    RunnerStartError,
    RunnerTimeout,
)
from ._connection import CallTimeout, PeerGone
from ._exits import Resources, describe_exit, exit_signal, memory_failure
from ._failures import Operation, remote_failure
from ._launch import LaunchPlan, read_log_tail

__all__ = ["RunnerFailures"]

# The share of `cpu_seconds` a runner killed by SIGXCPU or SIGKILL must have used for the limit to be named.
# `RLIMIT_CPU` is enforced on the kernel's per-tick sample of the process's CPU time, but the usage reaped with
# `wait4` is the scheduler's exact runtime; with the CPU contended (threads that run for part of a tick are charged
# all of it) the sample runs ahead of the exact time, so a runner killed at its limit can be reaped short of it.
# Half still tells the limit apart from a runner that signalled itself early.
_CPU_LIMIT_SHARE = 0.5


class RunnerFailures:
    """The failure side of `RunnerProcess` (``_process.py``), which sets these attributes and inherits the methods."""

    spec: RunnerSpec
    plan: LaunchPlan
    pid: int
    _resources: Resources
    _lock: threading.Condition
    _closed: bool
    #: Why the host killed the process, for calls that were waiting.
    _fate: RunnerError | None

    if TYPE_CHECKING:

        def _mismatch(self, remote: object) -> ProtocolMismatch:
            """The `ProtocolMismatch` of a runner speaking `remote` (`RunnerProcess`'s, beside the handshake)."""

    def _failure(self, exc: BaseException, operation: Operation, timeout: float | None, limit_name: str) -> CartonError:
        """The one translation of what the layers below raise (the wire, ZeroMQ, the system, the host's own
        wake-ups) into the `carton` exception a call raises; sync and async calls alike."""
        entry = self.spec.entry
        starting = operation is Operation.START
        match exc:
            case PeerGone() if starting:
                text = f"runner {entry} {self._exit_text()} before completing the handshake"
                return self._start_error(text)
            case PeerGone():
                return self._gone_error(str(operation))
            case CallTimeout():
                what = "complete the handshake" if starting else f"answer {operation}"
                fate = RunnerTimeout(
                    f"runner {entry} did not {what} within {timeout:g} s ({limit_name}); it was killed"
                    + (self._log_text() if starting else ""),
                    limit_seconds=timeout,
                    limit_name=limit_name,
                )
                self._kill(fate)
                return fate
            case VersionMismatch():
                return self._mismatch(exc.remote)
            case ProtocolError():
                what = "a malformed handshake" if starting else f"a malformed reply to {operation}"
                return RunnerProtocolError(f"runner {entry} sent {what}: {exc}")
            case _ if self._closed:
                return ModelClosed(f"runner {entry} was closed during {operation}")
            case _:
                return RunnerProtocolError(f"runner {entry}: transport failed during {operation}: {exc}")

    def _remote_failure(self, reply: ErrorReply, operation: Operation, subject: str = "") -> CartonError:
        return remote_failure(
            reply, runner=self.spec.entry, operation=operation, subject=subject, limits=self.plan.limits
        )

    def _unexpected(self, reply: Reply, what: str) -> RunnerProtocolError:
        return RunnerProtocolError(f"runner {self.spec.entry} answered {what} with a {type(reply).__name__}")

    def _gone_error(self, what: str) -> RunnerError:
        if self._fate is not None:
            failure = copy.copy(self._fate)  # the same type and facts (a timeout's limit), told for this call
            failure.args = (f"{self._fate} (while waiting for {what})",)
            return failure
        if self._closed:
            return ModelClosed(f"runner {self.spec.entry} was closed during {what}")
        text = f"runner {self.spec.entry} (pid {self.pid}) {self._exit_text()} during {what}"
        # Whatever is left of the tree goes now (a runner that killed its supervisor is still running).
        self._resources.kill()
        ended = self._resources.exit
        returncode = None if ended is None else ended.returncode
        signum = exit_signal(returncode, self.plan.exit_signal_base)
        cpu = self.plan.limits.get("cpu_seconds")
        used = None if ended is None else ended.cpu_seconds
        limited = cpu is not None and signum in (signal.SIGXCPU, signal.SIGKILL)
        if limited and cpu is not None and used is not None and used >= cpu * _CPU_LIMIT_SHARE:
            # SIGXCPU at the soft limit; SIGKILL at the hard one (a second later) if the runner caught SIGXCPU. The
            # signal alone proves nothing (a runner can send either to itself): its CPU time must show the limit.
            return RunnerCPULimit(
                f"{text}: it went over its CPU-time limit (cpu_seconds={cpu:g}; it used {used:.1f} s)"
                + self._log_text(),
                limit_seconds=cpu,
            )
        if limited:
            # A reader of the signal would blame the limit: say what the accounting showed instead.
            shown = "its CPU time is not known" if used is None else f"it used {used:.2f} s"
            text += f" (not its CPU-time limit cpu_seconds={cpu:g}: {shown})"
        return RunnerCrashed(f"{text}{self._log_text()}", returncode=returncode, signal=signum)

    def _start_error(self, what: str) -> RunnerError:
        """`RunnerStartError` quoting the log's end, or `RunnerMemoryLimit` naming the limit and quoting only the
        line that shows an allocation failure, when the runner had a memory limit and its log shows one."""
        line = memory_failure(self.plan.limits, read_log_tail(self._resources.runtime.log_fd, 1 << 16))
        if line is not None:
            limit = self.plan.limits["memory_bytes"]
            return RunnerMemoryLimit(
                f"{what}: it ran out of memory under its memory limit (memory_bytes={limit:.0f}): {line}",
                limit_bytes=limit,
            )
        hint = ""
        if self.spec.environment is not None:
            # A runner environment that cannot start its runner is broken (a package removed from it, say): the user
            # can do nothing with the log alone.
            command = rebuild_command(self.spec.runner_name, self.spec.framework_version, force=True)
            hint = (
                f"\n(the runner runs in the runner environment {self.spec.runner_name} {self.spec.framework_version};"
                f" if it is broken, rebuild it: {command})"
            )
        return RunnerStartError(f"{what}{self._log_text()}{hint}")

    def _kill(self, fate: RunnerError) -> None:
        with self._lock:
            if self._fate is None:
                self._fate = fate
        self._resources.kill()

    def _exit_text(self) -> str:
        ended = self._resources.wait(1.0)
        return describe_exit(None if ended is None else ended.returncode, self.plan.exit_signal_base)

    def _log_text(self) -> str:
        tail = read_log_tail(self._resources.runtime.log_fd)
        return f"; runner log ends with:\n{tail}" if tail else ""
