"""Transport-independent pieces of an inference: turning wire tensors into arrays for a model version, picking and
laying out outputs, and translating failures into `ServerError`s whose messages are safe to send.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from time import perf_counter_ns
from typing import Any

import numpy as np
from carton_protocol import DType, Tensor

from ..errors import (
    CartonError,
    InvalidInput,
    InvalidOutput,
    ModelClosed,
    RunnerCPULimit,
    RunnerCrashed,
    RunnerFailed,
    RunnerMemoryLimit,
    RunnerTimeout,
)
from ._datatypes import DATATYPE_OF, NUMPY_OF, datatype_of_array, decode_bytes_elements, encode_bytes_elements
from ._repository import ServedVersion
from .errors import BadRequest, ModelUnavailable, ServerError

__all__ = [
    "ModelUnavailable",
    "check_complete",
    "check_requested",
    "element_count",
    "expected_datatype",
    "from_bytes_elements",
    "from_raw",
    "json_elements",
    "output_tensor",
    "request_failed",
    "request_succeeded",
    "select_outputs",
    "translate_error",
]

_log = logging.getLogger("carton.server")


def element_count(shape: Sequence[int], *, tensor: str) -> int:
    """The number of elements of `shape`; `BadRequest` naming `tensor` if it is not a list of sizes >= 0."""
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise BadRequest(f"input {tensor!r}: shape {list(shape)} must be a list of non-negative integers")
    return math.prod(shape)


def expected_datatype(served: ServedVersion, name: str, datatype: str) -> DType:
    """The declared dtype of input `name`; `BadRequest` if the model has no such input or declares another type."""
    spec = served.input_specs.get(name)
    if spec is None:
        raise BadRequest(
            f"unexpected inference input {name!r} for model {served.model!r} (it takes {sorted(served.input_specs)})"
        )
    expected = DATATYPE_OF[spec.dtype]
    if datatype != expected:
        raise BadRequest(
            f"inference input {name!r} data-type is {datatype!r}, but model {served.model!r} expects {expected!r}"
        )
    return spec.dtype


def from_raw(buffer: memoryview, dtype: DType, shape: Sequence[int], *, tensor: str) -> np.ndarray:
    """An array over `buffer` (no copy for fixed-size types); `BadRequest` if its size disagrees with `shape`."""
    count = element_count(shape, tensor=tensor)
    if dtype is DType.STRING:
        return from_bytes_elements(decode_bytes_elements(buffer, count, tensor=tensor), shape, tensor=tensor)
    numpy_dtype = NUMPY_OF[DATATYPE_OF[dtype]]
    expected = count * numpy_dtype.itemsize
    if len(buffer) != expected:
        raise BadRequest(
            f"input {tensor!r}: {len(buffer)} bytes of data, but shape {list(shape)} of "
            f"{DATATYPE_OF[dtype]} needs {expected}"
        )
    return np.frombuffer(buffer, numpy_dtype, count).reshape(shape)


def from_bytes_elements(elements: Sequence[bytes], shape: Sequence[int], *, tensor: str) -> np.ndarray:
    """A ``str`` array from utf-8 BYTES elements (carton's string tensors)."""
    try:
        texts = [element.decode("utf-8") for element in elements]
    except UnicodeDecodeError as exc:
        raise BadRequest(f"input {tensor!r}: a BYTES element is not valid utf-8 ({exc.reason})") from exc
    return np.array(texts, dtype=str).reshape(shape) if texts else np.empty(shape, dtype="<U1")


def check_complete(served: ServedVersion, inputs: Mapping[str, object]) -> None:
    """`BadRequest` naming the inputs `served` declares that `inputs` lacks."""
    missing = sorted(set(served.input_specs) - set(inputs))
    if missing:
        raise BadRequest(
            f"expected {len(served.input_specs)} inputs but got {len(inputs)} inputs for model {served.model!r}: "
            f"missing {missing}"
        )


def select_outputs(
    served: ServedVersion, outputs: Mapping[str, Tensor], requested: Iterable[str] | None
) -> list[tuple[str, Tensor]]:
    """The outputs to return: the requested ones in request order, else all in the model's declared order."""
    if requested is None:
        declared = [spec.name for spec in served.output_specs if spec.name in outputs]
        extra = [name for name in outputs if name not in set(declared)]
        return [(name, outputs[name]) for name in (*declared, *extra)]
    chosen = []
    for name in requested:
        if name not in outputs:
            raise BadRequest(f"unexpected inference output {name!r} for model {served.model!r}")
        chosen.append((name, outputs[name]))
    return chosen


def check_requested(served: ServedVersion, requested: Iterable[str]) -> None:
    """`BadRequest` naming the first requested output that `served` does not declare."""
    declared = {spec.name for spec in served.output_specs}
    for name in requested:
        if name not in declared:
            raise BadRequest(f"unexpected inference output {name!r} for model {served.model!r}")


#: Fixed-size output dtypes met so far: the KServe datatype of each, the little-endian dtype it is sent in, and
#: whether that is the dtype itself.
_SENT_AS: dict[np.dtype[Any], tuple[str, np.dtype[Any], bool]] = {}


def output_tensor(name: str, tensor: Tensor) -> tuple[str, np.ndarray, bytes | memoryview]:
    """An output's KServe datatype, its array, and its bytes (BYTES laid out; fixed-size types as a view)."""
    if not isinstance(tensor, np.ndarray):
        raise ServerError(f"output {name!r} is a nested tensor, which the KServe v2 protocol cannot carry")
    sent = _SENT_AS.get(tensor.dtype)
    if sent is None:
        try:
            datatype = datatype_of_array(tensor, tensor=name)
        except TypeError as exc:
            raise ServerError(str(exc)) from exc
        if datatype == "BYTES":
            return datatype, tensor, encode_bytes_elements(tensor)
        little = tensor.dtype.newbyteorder("<")
        sent = _SENT_AS[tensor.dtype] = (datatype, little, little == tensor.dtype)
    if sent[2] and tensor.ndim:
        # Already in the dtype it is sent in: its bytes as they lie, unless they are not C-contiguous, which the
        # cast refuses. (A scalar goes through `ascontiguousarray`, which makes it shape [1].)
        try:
            return sent[0], tensor, tensor.data.cast("B")
        except TypeError:
            pass
    array = np.ascontiguousarray(tensor, dtype=sent[1])
    return sent[0], array, array.data.cast("B")


def translate_error(exc: BaseException, scrub: Callable[[str], str], served: ServedVersion) -> ServerError:
    """The `ServerError` to answer a failed inference of `served` with.

    Messages say what happened to the model in the server's words, from the exception's attributes: no runner entry
    points, pids, runner logs or server paths (the model's own error text is kept, scrubbed of paths). Inputs the
    host or the runner refused are the client's fault (400); a request timeout is a 503, like Triton's; a runner
    that died or went over a limit is a 500; unknown failures are not detailed.
    """
    if isinstance(exc, ServerError):
        return exc
    if isinstance(exc, InvalidInput):
        return BadRequest(scrub(str(exc)))
    model = f"model {served.model!r} version {served.version_str}"
    if isinstance(exc, RunnerTimeout):
        limit = exc.limit_seconds
        within = f" within the server's request timeout of {limit:g} s" if limit is not None else " in time"
        _log.warning("%s: %s", model, exc)
        return ModelUnavailable(
            f"{model} did not answer{within}; the request was abandoned and the model is restarted for the next one"
        )
    if isinstance(exc, ModelClosed):
        return ModelUnavailable(f"{model} was unloaded while it ran; retry the request")
    if isinstance(exc, (RunnerMemoryLimit, RunnerCPULimit, RunnerCrashed)):
        _log.warning("%s: %s", model, exc)
        if isinstance(exc, RunnerMemoryLimit):
            return ServerError(f"{model} went over the server's memory limit for a model while running the request")
        what = "went over the server's CPU-time limit for a model" if isinstance(exc, RunnerCPULimit) else "crashed"
        return ServerError(f"{model} {what} while running the request; it is restarted for the next request")
    if isinstance(exc, RunnerFailed) and exc.remote_message is not None:
        return ServerError(f"{model} failed: {scrub(exc.remote_message)}")
    if isinstance(exc, InvalidOutput):
        return ServerError(f"{model} failed: {scrub(str(exc))}")
    if isinstance(exc, CartonError):
        _log.error("%s failed", model, exc_info=exc)
        return ServerError(f"{model} failed while running the request (see the server log)")
    _log.error("inference failed with an unexpected error", exc_info=exc)
    return ServerError("internal error while running the model (see the server log)")


def request_failed(
    served: ServedVersion,
    exc: BaseException,
    scrub: Callable[[str], str],
    *,
    started_ns: int,
    decoded_ns: int = 0,
    inferred_ns: int = 0,
) -> ServerError:
    """End a failed inference of `served` (HTTP or gRPC): release the version, count the failure, and return the
    error to answer with. `inferred_ns`, if not 0, says the model ran (from `decoded_ns`) before the request failed:
    a version called through `ServedVersion.direct` counts that execution here (`ServedVersion.infer` counts its
    own)."""
    served.exit()
    stats = served.stats
    if inferred_ns and served.direct is not None:
        stats.record_execution(batch_size=1, infer_ns=inferred_ns - decoded_ns)
    now = perf_counter_ns()
    stats.record_failure(total_ns=now - started_ns, now_ns=now)
    return translate_error(exc, scrub, served)


def request_succeeded(served: ServedVersion, *, started_ns: int, decoded_ns: int, inferred_ns: int) -> None:
    """End a successful inference of `served`: record its timings and release the version. A version called
    through `ServedVersion.direct` (every caller calls it so when it has one) counts the request and its execution
    in one record; one that batches had its execution counted by `ServedVersion.infer`."""
    try:
        now = perf_counter_ns()
        if served.direct is not None:
            served.stats.record_single(
                total_ns=now - started_ns, input_ns=decoded_ns - started_ns, output_ns=now - inferred_ns,
                infer_ns=inferred_ns - decoded_ns, now_ns=now,
            )  # fmt: skip
        else:
            served.stats.record_success(
                total_ns=now - started_ns, input_ns=decoded_ns - started_ns, output_ns=now - inferred_ns, now_ns=now
            )
    finally:
        served.exit()


def json_elements(array: np.ndarray) -> list[Any]:
    """An output's elements for the JSON ``data`` field (row-major, flattened)."""
    flat = array.ravel(order="C")
    if flat.dtype.kind == "S":
        return [element.decode("utf-8", errors="replace") for element in flat.tolist()]
    return flat.tolist()
