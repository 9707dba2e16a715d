"""Closed sets of the MCF format: tensor dtypes, quantization methods and domains, section types, architectures."""

from __future__ import annotations

import enum

__all__ = ["Architecture", "MCFDType", "QuantDomain", "QuantMethod", "RopeType", "SectionType"]


class MCFDType(enum.IntEnum):
    """TensorIndex dtype codes (mcf-container-layout.md). A QuantRecord's Method is the low byte of these."""

    UNKNOWN = 0
    F32 = 1
    F16 = 2
    BF16 = 3
    F64 = 4
    I8 = 5
    U8 = 6
    I16 = 7
    U16 = 8
    I32 = 9
    U32 = 10
    I64 = 11
    U64 = 12
    INT8 = 0x10
    INT4 = 0x11
    Q8 = 0x20
    Q4 = 0x21
    K6 = 0x30
    K4 = 0x31
    K3 = 0x32
    K2 = 0x33


class QuantMethod(enum.StrEnum):
    """Quantization methods, named as users and the CLI name them."""

    INT8 = "int8"
    INT4 = "int4"
    Q8 = "q8"
    Q4 = "q4"
    K6 = "k6"
    K4 = "k4"
    K3 = "k3"
    K2 = "k2"

    @property
    def dtype(self) -> MCFDType:
        """The TensorIndex dtype of tensors quantized with this method."""
        return MCFDType[self.name]

    @property
    def bits(self) -> int:
        """Bits per code."""
        return {"int8": 8, "int4": 4, "q8": 8, "q4": 4, "k6": 6, "k4": 4, "k3": 3, "k2": 2}[self.value]

    @property
    def family(self) -> str:
        """``"int"`` (raw, tensor scale), ``"q"`` (block 32) or ``"k"`` (super-block 256 of blocks of 32)."""
        return self.value[0] if self.value[0] in "qk" else "int"


class QuantDomain(enum.IntEnum):
    """What a quantized tensor holds: weights (every method) or activations (int* only, with a zero point)."""

    WEIGHTS = 0
    ACTIVATIONS = 1


class SectionType(enum.IntEnum):
    """Section type codes of the directory; ``MCFFile.resource(SectionType.HF_CONFIG)`` reads a carried file."""

    MODEL_INFO = 0x0001
    QUANT_INFO = 0x0002
    TENSOR_INDEX = 0x0003
    TENSOR_DATA = 0x0004
    HF_CONFIG = 0x0100
    HF_GENERATION_CONFIG = 0x0101
    HF_TOKENIZER = 0x0102
    HF_TOKENIZER_CONFIG = 0x0103
    HF_VOCAB = 0x0104
    HF_MERGES = 0x0105


class Architecture(enum.IntEnum):
    """ModelInfo's architecture code (``ModelInfo(arch=Architecture.LLAMA, ...)``); unknown codes stay ints."""

    UNKNOWN = 0
    LLAMA = 1
    MISTRAL = 2
    QWEN = 3
    GEMMA = 4
    GRANITE = 5
    SMOLLM3 = 6


class RopeType(enum.IntEnum):
    """ModelInfo's rotary embedding kind; unknown codes stay ints."""

    NONE = 0
    STANDARD = 1
    LINEAR = 2
    YARN = 3
