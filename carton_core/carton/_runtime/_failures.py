"""What a runner's error reply becomes on the host: the one mapping from `carton_protocol.ErrorCode` to `carton`
exceptions (docs/protocol.md, "Errors", has the same table).

======================  ===========================  ==========================================================
code                    during ``infer``             during start-up and ``load`` / during ``pack``
======================  ===========================  ==========================================================
``invalid_input``       `InvalidInput` (``tensor``)  `RunnerStartError` / `RunnerFailed`
``invalid_output``      `InvalidOutput`              `RunnerStartError` / `RunnerFailed`
``out_of_memory``       `RunnerMemoryLimit`          `RunnerMemoryLimit` with a memory limit, else as ``internal``
``protocol``            `RunnerProtocolError`        `RunnerStartError` / `RunnerProtocolError`
anything else           `RunnerFailed`               `RunnerStartError` / `RunnerFailed`
======================  ===========================  ==========================================================

Every one keeps the runner's words: ``remote_kind`` (the code) and ``remote_message`` on the `RunnerError`s, the
message itself on `InvalidInput` and `InvalidOutput`, and the runner's traceback on the `carton_protocol.RemoteError`
that is the exception's ``__cause__``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from carton_protocol import ErrorCode, ErrorReply, RemoteError

from ..errors import (
    CartonError,
    InvalidInput,
    InvalidOutput,
    RunnerFailed,
    RunnerMemoryLimit,
    RunnerProtocolError,
    RunnerStartError,
)
from ._exits import memory_failure

__all__ = ["Operation", "remote_failure"]


class Operation(enum.StrEnum):
    """What the host asked of the runner when it failed."""

    START = "start"
    LOAD = "load"
    PACK = "pack"
    INFER = "infer"


def remote_failure(
    reply: ErrorReply, *, runner: str, operation: Operation, subject: str = "", limits: Mapping[str, float]
) -> CartonError:
    """The exception to raise for `reply`, the runner's answer to `operation` (on `subject`, a model folder).

    `runner` names the runner in messages; `limits` are the ones a sandbox applied (`LaunchPlan.limits`).
    """
    text = f"{reply.exception}: {reply.message}" if reply.exception else reply.message
    code = reply.code
    facts = {"remote_kind": code, "remote_message": reply.message}
    memory = limits.get("memory_bytes")
    failure: CartonError
    if operation in (Operation.START, Operation.LOAD):
        what = f"runner {runner} failed to start" if operation is Operation.START else (
            f"runner {runner} failed to load {subject}"
        )  # fmt: skip
        evidence = memory_failure(limits, reply.traceback, text)
        if memory is not None and (code == ErrorCode.OUT_OF_MEMORY or evidence is not None):
            # Only the line that shows it: a framework's import error can run to pages of advice.
            shown = evidence or (text.strip().splitlines() or [text])[0]
            failure = RunnerMemoryLimit(
                f"{what}: it ran out of memory under its memory limit (memory_bytes={memory:.0f}): {shown}",
                limit_bytes=memory,
                **facts,
            )
        else:
            failure = RunnerStartError(f"{what}: {text}", **facts)
    elif code == ErrorCode.PROTOCOL:
        failure = RunnerProtocolError(f"runner {runner} rejected the request: {text}", **facts)
    elif code == ErrorCode.OUT_OF_MEMORY:
        limit_text = f"its memory limit (memory_bytes={memory:.0f})" if memory is not None else "memory"
        failure = RunnerMemoryLimit(
            f"runner {runner} ran out of {limit_text} during {operation}: {text}", limit_bytes=memory, **facts
        )
    elif operation is Operation.PACK:
        failure = RunnerFailed(f"runner {runner} failed to pack {subject}: {text}", **facts)
    elif code == ErrorCode.INVALID_INPUT:
        failure = InvalidInput(reply.message, tensor=reply.tensor)
    elif code == ErrorCode.INVALID_OUTPUT:
        failure = InvalidOutput(reply.message, tensor=reply.tensor)
    else:
        failure = RunnerFailed(f"runner {runner} failed during {operation}: {text}", **facts)
    failure.__cause__ = RemoteError(
        reply.message, code=code, exception=reply.exception, traceback=reply.traceback, tensor=reply.tensor
    )
    return failure
