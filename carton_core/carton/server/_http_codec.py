"""The HTTP/REST inference body: JSON tensors and the binary tensor data extension, both directions.

A request body is a JSON header, optionally followed by binary tensor data when ``Inference-Header-Content-Length``
gives the header's length; with that header at 0 the whole body is one input's raw data (the raw binary request).
Binary inputs become numpy arrays over the body's own bytes (no copy); binary outputs are sent from the output
arrays' memory.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import orjson
from carton_protocol import DType, Tensor

from ._bounded import remember
from ._datatypes import DATATYPE_OF, NUMPY_OF, counted
from ._http_messages import DIGITS, read_digits
from ._inference import (
    check_complete,
    check_requested,
    element_count,
    expected_datatype,
    from_bytes_elements,
    from_raw,
    json_elements,
    output_tensor,
    select_outputs,
)
from ._json_numbers import WRITTEN_KINDS, array_spans, array_text, element_type, nested_list, read_numbers
from ._repository import ServedVersion
from .errors import BadRequest

__all__ = [
    "InferBody",
    "encode_binary_response",
    "encode_infer_response",
    "parse_infer_request",
    "planned_request",
    "unplanned_request",
]

_DIGITS = re.compile(rb"^\s*[0-9]+\s*$")


class InferBody(msgspec.Struct, kw_only=True):
    """A decoded inference request (a struct rather than a dataclass: it is made on every request, and a struct is
    made without a Python-level ``__init__``)."""

    id: str | None
    inputs: dict[str, np.ndarray]
    #: Requested outputs with their binary flag, or ``None`` for all outputs (a planned request's are its plan's
    #: own tuple: never changed in place).
    outputs: Sequence[tuple[str, bool]] | None
    binary_default: bool
    #: Known from a plan: every output the response carries is binary, and the requested outputs' names (None: all).
    binary_only: bool = False
    names: tuple[str, ...] | None = None


def _parameters(value: object, *, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{where}.parameters must be a JSON object")
    return value


def _flag(parameters: dict[str, Any], key: str, *, where: str) -> bool | None:
    value = parameters.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise BadRequest(f"{where}: parameter {key!r} must be true or false, got {value!r}")


def _json_tensor(data: object, dtype: DType, shape: Sequence[int], *, tensor: str) -> np.ndarray:
    count = element_count(shape, tensor=tensor)
    array: np.ndarray | None = None
    if isinstance(data, msgspec.Raw):
        if dtype is not DType.STRING:
            array = read_numbers(memoryview(data), NUMPY_OF[DATATYPE_OF[dtype]], count)
        if array is None:
            try:
                data = orjson.loads(memoryview(data))
            except orjson.JSONDecodeError as exc:  # a span cut out of the header unread (`_cut_large_arrays`)
                raise BadRequest(f"the inference request header is not valid JSON: {exc}") from exc
    if array is None and dtype is not DType.STRING:
        array = _json_numbers(data, NUMPY_OF[DATATYPE_OF[dtype]])
    if array is not None:
        if array.size != count:
            raise BadRequest(
                f"input {tensor!r}: 'data' holds {counted(array.size, 'element')} but shape {list(shape)} needs {count}"
            )
        return array.reshape(shape)
    # Anything the fast path does not take (strings, ragged nesting, a wrong element) is checked element by element,
    # which also names what is wrong.
    flat: list[Any] = []
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            flat.append(item)
    if len(flat) != count:
        raise BadRequest(
            f"input {tensor!r}: 'data' holds {counted(len(flat), 'element')} but shape {list(shape)} needs {count}"
        )
    if dtype is DType.STRING:
        if not all(isinstance(element, str) for element in flat):
            raise BadRequest(f"input {tensor!r}: BYTES 'data' elements must be strings")
        return from_bytes_elements([element.encode() for element in flat], shape, tensor=tensor)
    numpy_dtype = NUMPY_OF[DATATYPE_OF[dtype]]
    integral = numpy_dtype.kind in "iu"
    for element in flat:
        wrong = isinstance(element, bool) or not isinstance(element, int | float)
        if wrong or (integral and isinstance(element, float)):
            kind = "integers" if integral else "numbers"
            raise BadRequest(f"input {tensor!r}: {DATATYPE_OF[dtype]} 'data' elements must be {kind}, got {element!r}")
    try:
        return np.array(flat, dtype=numpy_dtype).reshape(shape)
    except (OverflowError, ValueError) as exc:
        raise BadRequest(f"input {tensor!r}: a 'data' element does not fit {DATATYPE_OF[dtype]} ({exc})") from exc


#: Elements converted per numpy call: the decoding thread gives the event loop's thread the GIL between calls.
_CHUNK = 1 << 18


#: Nesting deeper than this is left to the element-by-element path (the conversion type is built recursively).
_MAX_TYPED_DEPTH = 32


def _json_numbers(data: object, numpy_dtype: np.dtype[Any]) -> np.ndarray | None:
    """`data` (a flat or evenly nested JSON list of numbers) as an array of `numpy_dtype`, in C, or None when it
    is anything else (the caller's element-by-element path then names the fault).

    msgspec checks the element types as the element-by-element path does (no booleans, no strings, integers only for
    integer types) without a Python-level loop; numpy converts in chunks."""
    depth = 0
    probe = data
    while isinstance(probe, list):
        depth += 1
        probe = probe[0] if probe else None
    if depth == 0 or depth > _MAX_TYPED_DEPTH:
        return None
    try:
        checked = msgspec.convert(data, nested_list(element_type(numpy_dtype), depth))
        if depth > 1:
            return np.array(checked, dtype=numpy_dtype)
        array = np.empty(len(checked), dtype=numpy_dtype)
        for start in range(0, len(checked), _CHUNK):
            part = checked[start : start + _CHUNK]
            array[start : start + len(part)] = np.fromiter(part, numpy_dtype, len(part))
        return array
    except (msgspec.ValidationError, OverflowError, ValueError, TypeError):
        return None


#: A JSON header at least this large is decoded with its tensors' ``data`` left as raw text (`_decode_header`).
_LIFT_BYTES = 1 << 20


class _LiftedInput(msgspec.Struct):
    name: Any = None
    datatype: Any = None
    shape: Any = None
    parameters: Any = None
    data: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class _LiftedHeader(msgspec.Struct):
    id: Any = None
    parameters: Any = None
    inputs: list[_LiftedInput] | None = None
    outputs: Any = None


_LIFTED = msgspec.json.Decoder(_LiftedHeader)


def _decode_header(text: memoryview) -> Any:
    """The request's JSON header. A large one is decoded with each input's ``data`` kept as raw JSON text (parsed
    later off the GIL, `read_numbers`): one parse of millions of numbers into Python objects would hold the GIL,
    and so stall the event loop, for its whole length. Any header that shape does not fit is decoded in full, which
    also gives the error messages."""
    if len(text) >= _LIFT_BYTES:
        document = _decode_without_large_arrays(text)
        if document is not None:
            return document
        try:
            lifted = _LIFTED.decode(text)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        else:
            inputs = None
            if lifted.inputs is not None:
                inputs = [
                    {"name": i.name, "datatype": i.datatype, "shape": i.shape, "parameters": i.parameters}
                    | ({} if i.data is msgspec.UNSET else {"data": i.data})
                    for i in lifted.inputs
                ]
            return {"id": lifted.id, "parameters": lifted.parameters, "inputs": inputs, "outputs": lifted.outputs}
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the inference request header is not valid JSON: {exc}") from exc


#: A flat array at least this long (in bytes of text) is cut out of a large header before it is decoded.
_CUT_BYTES = 1 << 16


def _decode_without_large_arrays(text: memoryview) -> dict[str, Any] | None:
    """A large header decoded without reading its large flat arrays: each is found by numpy scans of the text (which
    release the GIL), cut out and replaced by a placeholder string, the rest is decoded, and each input whose ``data``
    is a placeholder gets its array's text as `msgspec.Raw` (read later off the GIL, `read_numbers`). None when
    the header does not have that plain shape (escapes, an array elsewhere than an input's ``data``): the caller
    decodes it another way."""
    spans = array_spans(text, _CUT_BYTES)
    if not spans:
        return None
    parts: list[bytes] = []
    position = 0
    for number, (start, end) in enumerate(spans):
        parts += [bytes(text[position:start]), b'"\\u0000carton:%d"' % number]
        position = end
    parts.append(bytes(text[position:]))
    try:
        document = orjson.loads(b"".join(parts))
    except orjson.JSONDecodeError:
        return None
    inputs = document.get("inputs") if isinstance(document, dict) else None
    placed = 0
    for entry in inputs if isinstance(inputs, list) else ():
        data = entry.get("data") if isinstance(entry, dict) else None
        if isinstance(data, str) and data.startswith("\x00carton:"):
            start, end = spans[int(data[8:])]
            entry["data"] = msgspec.Raw(text[start:end])
            placed += 1
    return document if placed == len(spans) else None


def _raw_request(served: ServedVersion, body: memoryview) -> InferBody:
    if len(served.input_specs) != 1:
        raise BadRequest(
            f"a raw binary request (Inference-Header-Content-Length: 0) needs a model with exactly one input; "
            f"{served.model!r} has {len(served.input_specs)}"
        )
    (spec,) = served.input_specs.values()
    if isinstance(spec.shape, str):
        raise BadRequest(f"the shape of raw input {spec.name!r} cannot be deduced: the model does not declare its rank")
    dims: list[int | None] = [d if isinstance(d, int) else None for d in spec.shape]
    if served.config.max_batch_size > 0 and dims:
        dims[0] = 1
    unknown = [i for i, d in enumerate(dims) if d is None]
    if len(unknown) > 1:
        raise BadRequest(
            f"the shape of raw input {spec.name!r} cannot be deduced: it has more than one variable-size dimension"
        )
    fixed = int(np.prod([d for d in dims if d is not None]))
    if spec.dtype is DType.STRING:
        offset, count = 0, 0
        while offset + 4 <= len(body):
            offset += 4 + int.from_bytes(body[offset : offset + 4], "little")
            count += 1
        total = count
    else:
        itemsize = NUMPY_OF[DATATYPE_OF[spec.dtype]].itemsize
        if len(body) % itemsize:
            raise BadRequest(f"raw input {spec.name!r}: {len(body)} bytes is not a whole number of elements")
        total = len(body) // itemsize
    if unknown:
        if fixed == 0 or total % fixed:
            raise BadRequest(f"raw input {spec.name!r}: {total} elements do not fill its declared shape")
        dims[unknown[0]] = total // fixed
    shape = [int(d) for d in dims if d is not None]
    return InferBody(
        id=None,
        inputs={spec.name: from_raw(body, spec.dtype, shape, tensor=spec.name)},
        outputs=None,
        binary_default=True,
    )


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a binary inference header decoded to, once checked against a model version: a client that sends the same
    header again (tritonclient does, for tensors of one shape) skips the JSON decoding and the checks."""

    request_id: str | None
    #: Per input, in body order: name, numpy dtype, shape, element count, byte size.
    inputs: tuple[tuple[str, np.dtype[Any], tuple[int, ...], int, int], ...]
    #: The body's whole length, header included.
    length: int
    outputs: tuple[tuple[str, bool], ...] | None
    binary_default: bool
    #: Every output the response carries is binary, and the requested outputs' names (None: all).
    binary_only: bool
    names: tuple[str, ...] | None


#: Headers at most this long are remembered (per model version, at most `_PLANS` of them).
_PLAN_HEADER_BYTES = 2048
_PLANS = 256


def planned_request(served: ServedVersion, body: bytes | bytearray, header_length: bytes | None) -> InferBody | None:
    """The usual binary request: its body decoded for `served` when its header was already checked against it and the
    body has the same length as then; else None (`parse_infer_request` decodes it, with the messages)."""
    if header_length is None:
        return None
    json_end = DIGITS.get(header_length)
    if json_end is None:
        json_end = read_digits(header_length)
        if json_end is None:
            return None
    if 0 < json_end <= _PLAN_HEADER_BYTES and json_end <= len(body):  # (not `min`: it parses keywords per call)
        # The header the version's last planned request had, compared in place, before a look-up that would slice
        # and hash it.
        last = served.last_plan
        if last is not None and len(last[0]) == json_end and body.startswith(last[0]):
            plan = last[1]
        else:
            key = bytes(body[:json_end])
            plan = served.request_plans.get(key)
            if plan is not None:
                served.last_plan = (key, plan)
        if plan is not None and plan.length == len(body):
            inputs: dict[str, np.ndarray] = {}
            offset = json_end
            for name, numpy_dtype, shape, _, size in plan.inputs:
                # (The plan's sizes add up to the body's length: each array lies inside it.)
                inputs[name] = np.ndarray(shape, numpy_dtype, body, offset)
                offset += size
            return InferBody(
                id=plan.request_id, inputs=inputs, outputs=plan.outputs, binary_default=plan.binary_default,
                binary_only=plan.binary_only, names=plan.names,
            )  # fmt: skip
    return None


def parse_infer_request(served: ServedVersion, body: bytes | bytearray, header_length: bytes | None) -> InferBody:
    """Decode an inference body for `served`; `BadRequest` naming the header, field or tensor at fault."""
    planned = planned_request(served, body, header_length)
    if planned is not None:
        return planned
    return unplanned_request(served, body, header_length)


def unplanned_request(served: ServedVersion, body: bytes | bytearray, header_length: bytes | None) -> InferBody:
    """`parse_infer_request` of a body `planned_request` did not decode: decoded in full (and its plan kept when it
    has one)."""
    decoded, plan = _parse_infer_request(served, body, header_length)
    if plan is not None:
        remember(served.request_plans, bytes(body[: int(header_length or 0)]), plan, _PLANS)
    return decoded


def _parse_infer_request(
    served: ServedVersion, body: bytes | bytearray, header_length: bytes | None
) -> tuple[InferBody, _Plan | None]:
    view = memoryview(body)
    if header_length is None:
        json_end = len(body)
    else:
        if not _DIGITS.match(header_length):
            raise BadRequest(
                f"Inference-Header-Content-Length must be a non-negative decimal integer, got {header_length[:40]!r}"
            )
        json_end = int(header_length)
        if json_end > len(body):
            raise BadRequest(
                f"Inference-Header-Content-Length {json_end} is larger than the request body ({len(body)} bytes)"
            )
        if json_end == 0:
            return _raw_request(served, view), None
    header = _decode_header(view[:json_end])
    if not isinstance(header, dict):
        raise BadRequest("the inference request header must be a JSON object")
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("'id' must be a string")
    parameters = _parameters(header.get("parameters"), where="request")
    binary_default = bool(_flag(parameters, "binary_data_output", where="request"))
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list):
        raise BadRequest("'inputs' must be a JSON array of tensors")
    inputs: dict[str, np.ndarray] = {}
    # Only headers of fixed-size binary inputs are remembered.
    plannable = 0 < json_end <= _PLAN_HEADER_BYTES
    planned: list[tuple[str, np.dtype[Any], tuple[int, ...], int, int]] = []
    offset = json_end
    for index, raw in enumerate(raw_inputs):
        if not isinstance(raw, dict):
            raise BadRequest(f"inputs[{index}] must be a JSON object")
        name, datatype, shape = raw.get("name"), raw.get("datatype"), raw.get("shape")
        if not isinstance(name, str) or not isinstance(datatype, str) or not isinstance(shape, list):
            raise BadRequest(f"inputs[{index}] needs 'name' and 'datatype' strings and a 'shape' array")
        if name in inputs:
            raise BadRequest(f"input {name!r} is given twice")
        dtype = expected_datatype(served, name, datatype)
        size = _parameters(raw.get("parameters"), where=f"input {name!r}").get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise BadRequest(f"input {name!r}: binary_data_size must be a non-negative integer, got {size!r}")
            if offset + size > len(body):
                raise BadRequest(
                    f"input {name!r}: binary_data_size {size} runs past the end of the request body "
                    f"({len(body) - offset} bytes of binary data left)"
                )
            array = inputs[name] = from_raw(view[offset : offset + size], dtype, shape, tensor=name)
            offset += size
            if dtype is DType.STRING:
                plannable = False
            elif plannable:
                planned.append((name, array.dtype, array.shape, array.size, size))
        elif "data" in raw:
            plannable = False
            inputs[name] = _json_tensor(raw["data"], dtype, shape, tensor=name)
        else:
            raise BadRequest(f"input {name!r} has neither 'data' nor a binary_data_size parameter")
    if offset != len(body):
        raise BadRequest(f"{len(body) - offset} bytes of binary data follow the inputs that none of them claims")
    check_complete(served, inputs)
    outputs: list[tuple[str, bool]] | None = None
    raw_outputs = header.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise BadRequest("'outputs' must be a JSON array")
        outputs = []
        for index, raw in enumerate(raw_outputs):
            if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
                raise BadRequest(f"outputs[{index}] must be an object with a 'name' string")
            output_parameters = _parameters(raw.get("parameters"), where=f"output {raw['name']!r}")
            if "classification" in output_parameters:
                raise BadRequest("the classification extension is not supported by this server")
            binary = _flag(output_parameters, "binary_data", where=f"output {raw['name']!r}")
            outputs.append((raw["name"], binary_default if binary is None else binary))
        check_requested(served, [name for name, _ in outputs])
    decoded = InferBody(id=request_id, inputs=inputs, outputs=outputs, binary_default=binary_default)
    if not plannable:
        return decoded, None
    return decoded, _Plan(
        request_id=request_id,
        inputs=tuple(planned),
        length=len(body),
        outputs=tuple(outputs) if outputs is not None else None,
        binary_default=binary_default,
        binary_only=binary_default if outputs is None else all(binary for _, binary in outputs),
        names=tuple(name for name, _ in outputs) if outputs is not None else None,
    )


#: JSON outputs with at least this many elements are written apart, a slice at a time (`array_text`).
_WRITE_APART_ELEMENTS = 1 << 16


def encode_infer_response(
    served: ServedVersion, request: InferBody, selected: list[tuple[str, Tensor]]
) -> tuple[bytes, list[bytes | memoryview]]:
    """The response's JSON header and the binary parts that follow it (empty when every output is JSON)."""
    if not request.binary_only:
        binary_of = dict(request.outputs) if request.outputs is not None else {}
        default = request.binary_default
        for name, _ in selected:
            if not binary_of.get(name, default):
                return _json_response(served, request, selected)
    return encode_binary_response(served, request, dict(selected), [name for name, _ in selected])


def encode_binary_response(
    served: ServedVersion, request: InferBody, outputs: Mapping[str, Tensor], names: Sequence[str] | None = None
) -> tuple[bytes, list[bytes | memoryview]]:
    """The JSON header and parts of a response whose outputs `names` (taken from `outputs`; by default the request's
    `InferBody.names`, else every output `select_outputs` gives) are all binary: `encode_infer_response` of
    `select_outputs(served, outputs, names)`, in one pass, for a request decoded from a plan whose outputs are all
    binary (`InferBody.binary_only`)."""
    if names is None:
        names = request.names
        if names is None:
            selected = select_outputs(served, outputs, None)
            names = [name for name, _ in selected]
            outputs = dict(selected)
    # The header depends only on the request's id and the outputs' names, datatypes, shapes and sizes, which repeat
    # from request to request. (Plain loops: on this path each comprehension would be one more function object and
    # frame per request.)
    laid_out = []
    parts: list[bytes | memoryview] = []
    described: list[Any] = [request.id]
    for name in names:
        if name not in outputs:
            select_outputs(served, outputs, names)  # raises its refusal of the output the model did not give
        datatype, array, data = output_tensor(name, outputs[name])
        laid_out.append((name, datatype, array, data))
        parts.append(data)
        described.append((name, datatype, array.shape, len(data)))
    key = tuple(described)
    header = served.response_heads.get(key)
    if header is None:
        header = remember(served.response_heads, key, _binary_header(served, request, laid_out), _PLANS)
    return header, parts


def _json_response(
    served: ServedVersion, request: InferBody, selected: list[tuple[str, Tensor]]
) -> tuple[bytes, list[bytes | memoryview]]:
    """`encode_infer_response` of a response with an output in JSON."""
    encoded = _encode_response(served, request, selected, apart=True)
    if encoded is None:  # the request's id or an output's name held a placeholder's text
        encoded = _encode_response(served, request, selected, apart=False)
        assert encoded is not None  # nothing was written apart
    return encoded


def _binary_header(
    served: ServedVersion, request: InferBody, laid_out: list[tuple[str, str, np.ndarray, bytes | memoryview]]
) -> bytes:
    described = [
        {"name": name, "datatype": datatype, "shape": list(array.shape), "parameters": {"binary_data_size": len(data)}}
        for name, datatype, array, data in laid_out
    ]
    return _response_document(served, request, described)


def _response_document(served: ServedVersion, request: InferBody, described: list[dict[str, Any]]) -> bytes:
    """The response's JSON header: the request's id (when it has one), the model, its version and `described`."""
    document: dict[str, Any] = {}
    if request.id:
        document["id"] = request.id
    document["model_name"] = served.model
    document["model_version"] = served.version_str
    document["outputs"] = described
    return orjson.dumps(document)


def _encode_response(
    served: ServedVersion, request: InferBody, selected: list[tuple[str, Tensor]], *, apart: bool
) -> tuple[bytes, list[bytes | memoryview]] | None:
    binary_of = dict(request.outputs) if request.outputs is not None else {}
    described: list[dict[str, Any]] = []
    parts: list[bytes | memoryview] = []
    # Large arrays are written apart (`array_text`) and spliced into the document where their placeholders are.
    texts: list[list[bytes]] = []
    for name, tensor in selected:
        datatype, array, data = output_tensor(name, tensor)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary_of.get(name, request.binary_default):
            entry["parameters"] = {"binary_data_size": len(data)}
            parts.append(data)
        elif apart and array.size >= _WRITE_APART_ELEMENTS and array.dtype.kind in WRITTEN_KINDS:
            entry["data"] = f"\x00carton:{len(texts)}"
            texts.append(array_text(array))
        else:
            entry["data"] = json_elements(array)
        described.append(entry)
    header = _response_document(served, request, described)
    if texts:
        pieces = []
        for number, text in enumerate(texts):
            placeholder = b'"\\u0000carton:%d"' % number
            before, found, header = header.partition(placeholder)
            if not found or placeholder in header:
                return None
            pieces += [before, *text]
        header = b"".join([*pieces, header])  # one copy, with the GIL released (a join of this size lets it go)
    return header, parts
