"""Checking tensors against carton.toml's ``[[input]]``/``[[output]]`` before they leave the host (and after the
runner answers).

Rules (Carton format v1): names must be exactly the declared ones; the dtype must be the declared one (strings are
numpy ``str`` arrays); a shape is ``"*"`` (anything), a symbol naming the whole shape, ``()`` (a scalar) or one entry
per dimension, each an int or a symbol. A symbol must resolve to one value wherever it is used, across all inputs and
outputs of one call; ``"*"`` is free each time it appears. A nested tensor is a list of arrays: its first dimension
is the list's length and the remaining declared dimensions apply to every inner array (a whole-shape symbol on a
nested tensor is not bound).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np
from carton_protocol import DType, Shape, Tensor, TensorSpec

from ..errors import InvalidInput, InvalidOutput

__all__ = ["Checked", "Signature", "numpy_dtype"]

_NUMPY: dict[DType, np.dtype[Any]] = {
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64),
    DType.INT8: np.dtype(np.int8),
    DType.INT16: np.dtype(np.int16),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.UINT8: np.dtype(np.uint8),
    DType.UINT16: np.dtype(np.uint16),
    DType.UINT32: np.dtype(np.uint32),
    DType.UINT64: np.dtype(np.uint64),
    DType.STRING: np.dtype(np.str_),
}


def numpy_dtype(dtype: DType) -> np.dtype[Any]:
    """The numpy dtype carton uses for a declared dtype (``string`` -> ``str``, any length)."""
    return _NUMPY[dtype]


def _dtype_name(actual: np.dtype[Any]) -> str:
    if actual.kind == "U":
        return "str"
    if actual.kind == "S":
        return "bytes"
    if actual.kind == "O":
        return "object"
    return str(actual.newbyteorder("="))


def _show_shape(shape: Shape) -> str:
    if isinstance(shape, str):
        return repr(shape)
    return "[" + ", ".join(repr(d) for d in shape) + "]"


class _Binding(NamedTuple):
    """A symbol's value and where it was bound (the text is only formatted for an error message)."""

    value: int | tuple[int, ...]
    label: str
    place: str
    suffix: str

    @property
    def where(self) -> str:
        return f"{self.label} {self.place}{self.suffix}"


class _Checker:
    """One declared tensor, precompiled; raises ``error`` (InvalidInput or InvalidOutput) naming ``role`` + name."""

    __slots__ = ("dims", "dtype", "error", "itemsize", "kind", "label", "name", "shape", "whole_symbol")

    def __init__(self, spec: TensorSpec, role: str, error: type[InvalidInput] | type[InvalidOutput]) -> None:
        self.name = spec.name
        self.dtype = DType(spec.dtype)
        # the dtype test runs on every call: compare (kind, itemsize), which also accepts either byte order
        self.kind = _NUMPY[self.dtype].kind
        self.itemsize = 0 if self.dtype is DType.STRING else _NUMPY[self.dtype].itemsize
        self.shape: Shape = spec.shape
        self.label = f"{role} {spec.name!r}"
        self.error: Callable[[str], InvalidInput | InvalidOutput] = functools.partial(error, tensor=spec.name)
        self.whole_symbol: str | None = None
        self.dims: tuple[int | str, ...] | None = None
        if isinstance(spec.shape, str):
            if spec.shape != "*":
                self.whole_symbol = spec.shape
        else:
            self.dims = tuple(spec.shape)

    def check(self, value: Tensor, bindings: dict[str, _Binding]) -> None:
        if isinstance(value, np.ndarray):
            self._check_dtype(value.dtype, "")
            if self.whole_symbol is not None:
                self._bind(self.whole_symbol, tuple(value.shape), "shape", "", bindings)
            elif self.dims is not None:
                self._check_dims(tuple(value.shape), 0, "", bindings)
            return
        # a nested tensor: a list of arrays (the type was checked by _as_tensor)
        for index, inner in enumerate(value):
            self._check_dtype(inner.dtype, f" element {index}")
        if self.dims is None:
            return
        if len(self.dims) == 0:
            raise self.error(f"{self.label} is declared a scalar, but a nested tensor (a list) was given")
        self._check_dim(0, len(value), "", bindings)
        for index, inner in enumerate(value):
            self._check_dims(tuple(inner.shape), 1, f" element {index}", bindings)

    def _check_dtype(self, actual: np.dtype[Any], where: str) -> None:
        if actual.kind != self.kind or (self.itemsize and actual.itemsize != self.itemsize):
            hint = " (strings are numpy str arrays)" if self.dtype is DType.STRING or actual.kind in "SO" else ""
            raise self.error(
                f"{self.label}{where} has dtype {_dtype_name(actual)}, the model declares {self.dtype}{hint}"
            )

    def _check_dims(self, shape: tuple[int, ...], skip: int, where: str, bindings: dict[str, _Binding]) -> None:
        assert self.dims is not None
        declared = self.dims[skip:]
        if len(shape) != len(declared):
            kind = "a scalar" if not declared else f"{len(declared)} dimension(s)"
            raise self.error(
                f"{self.label}{where} has shape {shape}, the model declares {kind}: {_show_shape(self.shape)}"
            )
        for offset, size in enumerate(shape):
            self._check_dim(skip + offset, size, where, bindings)

    def _check_dim(self, axis: int, size: int, where: str, bindings: dict[str, _Binding]) -> None:
        assert self.dims is not None
        declared = self.dims[axis]
        if isinstance(declared, str):
            if declared != "*":
                self._bind(declared, size, axis, where, bindings)
        elif size != declared:
            raise self.error(
                f"{self.label}{where} dimension {axis} is {size}, the model declares {declared} "
                f"(shape {_show_shape(self.shape)})"
            )

    def _bind(
        self, symbol: str, value: int | tuple[int, ...], axis: int | str, where: str, bindings: dict[str, _Binding]
    ) -> None:
        bound = bindings.get(symbol)
        if bound is None:
            bindings[symbol] = _Binding(
                value, self.label, axis if isinstance(axis, str) else f"dimension {axis}", where
            )
        elif bound.value != value:
            here = _Binding(value, self.label, axis if isinstance(axis, str) else f"dimension {axis}", where)
            raise self.error(
                f"{here.where} is {value}, but symbol {symbol!r} is already {bound.value} (from {bound.where})"
            )


