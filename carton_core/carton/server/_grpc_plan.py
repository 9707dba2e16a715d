"""``ModelInfer`` requests and responses whose bytes repeat a learnt layout, read and written without upb.

A client sends the same request over and over but for its tensors' bytes: the same model, the same inputs' names,
datatypes and shapes, the same requested outputs, each raw input last in ``raw_input_contents``. Protobuf parses the
concatenation of two serialized messages as the merge of both, so a request whose bytes are a learnt head (every
field but the raw inputs) followed by raw-input fields of the learnt sizes means the learnt head's fields with those
raw inputs, exactly: `RequestForms.parse` checks the bytes and gives such a request as a `KnownRequest` (its raw
inputs as offsets into the message), anything else as upb parses it. A response's bytes are, the same way, a prefix
(model and version, then the id, then the outputs' descriptions, serialized once by upb) and the outputs'
raw-bytes fields (`ResponsePrefixes.serialize`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from google.protobuf.message import DecodeError

from ._bounded import remember

__all__ = ["HEAD_LIMIT", "KnownRequest", "RequestForm", "RequestForms", "ResponsePrefixes", "varint"]

# Field tags (field number << 3 | length-delimited): ModelInferRequest.raw_input_contents (7),
# ModelInferResponse.id (3) and ModelInferResponse.raw_output_contents (6).
_RAW_INPUT_TAG = b"\x3a"
_ID_TAG = b"\x1a"
_RAW_OUTPUT = 0x32
_RAW_OUTPUT_TAG = bytes((_RAW_OUTPUT,))
# The field header of each raw output under 128 bytes (a one-byte length), made once.
_SHORT_RAW_OUTPUT_HEADS = tuple(bytes((_RAW_OUTPUT, size)) for size in range(0x80))
# Forms are kept by the length of their requests (a few of each length: clients of other models or layouts).
_LENGTHS = 64
_FORMS_OF_A_LENGTH = 4
# Forms learnt in a row that no request used: past this many, a connection learns no more.
_GIVE_UP = 32
_PREFIXES = 256
# The longest head learnt: a client's usual request has a short one (names, shapes, a few parameters), and a
# connection keeps its forms, so a head as long as a whole message is not worth keeping.
HEAD_LIMIT = 4096


def varint(value: int) -> bytes:
    """A protobuf base-128 varint."""
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RequestForm:
    """A learnt request layout: `head` (every field but the raw inputs), then each raw input's field header (the
    first's ends `head`; the others' are `inner`, at their offsets) and bytes (`sizes`, at `offsets`). Compared and
    hashed by identity: a form is a key of what was checked against it."""

    head: bytes
    inner: tuple[tuple[int, bytes], ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    model_name: str
    model_version: str
    id: str
    key: tuple[tuple[str, str, tuple[int, ...]], ...]  # the inputs' names, datatypes and shapes
    requested: tuple[str, ...] | None  # the requested outputs' names (None: all)


class KnownRequest(msgspec.Struct, gc=False, eq=False):
    """A request of a learnt `form`: its fields are the form's, its raw inputs the slices of `message` at the form's
    offsets. (A struct: made in C, without a Python ``__init__``; it refers to no container, so the garbage
    collector need not track it.)"""

    form: RequestForm
    message: bytes
    model_name: str
    model_version: str
    id: str


class RequestForms:
    """The request layouts learnt from the requests `parse` (upb's ``FromString``) took: one per connection (a
    client repeats its own layout)."""

    def __init__(self, parse: Callable[[bytes], Any]) -> None:
        self._parse = parse
        self._forms: dict[int, list[RequestForm]] = {}
        self._unused = 0  # forms learnt since a request was last of a learnt form

    def parse(self, message: bytes) -> Any:
        """`message` as a `KnownRequest` if it is of a learnt form, else as upb parses it (``DecodeError`` if it is
        not a message)."""
        forms = self._forms.get(len(message))
        if forms is not None:
            for form in forms:
                if message.startswith(form.head) and (
                    not form.inner or all(message[at : at + len(header)] == header for at, header in form.inner)
                ):
                    self._unused = 0
                    return KnownRequest(form, message, form.model_name, form.model_version, form.id)
        request = self._parse(message)
        if self._unused >= _GIVE_UP:
            return request  # a client that does not repeat itself (a new request id each time, say)
        learnt = self._learn(message, request)
        if learnt is not None:
            self._unused += 1
            if forms is None:
                forms = remember(self._forms, len(message), [], _LENGTHS)
            elif len(forms) >= _FORMS_OF_A_LENGTH:
                del forms[0]
            forms.append(learnt)
        return request

    def _learn(self, message: bytes, request: Any) -> RequestForm | None:
        """The form of `message` (parsed as `request`), if its raw inputs come last and the bytes before them parse
        alone into every other field; None if not."""
        raw: list[bytes] = request.raw_input_contents[:]
        tensors = request.inputs[:]
        if not raw or len(raw) != len(tensors):
            return None
        headers = [_RAW_INPUT_TAG + varint(len(data)) for data in raw]
        start = len(message) - sum(map(len, headers)) - sum(map(len, raw))
        if not 0 <= start <= HEAD_LIMIT:
            return None
        at = start
        inner, offsets = [], []
        for index, (header, data) in enumerate(zip(headers, raw, strict=True)):
            if message[at : at + len(header)] != header:
                return None
            if index:
                inner.append((at, header))
            at += len(header)
            if message[at : at + len(data)] != data:
                return None
            offsets.append(at)
            at += len(data)
        try:
            head_request = self._parse(message[:start])
        except DecodeError:
            return None
        if head_request.raw_input_contents:
            return None
        head_request.raw_input_contents.extend(raw)
        if head_request != request:
            return None
        requested: tuple[str, ...] | None = None
        outputs = request.outputs[:]
        if outputs:
            if any("classification" in output.parameters for output in outputs):
                return None  # refused every time, by the full decoding
            requested = tuple(output.name for output in outputs)
        return RequestForm(
            head=message[: start + len(headers[0])],
            inner=tuple(inner),
            offsets=tuple(offsets),
            sizes=tuple(map(len, raw)),
            model_name=request.model_name,
            model_version=request.model_version,
            id=request.id,
            key=tuple((tensor.name, tensor.datatype, tuple(tensor.shape[:])) for tensor in tensors),
            requested=requested,
        )


class ResponsePrefixes:
    """The serialized parts of the responses upb made, by model, version and outputs' names, datatypes and shapes: a
    response's bytes are its head (model and version), its id field, its outputs' descriptions and its outputs'
    raw-bytes fields."""

    def __init__(self) -> None:
        self._parts: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}
        self._id = ""  # the last request id serialized, and its field (a client repeats its id, or sends none)
        self._id_field = b""

    def serialize(self, key: tuple[Any, ...], request_id: str, datas: Sequence[bytes | memoryview]) -> bytes | None:
        """The bytes of the response described by `key` (model, version, the outputs' names, datatypes and shapes)
        with `request_id` and the raw outputs `datas`; None if its parts are not known yet (then `learn`)."""
        parts = self._parts.get(key)
        if parts is None:
            return None
        if request_id != self._id:
            self._id_field = _id_field(request_id)
            self._id = request_id
        joined: list[bytes | memoryview] = [parts[0], self._id_field, parts[1]]
        for data in datas:
            size = len(data)
            joined.append(_SHORT_RAW_OUTPUT_HEADS[size] if size < 0x80 else _RAW_OUTPUT_TAG + varint(size))
            joined.append(data)
        return b"".join(joined)

    def learn(self, key: tuple[Any, ...], request_id: str, datas: Sequence[bytes | memoryview], response: Any) -> bytes:
        """`response` (upb's message of what `serialize` was given) serialized; its parts are kept when `serialize`
        makes exactly those bytes of them."""
        payload: bytes = response.SerializeToString()
        del response.raw_output_contents[:]
        rest: bytes = response.SerializeToString()
        head_message = type(response)(model_name=response.model_name, model_version=response.model_version)
        head: bytes = head_message.SerializeToString()
        before = head + _id_field(request_id)
        if rest.startswith(before):
            # Tried first, outside the bound (a mismatch must not empty the cache): `serialize` reads it.
            parts = self._parts[key] = (head, rest[len(before) :])
            made = self.serialize(key, request_id, datas)
            del self._parts[key]
            if made == payload:
                remember(self._parts, key, parts, _PREFIXES)
        return payload


def _id_field(request_id: str) -> bytes:
    """The response's ``id`` field (proto3: absent when empty)."""
    if not request_id:
        return b""
    encoded = request_id.encode()
    return _ID_TAG + varint(len(encoded)) + encoded
