"""The gRPC endpoints: ``inference.GRPCInferenceService`` over the HTTP side's repository.

`GrpcService` holds the protocol's methods, each taking a request message and returning the response message (a
refused request raises `ServerError`); ``carton serve`` serves them over HTTP/2 with `._grpc_transport` (on `._http2`;
why not grpcio's server: docs/server.md, "The gRPC server"), ``carton.ray``'s ingress through Ray Serve's gRPC proxy.
Messages are the ones generated from ``_proto/kserve_v2.proto`` into carton's own proto package (see `._proto` for
why). Failures map to gRPC status codes the way Triton maps them, by `carton.server.errors.STATUS`: bad input
``INVALID_ARGUMENT``, unknown model ``NOT_FOUND``, upload disabled ``PERMISSION_DENIED``, a request timeout
``UNAVAILABLE``, anything else ``INTERNAL``.
Outputs always travel in ``raw_output_contents``, as Triton sends them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
from carton_protocol import DType, Tensor

from ._bounded import remember
from ._datatypes import DATATYPE_OF, NUMPY_OF, counted
from ._grpc_plan import KnownRequest, ResponsePrefixes
from ._handle import metadata_shape
from ._http import EXTENSIONS, RepositoryControl, ServerControl, ServerTotals
from ._inference import (
    check_complete,
    check_requested,
    element_count,
    expected_datatype,
    from_bytes_elements,
    from_raw,
    output_tensor,
    request_failed,
    request_succeeded,
    select_outputs,
)
from ._proto import message_class
from ._repository import ModelRepository, ServedVersion
from .errors import BadRequest, ModelNotFound, ModelUnavailable, ServerError

__all__ = ["GrpcService", "message_type", "status_of"]

# Which typed-contents field carries each datatype when a client does not send raw bytes.
_CONTENTS_FIELD = {
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
}  # fmt: skip

_M = {
    name: message_class(name)
    for name in (
        "ServerLiveRequest", "ServerLiveResponse", "ServerReadyRequest", "ServerReadyResponse", "ModelReadyRequest",
        "ModelReadyResponse", "ServerMetadataRequest", "ServerMetadataResponse", "ModelMetadataRequest",
        "ModelMetadataResponse", "ModelInferRequest", "ModelInferResponse", "ModelStreamInferResponse",
        "ModelConfigRequest", "ModelConfigResponse", "ModelStatisticsRequest", "ModelStatisticsResponse",
        "RepositoryIndexRequest", "RepositoryIndexResponse", "RepositoryModelLoadRequest",
        "RepositoryModelLoadResponse", "RepositoryModelUnloadRequest", "RepositoryModelUnloadResponse",
    )
}  # fmt: skip


def message_type(name: str) -> Any:
    """The generated message class of the protocol's message `name` (e.g. ``"ModelInferRequest"``)."""
    return _M[name]


def status_of(exc: ServerError) -> grpc.StatusCode:
    """The gRPC status a refused request is answered with."""
    return grpc.StatusCode[exc.grpc_status]


def _decode_input(served: ServedVersion, tensor: Any, raw: bytes | None) -> np.ndarray:
    name = tensor.name
    dtype = expected_datatype(served, name, tensor.datatype)
    shape = tensor.shape[:]
    if raw is not None:
        return from_raw(memoryview(raw), dtype, shape, tensor=name)
    count = element_count(shape, tensor=name)
    if dtype is DType.STRING:
        elements = tensor.contents.bytes_contents[:]
        if len(elements) != count:
            raise BadRequest(
                f"input {name!r}: {counted(len(elements), 'bytes_contents element')} but shape {shape} needs {count}"
            )
        return from_bytes_elements(elements, shape, tensor=name)
    datatype = DATATYPE_OF[dtype]
    values = getattr(tensor.contents, _CONTENTS_FIELD[datatype])
    if len(values) != count:
        raise BadRequest(
            f"input {name!r}: {counted(len(values), _CONTENTS_FIELD[datatype] + ' element')} but shape {shape} "
            f"needs {count}"
        )
    try:
        return np.array(values, dtype=NUMPY_OF[datatype]).reshape(shape)
    except (OverflowError, ValueError) as exc:
        raise BadRequest(f"input {name!r}: an element does not fit {datatype} ({exc})") from exc