def _as_tensor(value: object, name: str, role: str, error: type[InvalidInput] | type[InvalidOutput]) -> Tensor:
    """The value as a tensor: an ndarray (numpy scalars become 0-d arrays) or a list of ndarrays (nested)."""
    label = f"{role} {name!r}"
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "O":
            raise error(f"{label} is an object array; carton tensors are numeric or str arrays", tensor=name)
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, list):
        for index, inner in enumerate(value):
            if not isinstance(inner, np.ndarray) or inner.dtype.kind == "O":
                raise error(
                    f"{label} is a list, so it must be a nested tensor (a list of numpy arrays), but element "
                    f"{index} is {type(inner).__name__}",
                    tensor=name,
                )
        return value
    raise error(
        f"{label} must be a numpy array (or a list of numpy arrays for a nested tensor), got "
        f"{type(value).__name__}; convert it with numpy.asarray(value, dtype=...)",
        tensor=name,
    )


# (name, dtype, shape) of each array of a call, in order: every check above depends on these alone.
_Layout = tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...]
# Layouts remembered per signature; a caller cycling through more shapes than this just gets checked in full more.
_MAX_LAYOUTS = 256


class _Known:
    """An input layout that passed: the reply layouts whose outputs passed after it (its symbol bindings are its
    `Checked`'s).

    Hashed by identity, it is the one key a call's layout is looked up by: the codec's request template is found by
    it too (`Checked.layout_key`), and a reply read by a learnt plan is checked by that plan's identity."""

    __slots__ = ("replies",)

    def __init__(self) -> None:
        self.replies: set[object] = set()


# A struct, made in C: a NamedTuple's `__new__` is a Python function, on every call's path.
class Checked(msgspec.Struct, gc=False):
    """What `Signature.prepare_inputs` learnt of a call's inputs, for `Signature.check_outputs`."""

    bindings: dict[str, _Binding]  # what `check_outputs` continues (in a copy when `shared`)
    layout: _Layout | None  # None when some input was not a plain numpy array
    layout_key: _Known | None = None  # the inputs' layout as one hashable object (None with `layout`)
    shared: bool = False  # given to every call in the layout: `bindings` are never changed


def _continued(checked: Checked) -> dict[str, _Binding]:
    """The bindings `Signature.check_outputs` adds the outputs' to: a copy of a shared `Checked`'s."""
    return dict(checked.bindings) if checked.shared else checked.bindings


def _layout(tensors: Mapping[str, object]) -> _Layout | None:
    """The layout of `tensors` when every one is a plain numpy array (the usual call), else None."""
    layout = []
    for name, value in tensors.items():
        if type(value) is not np.ndarray:
            return None
        layout.append((name, value.dtype, value.shape))
    return tuple(layout)


