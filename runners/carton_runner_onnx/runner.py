"""`OnnxRunner`: loads ``model/*.onnx`` into an onnxruntime `InferenceSession` and runs it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import onnxruntime as ort
from carton_protocol import InvalidInput, LoadContext, PackContext, PackResult, Runner, Tensor
from onnxruntime.capi.onnxruntime_pybind11_state import EPFail, InvalidArgument

from ._errors import InvalidRunnerOption, OnnxRunnerError
from ._files import check_external_data, find_model_file
from ._options import GraphOptimization, OnnxOptions, Spinning, parse_options
from ._specs import ORT_TYPES, Binding, bind, spec_from_node_arg

__all__ = ["OnnxRunner"]

_LEVELS = {
    GraphOptimization.DISABLE: "ORT_DISABLE_ALL",
    GraphOptimization.BASIC: "ORT_ENABLE_BASIC",
    GraphOptimization.EXTENDED: "ORT_ENABLE_EXTENDED",
    GraphOptimization.LAYOUT: "ORT_ENABLE_LAYOUT",
    GraphOptimization.ALL: "ORT_ENABLE_ALL",
}
# The session config entries each `intra_op_spinning` sets (onnxruntime's keys; "always" leaves its defaults).
_SPINNING_ENTRIES = {
    Spinning.RUN: {"session.force_spinning_stop": "1"},
    Spinning.ALWAYS: {},
    Spinning.NEVER: {"session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"},
}
# Graph output types that onnxruntime's `run` always returns as a numeric (or bool) numpy array, passed on as they are.
_ARRAY_OUTPUTS = frozenset(ORT_TYPES) - {"tensor(string)"} | {"tensor(bool)", "tensor(float16)"}


class OnnxRunner(Runner):
    """Runs an ONNX graph; `InferenceSession.run` is thread-safe, so requests may run concurrently."""

    concurrent = True

    def load(self, context: LoadContext) -> None:
        options = parse_options(context.opts, context.warn)
        self._session = _open_session(context.model_dir, options, context.warn)
        self._binding: Binding = bind(self._session, context.inputs, context.outputs)
        self._graph_inputs = dict(self._binding.inputs)
        self._graph_outputs = [graph_name for _, graph_name in self._binding.outputs]
        self._output_names = tuple(name for name, _ in self._binding.outputs)
        # When every input keeps its graph name, a dict of exactly the model's inputs as arrays is the feeds itself;
        # when every output is a numeric tensor, onnxruntime's list of arrays is the outputs once named.
        self._feeds_as_given = all(name == graph_name for name, graph_name in self._binding.inputs)
        output_types = {arg.name: arg.type for arg in self._session.get_outputs()}
        self._arrays_out = all(output_types.get(graph_name) in _ARRAY_OUTPUTS for graph_name in self._graph_outputs)
        # A one-output model's outputs are made by a dict display (`dict(zip(...))` is the slower generic path).
        self._single_output = self._output_names[0] if len(self._output_names) == 1 else None
        # Passed to every `run`: given None, onnxruntime's binding first tries (and fails) to find a module-local
        # `RunOptions` type for it, raising and clearing an AttributeError on every call; a real one binds at once.
        # It is only read during a run, so concurrent runs share it.
        self._run_options = ort.RunOptions()
        # The binding's own `run`, for the call whose inputs `infer` has checked itself (exactly the model's inputs,
        # all arrays) on a session that runs on the CPU alone: there the public `run`'s Python checks cannot fail
        # (`bind` saw that every input the graph needs is declared; no `OrtValue` is fed; WebGPU graph capture needs
        # WebGPU), and it is a large share of a small call. Its name is onnxruntime's, not public: a release without
        # it keeps the public `run`.
        binding_run = getattr(getattr(self._session, "_sess", None), "run", None)
        cpu_only = self._session.get_providers() == ["CPUExecutionProvider"]
        self._checked_run = binding_run if callable(binding_run) and cpu_only and self._graph_outputs else None
        # A model of one input under its graph name and one array output (most models), on that `run`: its input's
        # name, and what `infer` passes and returns, for a call checked in a few tests (`infer`).
        self._one: tuple[str, Callable[..., Any], list[str], Any, str] | None = None
        output = self._single_output
        run = self._checked_run
        if run is not None and self._feeds_as_given and len(self._graph_inputs) == 1 and self._arrays_out and output:
            ((input_name, _),) = self._binding.inputs
            self._one = (input_name, run, self._graph_outputs, self._run_options, output)

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        one = self._one
        if one is not None and len(inputs) == 1 and type(inputs) is dict:
            # One array, the model's one input: the feeds are `inputs` themselves (the loop below, written out).
            input_name, one_run, graph_outputs, run_options, output = one
            if type(inputs.get(input_name)) is np.ndarray:
                try:
                    arrays = one_run(graph_outputs, inputs, run_options)
                except Exception as exc:
                    arrays = self._failed_run(exc, inputs)
                return {output: arrays[0]}
        # The usual call, written out here (every request's path): exactly the model's inputs, checked in one pass.
        graph_inputs = self._graph_inputs
        feeds: Mapping[str, Any]
        run = self._checked_run
        if len(inputs) != len(graph_inputs):
            feeds, run = self._feeds(inputs), None
        elif self._feeds_as_given and type(inputs) is dict:
            feeds = inputs
            for name, value in inputs.items():
                if type(value) is not np.ndarray or name not in graph_inputs:
                    feeds, run = self._feeds(inputs), None
                    break
        else:
            built: dict[str, Any] = {}
            feeds = built
            for name, value in inputs.items():
                graph_name = graph_inputs.get(name)
                if graph_name is None or type(value) is not np.ndarray:
                    feeds, run = self._feeds(inputs), None
                    break
                built[graph_name] = value
        try:
            results = (run or self._session.run)(self._graph_outputs, feeds, self._run_options)
        except Exception as exc:
            if run is None:
                _raise_run_error(exc)
            results = self._failed_run(exc, feeds)
        if self._arrays_out:
            single = self._single_output
            if single is not None:
                return {single: results[0]}
            return dict(zip(self._output_names, results))  # noqa: B905 - one result per name asked for
        outputs = {}
        for name, value in zip(self._output_names, results, strict=True):
            # What onnxruntime returns for every numeric tensor goes out as it is.
            outputs[name] = value if type(value) is np.ndarray and value.dtype.kind != "O" else _from_ort(value)
        return outputs

    def _failed_run(self, exc: Exception, feeds: Mapping[str, Any]) -> list[Any]:
        """What a failed call of the binding's `run` comes to: an `EPFail` is retried once by the public `run` (which
        falls back to its other providers), any other error (or the retry's) is raised as `_raise_run_error` says."""
        if not isinstance(exc, EPFail):
            _raise_run_error(exc)
        try:
            results: list[Any] = self._session.run(self._graph_outputs, feeds, self._run_options)
        except Exception as again:
            _raise_run_error(again)
        return results

    def _feeds(self, inputs: Mapping[str, Tensor]) -> dict[str, Any]:
        """onnxruntime's feeds (graph name -> array) for `inputs` other than exactly the model's inputs as arrays;
        `InvalidInput` naming a tensor it lacks or does not take, or a nested one."""
        graph_inputs = self._graph_inputs
        unexpected = sorted(set(inputs) - set(graph_inputs))
        if unexpected:
            raise InvalidInput(
                f"unknown input(s) {', '.join(map(repr, unexpected))}; "
                f"the model takes {', '.join(map(repr, graph_inputs))}",
                tensor=unexpected[0],
            )
        feeds: dict[str, Any] = {}
        for name, graph_name in graph_inputs.items():
            if name not in inputs:
                raise InvalidInput(f"missing input {name!r}", tensor=name)
            value = inputs[name]
            if isinstance(value, list):
                raise InvalidInput(
                    f"input {name!r} is a nested tensor; ONNX graphs take dense tensors only", tensor=name
                )
            feeds[graph_name] = value
        return feeds

    def close(self) -> None:
        self.__dict__.pop("_session", None)

    @classmethod
    def pack(cls, context: PackContext) -> PackResult:
        """Check the model loads with the given opts; describe its inputs/outputs when the caller gave none."""
        options = parse_options(context.opts, context.warn)
        session = _open_session(context.model_dir, options, context.warn)
        bind(session, context.inputs, context.outputs)
        shapeless = _outputs_without_shape(find_model_file(context.model_dir, options.model_file))
        inputs = context.inputs or tuple(spec_from_node_arg(arg, kind="input") for arg in session.get_inputs())
        outputs = context.outputs or tuple(
            spec_from_node_arg(arg, kind="output", shape_known=not (arg.name in shapeless and not arg.shape))
            for arg in session.get_outputs()
        )
        return PackResult(inputs=tuple(inputs), outputs=tuple(outputs), opts=dict(context.opts))


def _open_session(model_dir: Path, options: OnnxOptions, warn: Callable[[str], None]) -> Any:
    model_path = find_model_file(model_dir, options.model_file)
    check_external_data(model_path, model_dir)
    session_options = ort.SessionOptions()
    if options.intra_op_threads is not None:
        session_options.intra_op_num_threads = options.intra_op_threads
    if options.inter_op_threads is not None:
        session_options.inter_op_num_threads = options.inter_op_threads
    if options.graph_optimization_level is not None:
        level = getattr(ort.GraphOptimizationLevel, _LEVELS[options.graph_optimization_level], None)
        if level is None:
            raise InvalidRunnerOption(
                f"runner opt graph_optimization_level={options.graph_optimization_level.value!r}"
                f" is not supported by onnxruntime {ort.__version__}"
            )
        session_options.graph_optimization_level = level
    for key, value in _SPINNING_ENTRIES[options.intra_op_spinning].items():
        session_options.add_session_config_entry(key, value)
    try:
        return ort.InferenceSession(
            str(model_path), sess_options=session_options, providers=_providers(options.execution_providers, warn)
        )
    except Exception as exc:  # onnxruntime's pybind errors (InvalidProtobuf, Fail, ...) share no public base
        raise OnnxRunnerError(f"onnxruntime {ort.__version__} could not load {model_path.name!r}: {exc}") from exc


def _providers(requested: tuple[str, ...], warn: Callable[[str], None]) -> list[str]:
    """The requested providers that this onnxruntime build has, in order, with CPU always last as the fallback."""
    available = set(ort.get_available_providers())
    missing = [name for name in requested if name not in available]
    if missing:
        warn(
            f"onnxruntime runner: execution providers {', '.join(map(repr, missing))} are not available in this "
            f"onnxruntime build (available: {', '.join(sorted(available))}); skipping them"
        )
    chosen = [name for name in requested if name in available and name != "CPUExecutionProvider"]
    return [*chosen, "CPUExecutionProvider"]


def _raise_run_error(exc: Exception) -> NoReturn:
    """`InvalidInput` for a dtype, rank or dimension the graph does not take (onnxruntime's `InvalidArgument`: the
    caller's inputs), `OnnxRunnerError` for its other errors (pybind errors such as Fail share no public base)."""
    if isinstance(exc, InvalidArgument):
        raise InvalidInput(f"onnxruntime refused the inputs: {exc}") from exc
    raise OnnxRunnerError(f"onnxruntime failed to run the model: {exc}") from exc


def _from_ort(value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == np.object_:  # onnxruntime returns string tensors as object arrays of str
        return array.astype(np.str_) if array.size else np.empty(array.shape, dtype=np.str_)
    return array


def _outputs_without_shape(model_path: Path) -> set[str]:
    """Graph outputs declaring no shape at all: where inference found none either, onnxruntime reports ``[]``,
    which would read as a scalar."""
    import onnx

    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for a corrupt protobuf
        raise OnnxRunnerError(f"{model_path.name} is not a valid ONNX model: {exc}") from exc
    return {output.name for output in model.graph.output if not output.type.tensor_type.HasField("shape")}