#: Input plans kept per model version (`_decode_request`).
_PLANS = 256
# Read as a global: an attribute of the numpy module is looked up generically on every use.
_ndarray = np.ndarray


_Decoded = tuple[dict[str, np.ndarray], Sequence[str] | None]
_Described = list[tuple[str, str, tuple[int, ...]]]


def _decode_request(served: ServedVersion, request: Any) -> _Decoded:
    """A ``ModelInferRequest``'s inputs as arrays for `served`, and the names of the outputs it asks for (None: all).
    `BadRequest` naming the field or tensor at fault. A `KnownRequest` comes here when `_decode_known` had no plan for
    it: it is parsed by upb and decoded in full, which makes the plan (or says what is wrong)."""
    if type(request) is KnownRequest:
        request = _M["ModelInferRequest"].FromString(request.message)
    # The repeated fields are taken as lists (a slice, one call): iterating the message's own containers ends each
    # loop with an `IndexError` made and formatted in C.
    raw = request.raw_input_contents[:]
    tensors = request.inputs[:]
    inputs: dict[str, np.ndarray] | None = None
    key: tuple[tuple[str, str, tuple[int, ...]], ...] | None = None
    if raw and len(raw) == len(tensors):
        # Raw inputs of names, datatypes and shapes already checked against `served` (a client repeats them): the
        # arrays are laid over the bytes at once, or the full decoding below says what is wrong with them.
        fields = []  # a loop, not a comprehension: that is a function object and a frame per request on 3.11
        for tensor in tensors:
            fields.append((tensor.name, tensor.datatype, tuple(tensor.shape[:])))
        key = tuple(fields)
        plan = served.input_plans.get(key)
        if plan is not None:
            inputs = {}
            for (name, numpy_dtype, shape, count, size), data in zip(plan, raw, strict=True):
                if len(data) != size:
                    inputs = None
                    break
                inputs[name] = np.frombuffer(data, numpy_dtype, count).reshape(shape)
    if inputs is None:
        inputs = _decode_inputs(served, tensors, raw)
        if key is not None and all(array.dtype.kind not in "OU" for array in inputs.values()):
            plan = tuple((name, array.dtype, array.shape, array.size, array.nbytes) for name, array in inputs.items())
            remember(served.input_plans, key, plan, _PLANS)
    requested: list[str] | None = None
    outputs = request.outputs[:]
    if outputs:
        requested = []
        for output in outputs:
            if "classification" in output.parameters:
                raise BadRequest("the classification extension is not supported by this server")
            requested.append(output.name)
        check_requested(served, requested)
    return inputs, requested


def _decode_known(served: ServedVersion, request: KnownRequest) -> _Decoded | None:
    """A request of a learnt form decoded as `_decode_request` decodes one with a known input plan; None without one
    (the version is new, or its plan was forgotten)."""
    form = request.form
    # The form's inputs placed for this version, kept once the form's sizes matched its plan and its requested
    # outputs were found declared (a form is kept by identity: its fields are not hashed per request).
    places = served.form_places.get(form)
    if places is None:
        plan = served.input_plans.get(form.key)
        if plan is None or form.sizes != tuple(entry[4] for entry in plan):
            return None
        if form.requested is not None:
            check_requested(served, form.requested)
        places = tuple(
            (name, numpy_dtype, shape, count, offset, size, offset % numpy_dtype.alignment == 0)
            for (name, numpy_dtype, shape, count, size), offset in zip(plan, form.offsets, strict=True)
        )
        remember(served.form_places, form, places, _PLANS)
    message = request.message
    inputs = {}
    for name, numpy_dtype, shape, count, offset, size, aligned in places:
        if aligned:  # one array over the message's bytes, made in one call
            inputs[name] = _ndarray(shape, numpy_dtype, message, offset)
        else:  # an aligned copy, as upb's bytes would be
            inputs[name] = np.frombuffer(message[offset : offset + size], numpy_dtype, count).reshape(shape)
    return inputs, form.requested


