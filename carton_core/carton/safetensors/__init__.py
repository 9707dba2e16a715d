"""safetensors for numpy, written from the format's spec: a drop-in for the reference package's numpy API.

    from carton.safetensors import save_file, load_file, safe_open
    save_file({"w": w}, "model.safetensors", metadata={"format": "np"})
    with safe_open("model.safetensors", framework="numpy") as f:
        part = f.get_slice("w")[0:16]          # a view of 16 rows, nothing else read

Files written here are byte-identical to the reference's; reading is lazy and zero-copy (memory-mapped) and stricter
than the reference: every rule failure raises `carton.SafetensorsError` naming the file and the tensor or field. A
file that cannot be opened or written raises a `SafetensorsOSError`, which is also the matching `OSError`
(`FileNotFoundError`, `IsADirectoryError`, ...), so code written against the reference keeps working.
"""

from ..errors import (
    SafetensorsError,
    SafetensorsFileNotFound,
    SafetensorsIsADirectory,
    SafetensorsNotADirectory,
    SafetensorsOSError,
    SafetensorsPermissionError,
)
from ._header import DTYPES, MAX_HEADER_SIZE, DTypeInfo, TensorInfo
from ._io import SafeOpen, TensorSlice, load, load_file, safe_open, save, save_file

__all__ = [
    "DTYPES",
    "MAX_HEADER_SIZE",
    "DTypeInfo",
    "SafeOpen",
    "SafetensorsError",
    "SafetensorsFileNotFound",
    "SafetensorsIsADirectory",
    "SafetensorsNotADirectory",
    "SafetensorsOSError",
    "SafetensorsPermissionError",
    "TensorInfo",
    "TensorSlice",
    "load",
    "load_file",
    "safe_open",
    "save",
    "save_file",
]
