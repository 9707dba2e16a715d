"""MCF, the Model Container Format: a single-file, random-access container for (quantized) model weights.

    import carton.mcf
    with carton.mcf.open("model.mcf") as f:
        f.model_info.arch, f.tensors["model.norm.weight"].shape
        norm = f.array("model.norm.weight")          # zero-copy over the mapped file
        packed = f.tensor_bytes("lm_head.weight")    # quantized payload bytes, zero-copy

The container (header, sections, ModelInfo, QuantInfo, TensorIndex, TensorData, raw Hugging Face files) is read by
`MCFFile` and written by `MCFWriter` / `write_mcf`; `convert` builds an MCF from a safetensors model folder.
"""

from ..errors import MCFError, UnsupportedModel
from ._container import MCFHeader, QuantRecord, SectionEntry, TensorEntry
from ._convert import ConvertReport, TensorClass, classify_tensor, convert, model_info_from_config
from ._decode import dequantize
from ._kernels import CacheMode, QuantizedLinear, matmul
from ._layout import PayloadLayout, Region, payload_layout, payload_size, row_copies, row_regions
from ._modelinfo import KVValue, ModelInfo
from ._quant import QuantizedTensor, QuantMode, quantize
from ._reader import MCFFile, open_mcf
from ._types import Architecture, MCFDType, QuantDomain, QuantMethod, RopeType, SectionType
from ._writer import MCFWriter, QuantizedPayload, write_mcf

open = open_mcf  # carton.mcf.open(path) mirrors the builtin on purpose

__all__ = [
    "Architecture",
    "CacheMode",
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
    "QuantizedLinear",
    "QuantizedPayload",
    "QuantizedTensor",
    "Region",
    "RopeType",
    "SectionEntry",
    "SectionType",
    "TensorClass",
    "TensorEntry",
    "UnsupportedModel",
    "classify_tensor",
    "convert",
    "dequantize",
    "matmul",
    "model_info_from_config",
    "open",
    "open_mcf",
    "payload_layout",
    "payload_size",
    "quantize",
    "row_copies",
    "row_regions",
    "write_mcf",
]