def _decode_inputs(served: ServedVersion, tensors: Any, raw: Any) -> dict[str, np.ndarray]:
    if raw and len(raw) != len(tensors):
        raise BadRequest(f"raw_input_contents has {len(raw)} entries for {len(tensors)} inputs; give one per input")
    inputs: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(tensors):
        if tensor.name in inputs:
            raise BadRequest(f"input {tensor.name!r} is given twice")
        inputs[tensor.name] = _decode_input(served, tensor, raw[index] if raw else None)
    check_complete(served, inputs)
    return inputs


def _outputs(
    served: ServedVersion, outputs: Mapping[str, Tensor], requested: Sequence[str] | None
) -> tuple[_Described, list[bytes | memoryview]]:
    """The response's outputs: each one's name, datatype and shape, and each one's bytes."""
    described = []
    datas = []
    for name, tensor in select_outputs(served, outputs, requested):
        datatype, array, data = output_tensor(name, tensor)
        described.append((name, datatype, array.shape))
        datas.append(data)
    return described, datas


def _message(
    served: ServedVersion, request_id: str, outputs: Mapping[str, Tensor], requested: Sequence[str] | None
) -> Any:
    """The ``ModelInferResponse`` message of `outputs` (`_response`)."""
    described, datas = _outputs(served, outputs, requested)
    return _response(served, request_id, described, datas)


def _response(served: ServedVersion, request_id: str, described: _Described, datas: list[Any]) -> Any:
    """The ``ModelInferResponse``: output tensors described in ``outputs``, their bytes in ``raw_output_contents``.
    (Giving both lists to the constructor at once measured slower than adding to the message's fields; fields are
    set as attributes: keyword arguments are looked up by name in the message's descriptor, one by one.)"""
    response = _M["ModelInferResponse"]()
    response.model_name = served.model
    response.model_version = served.version_str
    response.id = request_id
    for (name, datatype, shape), data in zip(described, datas, strict=True):
        output = response.outputs.add()
        output.name = name
        output.datatype = datatype
        output.shape.extend(shape)
        response.raw_output_contents.append(bytes(data))
    return response


