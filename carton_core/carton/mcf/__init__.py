"""MCF, the Model Container Format: a single-file, random-access container for (quantized) model weights.

    import carton.mcf
    with carton.mcf.open("model.mcf") as f:
        f.model_info.arch, f.tensors["model.norm.weight"].shape
        norm = f.array("model.norm.weight")          # zero-copy over the mapped file
        packed = f.tensor_bytes("lm_head.weight")    # quantized payload bytes, zero-copy

The container (header, sections, ModelInfo, QuantInfo, TensorIndex, TensorData, raw Hugging Face files) is read by
`MCFFile` and written by `MCFWriter` / `write_mcf`; `convert` builds an MCF from a safetensors model folder;
`quantize` / `dequantize` make and read payloads, whose byte layout `payload_layout` describes. The decoding
building blocks (`block_scales`, `block_codes`, `int_parameters`, `int_codes`, `BlockDecoder`) are what kernels
reading payloads build on; the quantized matrix products themselves belong to the mcf runner
(``carton_runner_mcf``). This package is a leaf library: it imports nothing of carton but its errors, so the host
and a runner process may both import it.
"""

from ..errors import MCFError, UnsupportedModel
from ._container import MCFHeader, QuantRecord, SectionEntry, TensorEntry
from ._convert import ConvertReport, TensorClass, classify_tensor, convert, model_info_from_config
from ._decode import block_codes, block_scales, dequantize, int_codes, int_parameters
from ._layout import PayloadLayout, Region, as_payload_array, payload_layout, payload_size
from ._lut import BlockDecoder, parallel_ranges, resolve_threads
from ._modelinfo import KVValue, ModelInfo
from ._packing import BLOCK
from ._quant import QuantizedTensor, QuantMode, quantize
from ._reader import MCFFile, open_mcf
from ._types import Architecture, MCFDType, QuantDomain, QuantMethod, RopeType, SectionType
from ._writer import MCFWriter, QuantizedPayload, write_mcf

open = open_mcf  # carton.mcf.open(path) mirrors the builtin on purpose

__all__ = [
    "BLOCK",
    "Architecture",
    "BlockDecoder",
    "ConvertReport",
    "KVValue",
    "MCFDType",
    "MCFError",
    "MCFFile",
    "MCFHeader",
    "MCFWriter",
    "ModelInfo",
    "PayloadLayout",
    "QuantDomain",
    "QuantMethod",
    "QuantMode",
    "QuantRecord",
    "QuantizedPayload",
    "QuantizedTensor",
    "Region",
    "RopeType",
    "SectionEntry",
    "SectionType",
    "TensorClass",
    "TensorEntry",
    "UnsupportedModel",
    "as_payload_array",
    "block_codes",
    "block_scales",
    "classify_tensor",
    "convert",
    "dequantize",
    "int_codes",
    "int_parameters",
    "model_info_from_config",
    "open",
    "open_mcf",
    "parallel_ranges",
    "payload_layout",
    "payload_size",
    "quantize",
    "resolve_threads",
    "write_mcf",
]