class Signature:
    """A model's declared inputs and outputs, compiled once and applied to every call.

    A model is called with the same names, dtypes and shapes again and again, and every rule depends on those
    alone: a layout of inputs that passed (with the symbol bindings it made), and a layout of outputs that passed
    after it, are remembered and pass at once the next time (thread-safe: entries are only ever added whole).
    """

    __slots__ = ("_input_layouts", "_inputs", "_output_layouts", "_outputs", "input_names", "output_names")

    def __init__(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> None:
        self._inputs = {spec.name: _Checker(spec, "input", InvalidInput) for spec in inputs}
        self._outputs = {spec.name: _Checker(spec, "output", InvalidOutput) for spec in outputs}
        self.input_names = tuple(self._inputs)
        self.output_names = tuple(self._outputs)
        self._input_layouts: dict[_Layout, Checked] = {}
        self._output_layouts: set[tuple[_Layout, _Layout]] = set()

    def prepare_inputs(self, inputs: Mapping[str, object] | Sequence[object]) -> tuple[dict[str, Tensor], Checked]:
        """Name positional inputs, check every input; returns the tensors and what `check_outputs` needs."""
        if type(inputs) is dict:
            layout: _Layout | None
            if len(inputs) == 1:
                # One input (most models): `_layout` written out, without its loop and list.
                ((name, value),) = inputs.items()
                layout = ((name, value.dtype, value.shape),) if type(value) is np.ndarray else None
            else:
                layout = _layout(inputs)
            if layout is not None:
                checked = self._input_layouts.get(layout)
                if checked is not None:
                    return dict(inputs), checked
                tensors, bindings = self._check_inputs(inputs)
                if len(self._input_layouts) >= _MAX_LAYOUTS:
                    self._input_layouts.clear()
                known = _Known()
                # One shared `Checked` per layout, given to every later call in it: `check_outputs` adds the outputs'
                # bindings to a copy of its bindings, never to them. This first call's are its own.
                self._input_layouts[layout] = Checked(dict(bindings), layout, known, shared=True)
                return tensors, Checked(bindings, layout, known)
        tensors, bindings = self._check_inputs(inputs)
        return tensors, Checked(bindings, None)

    def _check_inputs(
        self, inputs: Mapping[str, object] | Sequence[object]
    ) -> tuple[dict[str, Tensor], dict[str, _Binding]]:
        named = self._name_inputs(inputs)
        tensors: dict[str, Tensor] = {}
        for name, value in named.items():
            tensors[name] = _as_tensor(value, name, "input", InvalidInput)
        bindings: dict[str, _Binding] = {}
        if not self._inputs:
            return tensors, bindings
        unknown = [name for name in tensors if name not in self._inputs]
        if unknown:
            raise InvalidInput(
                f"unknown input {unknown[0]!r}; the model's inputs are {', '.join(map(repr, self.input_names))}",
                tensor=unknown[0],
            )
        missing = [name for name in self.input_names if name not in tensors]
        if missing:
            raise InvalidInput(
                f"missing input {missing[0]!r} (the model's inputs are {', '.join(map(repr, self.input_names))})",
                tensor=missing[0],
            )
        for name, checker in self._inputs.items():
            checker.check(tensors[name], bindings)
        return tensors, bindings

    def check_outputs(
        self, outputs: Mapping[str, object], checked: Checked, reply_layout: Hashable | None = None
    ) -> dict[str, Tensor]:
        """Check what the runner returned, continuing the inputs' symbol bindings. `reply_layout`, when given, stands
        for the outputs' layout (the same object always comes with the same names, dtypes and shapes of plain
        arrays: the plan a learnt reply header was read by), and a layout that passed after the same inputs before
        passes at once."""
        known = checked.layout_key
        if reply_layout is not None and known is not None and reply_layout in known.replies:
            return outputs  # type: ignore[return-value]  # a dict of arrays, laid out as when it passed
        inputs = checked.layout
        layout = _layout(outputs) if inputs is not None and type(outputs) is dict else None
        if inputs is None or layout is None:
            return self._check_outputs(outputs, _continued(checked))
        key = (inputs, layout)
        if key in self._output_layouts:
            tensors = outputs  # a dict of arrays (`_layout` checked it)
        else:
            tensors = self._check_outputs(outputs, _continued(checked))
            if len(self._output_layouts) >= _MAX_LAYOUTS:
                self._output_layouts.clear()
            self._output_layouts.add(key)
        if reply_layout is not None and known is not None and len(known.replies) < _MAX_LAYOUTS:
            known.replies.add(reply_layout)
        return tensors  # type: ignore[return-value]

    def _check_outputs(self, outputs: Mapping[str, object], bindings: dict[str, _Binding]) -> dict[str, Tensor]:
        tensors: dict[str, Tensor] = {}
        for name, value in outputs.items():
            tensors[name] = _as_tensor(value, name, "output", InvalidOutput)
        if not self._outputs:
            return tensors
        for name in tensors:
            if name not in self._outputs:
                raise InvalidOutput(
                    f"the runner returned output {name!r}, which the model does not declare (declared: "
                    f"{', '.join(map(repr, self.output_names))})",
                    tensor=name,
                )
        for name, checker in self._outputs.items():
            if name not in tensors:
                raise InvalidOutput(f"the runner did not return output {name!r}", tensor=name)
            checker.check(tensors[name], bindings)
        return tensors

    def _name_inputs(self, inputs: Mapping[str, object] | Sequence[object]) -> Mapping[str, object]:
        if isinstance(inputs, Mapping):
            for key in inputs:
                if not isinstance(key, str):
                    raise InvalidInput(f"input names must be strings, got {type(key).__name__} {key!r}")
            return inputs
        if isinstance(inputs, list | tuple):
            if not self._inputs:
                raise InvalidInput(
                    "the model does not declare its inputs, so they must be passed by name (a dict), not as a list"
                )
            if len(inputs) != len(self._inputs):
                raise InvalidInput(
                    f"the model takes {len(self._inputs)} input(s) ({', '.join(map(repr, self.input_names))}), "
                    f"but {len(inputs)} were given positionally"
                )
            return dict(zip(self.input_names, inputs, strict=True))
        raise InvalidInput(
            f"inputs must be a dict of name -> tensor or a list in declared order, got {type(inputs).__name__}"
        )
