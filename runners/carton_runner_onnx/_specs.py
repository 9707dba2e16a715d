"""Between onnxruntime's view of a graph (``NodeArg``: name, ``tensor(float)``, dims) and carton's `TensorSpec`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carton_protocol import DType, TensorSpec

from ._errors import OnnxRunnerError, UnsupportedTensorType

__all__ = ["ORT_TYPES", "Binding", "bind", "spec_from_node_arg"]

#: onnxruntime's type strings for the element types carton declares.
ORT_TYPES: dict[str, DType] = {
    "tensor(float)": DType.FLOAT32,
    "tensor(double)": DType.FLOAT64,
    "tensor(string)": DType.STRING,
    "tensor(int8)": DType.INT8,
    "tensor(int16)": DType.INT16,
    "tensor(int32)": DType.INT32,
    "tensor(int64)": DType.INT64,
    "tensor(uint8)": DType.UINT8,
    "tensor(uint16)": DType.UINT16,
    "tensor(uint32)": DType.UINT32,
    "tensor(uint64)": DType.UINT64,
}


def spec_from_node_arg(arg: Any, *, kind: str, shape_known: bool = True) -> TensorSpec:
    """A TensorSpec named like the graph's tensor; unnamed dims become ``"*"``, unknown shapes ``"*"``."""
    dtype = ORT_TYPES.get(arg.type)
    if dtype is None:
        supported = ", ".join(sorted(ORT_TYPES))
        raise UnsupportedTensorType(
            f"graph {kind} {arg.name!r} has type {arg.type}, which a carton cannot declare (supported: {supported})"
        )
    shape: str | tuple[int | str, ...] = "*"
    if shape_known and arg.shape is not None:
        shape = tuple(_dim(dim) for dim in arg.shape)
    return TensorSpec(name=arg.name, dtype=dtype, shape=shape)


def _dim(dim: int | str | None) -> int | str:
    if isinstance(dim, int) and dim >= 0:
        return dim
    if isinstance(dim, str) and dim:
        return dim
    return "*"


@dataclass(frozen=True, slots=True, kw_only=True)
class Binding:
    """Carton tensor names paired with graph tensor names, in declaration order."""

    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]


def bind(session: Any, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> Binding:
    """Map declared tensors to graph tensors (``internal_name`` or else ``name``) and check they exist and agree.

    With nothing declared, carton names are the graph's names.
    """
    graph_inputs = {arg.name: arg for arg in session.get_inputs()}
    graph_inputs.update({arg.name: arg for arg in session.get_overridable_initializers()})
    graph_outputs = {arg.name: arg for arg in session.get_outputs()}
    if not inputs:
        input_pairs = tuple((name, name) for name in graph_inputs if name in _required(session))
    else:
        input_pairs = tuple(_pair(spec, graph_inputs, kind="input") for spec in inputs)
        missing = sorted(_required(session) - {graph_name for _, graph_name in input_pairs})
        if missing:
            raise OnnxRunnerError(
                f"the graph needs input(s) {', '.join(map(repr, missing))} that carton.toml does not declare "
                f"(declare them, or map a declared input to them with internal_name)"
            )
    if not outputs:
        output_pairs = tuple((name, name) for name in graph_outputs)
    else:
        output_pairs = tuple(_pair(spec, graph_outputs, kind="output") for spec in outputs)
    return Binding(inputs=input_pairs, outputs=output_pairs)


def _required(session: Any) -> set[str]:
    return {arg.name for arg in session.get_inputs()}


def _pair(spec: TensorSpec, graph_tensors: dict[str, Any], *, kind: str) -> tuple[str, str]:
    graph_name = spec.internal_name or spec.name
    arg = graph_tensors.get(graph_name)
    via = f" (internal_name of {spec.name!r})" if spec.internal_name else ""
    if arg is None:
        known = ", ".join(map(repr, graph_tensors)) or "none"
        raise OnnxRunnerError(f"declared {kind} {spec.name!r}: the graph has no {kind} {graph_name!r}{via}; "
                              f"graph {kind}s: {known}")
    graph_dtype = ORT_TYPES.get(arg.type)
    if graph_dtype is not None and graph_dtype != spec.dtype:
        raise OnnxRunnerError(
            f"declared {kind} {spec.name!r} has dtype {spec.dtype.value} but graph {kind} {graph_name!r}{via} "
            f"is {arg.type}"
        )
    if graph_dtype is None:
        raise UnsupportedTensorType(
            f"declared {kind} {spec.name!r}: graph {kind} {graph_name!r}{via} has type {arg.type}, "
            f"which a carton cannot carry"
        )
    return spec.name, graph_name
