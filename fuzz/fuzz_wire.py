"""Atheris harness for the wire decoder: any message must decode or raise ProtocolError, nothing else.

    python fuzz/fuzz_wire.py -max_total_time=120 -rss_limit_mb=4096 fuzz-corpus/wire

An input is a ZeroMQ multipart message flattened as ``(u32 little-endian length, bytes)*``: the header frame first,
then the data frames. The corpus directory is seeded with valid messages on first run (see docs/fuzzing.md).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["carton_protocol"]):
    import ml_dtypes
    import numpy as np
    from carton_protocol import Infer, ProtocolError
    from carton_protocol._framing import decode_tensors, encode_tensors
    from carton_protocol._limits import WireLimits
    from carton_protocol._messages import decode_request, encode

LIMITS = WireLimits(max_tensor_bytes=1 << 24, max_message_bytes=1 << 25, max_bytes_elements=1 << 16)
_LENGTH = struct.Struct("<I")


def flatten(parts: list[bytes]) -> bytes:
    return b"".join(_LENGTH.pack(len(part)) + part for part in parts)


def split(data: bytes) -> list[bytes]:
    parts: list[bytes] = []
    position = 0
    while position + 4 <= len(data):
        (length,) = _LENGTH.unpack_from(data, position)
        position += 4
        parts.append(data[position : position + length])
        position += length
    return parts


def seed(corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    if any(corpus.iterdir()):
        return
    samples = {
        "doc": {"x": np.array([[1.0, 2.0]], np.float32)},
        "mixed": {
            "a": np.arange(6, dtype=np.int64).reshape(2, 3),
            "b": np.array([True, False]),
            "h": np.ones(3, np.float16),
            "bf": np.ones(2, ml_dtypes.bfloat16),
        },
        "strings": {"s": np.array([["héllo", ""], ["x", "yz"]]), "scalar": np.array(1.5)},
        "nested": {"n": [np.zeros((0, 2), np.uint8), np.array(["a"]), np.arange(3, dtype=np.uint32)]},
        "empty": {},
    }
    for name, tensors in samples.items():
        encoded = encode_tensors(tensors, pool=None, threshold=1 << 62)
        frames = [bytes(f) if isinstance(f, bytes) else np.ascontiguousarray(f).tobytes() for f in encoded.frames]
        (corpus / f"{name}.bin").write_bytes(flatten([encode(Infer(id=1, tensors=encoded.entries)), *frames]))


def test_one_input(data: bytes) -> None:
    parts = split(data)
    if not parts:
        return
    try:
        message = decode_request(parts[0], LIMITS)
        if not isinstance(message, Infer):
            return
        tensors, _ = decode_tensors(
            message.tensors, [memoryview(part) for part in parts[1:]], limits=LIMITS, peer=None, copy_shared=False
        )
    except ProtocolError:
        return
    for value in tensors.values():
        for array in value if isinstance(value, list) else [value]:
            array.tobytes()


def main() -> None:
    corpus = [argument for argument in sys.argv[1:] if not argument.startswith("-")]
    for directory in corpus:
        seed(Path(directory))
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
