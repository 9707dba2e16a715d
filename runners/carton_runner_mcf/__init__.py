"""The built-in ``mcf`` runner: llama-family decoders from (quantized) MCF files.

The entry point is `carton_runner_mcf.plugin`; the `Runner` is `carton_runner_mcf.runner.MCFRunner`. Nothing is
imported here so that plugin discovery stays cheap.
"""

__all__: list[str] = []
