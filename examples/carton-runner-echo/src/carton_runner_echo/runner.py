"""The echo runner: returns every input as an output, renamed per the runner options.

Options (``[runner.opts]`` or ``carton.load(..., runner_opts=...)``):

- ``rename``: a table mapping input names to output names;
- ``prefix``: a string put in front of every input name not in ``rename``.

Unknown options are reported to the host as warnings, as the Carton spec asks of every runner.
"""

from __future__ import annotations

from collections.abc import Mapping

from carton_protocol import LoadContext, PackContext, PackResult, Runner, Tensor, TensorSpec

__all__ = ["EchoRunner"]

_KNOWN_OPTS = ("rename", "prefix")


def _rename_table(opts: Mapping[str, object]) -> dict[str, str]:
    rename = opts.get("rename", {})
    if not isinstance(rename, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in rename.items()
    ):
        raise ValueError("runner option 'rename' must be a table of input name -> output name (strings)")
    return dict(rename)


def _prefix(opts: Mapping[str, object]) -> str:
    prefix = opts.get("prefix", "")
    if not isinstance(prefix, str):
        raise ValueError("runner option 'prefix' must be a string")
    return prefix


class EchoRunner(Runner):
    """Stateless, so it declares itself concurrent: the runner loop may call `infer` from several threads."""

    concurrent = True

    def load(self, context: LoadContext) -> None:
        self.rename = _rename_table(context.opts)
        self.prefix = _prefix(context.opts)
        for key in context.opts:
            if key not in _KNOWN_OPTS:
                context.warn(f"echo runner: unknown option {key!r} ignored")

    def _output_name(self, name: str) -> str:
        return self.rename.get(name, self.prefix + name)

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        return {self._output_name(name): value for name, value in inputs.items()}

    @classmethod
    def pack(cls, context: PackContext) -> PackResult:
        """Check the options now, at pack time, and derive output specs from input specs when none were given."""
        rename = _rename_table(context.opts)
        prefix = _prefix(context.opts)
        outputs = context.outputs or tuple(
            TensorSpec(name=rename.get(spec.name, prefix + spec.name), dtype=spec.dtype, shape=spec.shape)
            for spec in context.inputs
        )
        return PackResult(inputs=context.inputs, outputs=outputs, opts=dict(context.opts))