class GrpcService:
    """The protocol's methods over `repository`: `unary_methods` by name, and `model_stream_infer`.

    Server readiness, the repository index, load and unload go to `control` (by default `repository` itself);
    ``carton.ray``'s ingress gives a control over its replicas' reports and no repository (it forwards the methods
    about a model to a replica, which runs them on its own `GrpcService`)."""

    def __init__(
        self,
        repository: ModelRepository | None,
        *,
        server_version: str,
        control: ServerControl | None = None,
        totals: ServerTotals | None = None,
    ) -> None:
        if control is None:
            if repository is None:
                raise ValueError("GrpcService needs a repository or a control")
            control = RepositoryControl(repository)
        self._repository = repository
        self.control = control
        self.totals = totals
        self.server_version = server_version
        self._prefixes = ResponsePrefixes()

    @property
    def repository(self) -> ModelRepository:
        if self._repository is None:  # the ingress forwards the methods that need one
            raise ModelNotFound("this server holds no models itself")
        return self._repository

    def unary_methods(self) -> dict[str, Callable[[Any], Awaitable[Any]]]:
        """The unary methods by their protocol names; each takes the request message and returns the response (a
        refused request raises `ServerError`)."""
        return {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ModelReady": self.model_ready,
            "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata,
            "ModelInfer": self.model_infer,
            "ModelConfig": self.model_config,
            "ModelStatistics": self.model_statistics,
            "RepositoryIndex": self.repository_index,
            "RepositoryModelLoad": self.repository_load,
            "RepositoryModelUnload": self.repository_unload,
        }

    # ---- health and metadata -------------------------------------------------------------------------------------
    async def server_live(self, request: Any) -> Any:
        """``ServerLive``: always live while the server runs."""
        return _M["ServerLiveResponse"](live=True)

    async def server_ready(self, request: Any) -> Any:
        """``ServerReady``: ready once no model is loading or unloading."""
        return _M["ServerReadyResponse"](ready=await self.control.is_ready())

    async def model_ready(self, request: Any) -> Any:
        """``ModelReady``: whether the named model (version) is ready."""
        return _M["ModelReadyResponse"](ready=self.repository.model_ready(request.name, request.version))

    async def server_metadata(self, request: Any) -> Any:
        """``ServerMetadata``: the server's name, version and extensions."""
        return _M["ServerMetadataResponse"](name="carton", version=self.server_version, extensions=EXTENSIONS)

    async def model_metadata(self, request: Any) -> Any:
        """``ModelMetadata``: a model's versions and declared tensors (``NOT_FOUND`` if unknown)."""
        served = self.repository.get(request.name, request.version)
        response = _M["ModelMetadataResponse"](
            name=served.model,
            versions=[v.version_str for v in self.repository.versions(request.name)],
            platform="carton",
        )
        for spec in served.input_specs.values():
            response.inputs.add(name=spec.name, datatype=DATATYPE_OF[spec.dtype], shape=metadata_shape(spec))
        for spec in served.output_specs:
            response.outputs.add(name=spec.name, datatype=DATATYPE_OF[spec.dtype], shape=metadata_shape(spec))
        return response

    async def model_config(self, request: Any) -> Any:
        """``ModelConfig``: the model's configuration as Triton reports it."""
        from google.protobuf import json_format

        from ._http import model_config_json

        served = self.repository.get(request.name, request.version)
        response = _M["ModelConfigResponse"]()
        json_format.ParseDict(model_config_json(served, self.repository.options.workers), response.config)
        return response

    async def model_statistics(self, request: Any) -> Any:
        """``ModelStatistics``: inference statistics of one model (version) or of all."""
        from google.protobuf import json_format

        if self.totals is not None:  # several server processes: their statistics added up
            entries = await self.totals.statistics(request.name, request.version)
            response = _M["ModelStatisticsResponse"]()
            json_format.ParseDict({"model_stats": entries}, response)
            return response
        if request.name:
            served = self.repository.get(request.name, request.version)
            versions = [served] if request.version else self.repository.versions(request.name)
        else:
            versions = self.repository.all_served()
        response = _M["ModelStatisticsResponse"]()
        json_format.ParseDict({"model_stats": [v.stats.to_json() for v in versions]}, response)
        return response

    # ---- repository ----------------------------------------------------------------------------------------------
    async def repository_index(self, request: Any) -> Any:
        """``RepositoryIndex``: every model of the repository and its state."""
        response = _M["RepositoryIndexResponse"]()
        for entry in await self.control.index(ready_only=request.ready):
            response.models.add(**entry)
        return response

    async def repository_load(self, request: Any) -> Any:
        """``RepositoryModelLoad``: (re)load a model, optionally with a config and uploaded files."""
        config: str | None = None
        files: dict[str, bytes] = {}
        for key, parameter in request.parameters.items():
            choice = parameter.WhichOneof("parameter_choice")
            if key == "config":
                if choice != "string_param":
                    raise BadRequest("load parameter 'config' must be a string holding the JSON model config")
                config = parameter.string_param
            elif key.startswith("file:"):
                if choice != "bytes_param":
                    raise BadRequest(f"load parameter {key!r} must be a bytes parameter holding the file")
                files[key] = parameter.bytes_param
            else:
                raise BadRequest(f"unknown load parameter {key!r} (expected 'config' or 'file:<version>/<path>')")
        await self.control.load(request.model_name, config=config, files=files)
        return _M["RepositoryModelLoadResponse"]()

    async def repository_unload(self, request: Any) -> Any:
        """``RepositoryModelUnload``: unload a model (``unload_dependents`` is accepted)."""
        dependents = False
        if "unload_dependents" in request.parameters:
            parameter = request.parameters["unload_dependents"]
            if parameter.WhichOneof("parameter_choice") != "bool_param":
                raise BadRequest("'unload_dependents' must be a bool parameter")
            dependents = parameter.bool_param
        await self.control.unload(request.model_name, unload_dependents=dependents)
        return _M["RepositoryModelUnloadResponse"]()

    # ---- inference -----------------------------------------------------------------------------------------------
    async def model_infer(self, request: Any) -> Any:
        """``ModelInfer``: one inference; failures are answered with the status of `carton.server.errors.STATUS`."""
        return await self._infer(request, _message)

    def model_infer_serialized(self, request: Any) -> Coroutine[Any, Any, bytes]:
        """``ModelInfer`` of a request upb parsed or a `KnownRequest` (`RequestForms`), answered with the response's
        bytes (a coroutine: `_infer`'s own, without one more around it)."""
        return self._infer(request, self._serialized)

    def _serialized(
        self, served: ServedVersion, request_id: str, outputs: Mapping[str, Tensor], requested: Sequence[str] | None
    ) -> bytes:
        described, datas = _outputs(served, outputs, requested)
        key = (served.model, served.version_str, tuple(described))
        payload = self._prefixes.serialize(key, request_id, datas)
        if payload is None:
            payload = self._prefixes.learn(key, request_id, datas, _response(served, request_id, described, datas))
        return payload

    async def _infer(self, request: Any, build: Callable[..., Any]) -> Any:
        """One inference of `request`, answered with `build` of its outputs (`_message` or `_serialized`)."""
        started = time.perf_counter_ns()
        # The attribute, not the property (a property is a call from C on every use).
        repository = self._repository if self._repository is not None else self.repository
        served = repository.acquire(request.model_name, request.model_version)
        # A version that runs each request as an execution of its own is called directly (no `ServedVersion.infer`
        # between), its execution counted with the request, as the HTTP side does; `inferred_at` says whether the
        # model ran.
        direct = served.direct
        decoded_at = inferred_at = 0
        try:
            # A request of a learnt form is decoded at once (`_decode_request` would first test its type).
            decoded = _decode_known(served, request) if type(request) is KnownRequest else None
            inputs, requested = decoded if decoded is not None else _decode_request(served, request)
            decoded_at = time.perf_counter_ns()
            if direct is not None:
                outputs = await direct(inputs)
            else:
                outputs, _ = await served.infer(inputs)
            inferred_at = time.perf_counter_ns()
            response = build(served, request.id, outputs, requested)
        except asyncio.CancelledError:
            # The client cancelled (or the server is stopping): release the version and count the request, as any
            # failed one, so an unload does not wait for it.
            cancelled = ModelUnavailable("the call was cancelled")
            request_failed(served, cancelled, repository.scrub, started_ns=started)
            raise
        except Exception as exc:
            raise request_failed(
                served, exc, repository.scrub, started_ns=started, decoded_ns=decoded_at, inferred_ns=inferred_at
            ) from exc
        request_succeeded(served, started_ns=started, decoded_ns=decoded_at, inferred_ns=inferred_at)
        return response

    async def model_stream_infer(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``ModelStreamInfer``: each request answered in turn; a failure becomes that response's ``error_message``."""
        async for request in requests:
            try:
                response = await self.model_infer(request)
            except ServerError as exc:
                yield _M["ModelStreamInferResponse"](error_message=str(exc))
            else:
                yield _M["ModelStreamInferResponse"](infer_response=response)
