"""ggml's matrix-vector product called in-process through ctypes, for bench_mcf.py (imported as a sibling: the
scripts run from bench/).

bench/setup_llamacpp.sh builds ggml as shared libraries with the flags of its llama.cpp tools; ``GgmlMatVec`` then
runs one ``MUL_MAT`` of a quantized matrix by one float32 vector on ggml's CPU backend, as llama.cpp's
``test-backend-ops perf`` runs its op (plain CPU buffers, no repacked layout, the vector quantized to the matrix
type's dot-product type inside the op), but one product per call, so that the caller can alternate it with other
work exactly as it alternates its own variants::

    lib = load_ggml()                        # None when the shared build is absent
    if lib is not None:
        mv = GgmlMatVec(lib, w, "q4_K", threads=1, huge=False)
        mv.set_vector(x)
        mv()                                 # one product
        y = mv.output()

``placed`` / ``placed_copy`` give fresh memory of a chosen page size; ggml's tensors live in such memory too.

The struct layout and enum values are those of the headers of the vendored llama.cpp that the set-up script builds
(llama-cpp-python 0.3.36's, ggml 0.25.3).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

GGML_TYPES = {"f32": 0, "q4_0": 2, "q8_0": 8, "q4_K": 12, "q6_K": 14}
_VP = ctypes.c_void_p
_SZ = ctypes.c_size_t
_I64 = ctypes.c_int64
_FLOATS = ctypes.POINTER(ctypes.c_float)
_TO_FLOAT = ctypes.CFUNCTYPE(None, _VP, _FLOATS, _I64)


class _InitParams(ctypes.Structure):
    _fields_ = (("mem_size", _SZ), ("mem_buffer", _VP), ("no_alloc", ctypes.c_bool))


class _TypeTraits(ctypes.Structure):
    _fields_ = (
        ("type_name", ctypes.c_char_p),
        ("blck_size", _I64),
        ("blck_size_interleave", _I64),
        ("type_size", _SZ),
        ("is_quantized", ctypes.c_bool),
        ("to_float", _VP),
        ("from_float_ref", _VP),
    )


_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ggml_init": (_VP, [_InitParams]),
    "ggml_free": (None, [_VP]),
    "ggml_tensor_overhead": (_SZ, []),
    "ggml_graph_overhead": (_SZ, []),
    "ggml_new_tensor_2d": (_VP, [_VP, ctypes.c_int, _I64, _I64]),
    "ggml_mul_mat": (_VP, [_VP, _VP, _VP]),
    "ggml_new_graph": (_VP, [_VP]),
    "ggml_build_forward_expand": (None, [_VP, _VP]),
    "ggml_nbytes": (_SZ, [_VP]),
    "ggml_row_size": (_SZ, [ctypes.c_int, _I64]),
    "ggml_quantize_chunk": (_SZ, [ctypes.c_int, _FLOATS, _VP, _I64, _I64, _I64, _FLOATS]),
    "ggml_get_type_traits": (ctypes.POINTER(_TypeTraits), [ctypes.c_int]),
    "ggml_backend_cpu_init": (_VP, []),
    "ggml_backend_cpu_set_n_threads": (None, [_VP, ctypes.c_int]),
    "ggml_backend_cpu_buffer_from_ptr": (_VP, [_VP, _SZ]),
    "ggml_backend_tensor_alloc": (ctypes.c_int, [_VP, _VP, _VP]),
    "ggml_backend_tensor_set": (None, [_VP, _VP, _SZ, _SZ]),
    "ggml_backend_tensor_get": (None, [_VP, _VP, _SZ, _SZ]),
    "ggml_backend_graph_compute": (ctypes.c_int, [_VP, _VP]),
    "ggml_backend_buffer_free": (None, [_VP]),
    "ggml_backend_free": (None, [_VP]),
}


def ggml_library_path() -> Path:
    """Where bench/setup_llamacpp.sh puts the shared libggml (``GGML_LIBRARY`` overrides)."""
    cache = Path(os.environ.get("CARTON_BENCH_CACHE", Path.home() / ".cache" / "carton-bench"))
    return Path(os.environ.get("GGML_LIBRARY", cache / "ggml" / "libggml.so"))


def load_ggml() -> ctypes.CDLL | None:
    """The shared ggml with its functions' signatures declared, or None when it is not built. libggml.so links its
    base and CPU libraries, so one handle finds the functions of all three."""
    path = ggml_library_path()
    if not path.is_file():
        return None
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _floats(a: Any) -> Any:
    return a.ctypes.data_as(_FLOATS)


def placed(nbytes: int, huge: bool) -> Any:
    """``nbytes`` of fresh, untouched memory (a uint8 array over an anonymous mapping) whose pages the kernel backs
    with transparent huge pages (``huge``) or with base pages, as they are first written. The matrices the benchmark
    compares all live in such memory: allocator-returned memory has whatever page size its earlier use left."""
    import numpy as np

    # Private: shared anonymous memory is shmem, whose huge pages follow another setting. The array starts on a
    # huge page's boundary and its last huge page is inside the mapping: all of it can be on huge pages.
    huge_page = 2 << 20
    region = mmap.mmap(-1, nbytes + 2 * huge_page, flags=mmap.MAP_PRIVATE)
    region.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    start = np.frombuffer(region, dtype=np.uint8, count=1).ctypes.data
    return np.frombuffer(region, dtype=np.uint8, count=nbytes, offset=-start % huge_page)


def placed_copy(a: Any, huge: bool) -> Any:
    """A copy of array ``a`` (same dtype and shape) in `placed` memory."""
    out = placed(a.nbytes, huge).view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


class GgmlMatVec:
    """``y = W x`` by ggml's CPU backend: ``W`` (rows x cols, float32) quantized by ``ggml_quantize_chunk`` to
    ``type_name`` without an importance matrix (as llama.cpp's tools quantize their test tensors)."""

    def __init__(self, lib: ctypes.CDLL, w: Any, type_name: str = "q4_K", *, threads: int = 1, huge: bool) -> None:
        import numpy as np

        self._lib, self._type = lib, GGML_TYPES[type_name]
        rows, cols = w.shape
        self.rows, self.cols = rows, cols
        mem = lib.ggml_tensor_overhead() * 8 + lib.ggml_graph_overhead()
        self._ctx = lib.ggml_init(_InitParams(mem, None, True))
        self._backend = lib.ggml_backend_cpu_init()
        self._buffer = None
        if not self._ctx or not self._backend:
            raise RuntimeError("ggml_init or ggml_backend_cpu_init failed")
        lib.ggml_backend_cpu_set_n_threads(self._backend, threads)
        self._a = lib.ggml_new_tensor_2d(self._ctx, self._type, cols, rows)  # ne0 = cols: ggml's rows are W's
        self._b = lib.ggml_new_tensor_2d(self._ctx, GGML_TYPES["f32"], cols, 1)
        self._y = lib.ggml_mul_mat(self._ctx, self._a, self._b)
        self._graph = lib.ggml_new_graph(self._ctx)
        lib.ggml_build_forward_expand(self._graph, self._y)
        # The tensors live in memory of ours (a CPU buffer over a pointer, as llama.cpp wraps a mapped model file),
        # so that ggml's matrix has the page size the benchmark gives every other variant's.
        tensors = (self._a, self._b, self._y)
        offsets = [0]
        for t in tensors:
            offsets.append(offsets[-1] + -(-lib.ggml_nbytes(t) // 4096) * 4096)
        self.memory = placed(offsets[-1], huge)
        self._buffer = lib.ggml_backend_cpu_buffer_from_ptr(self.memory.ctypes.data, offsets[-1])
        if not self._buffer:
            raise RuntimeError("ggml_backend_cpu_buffer_from_ptr failed")
        for t, offset in zip(tensors, offsets, strict=False):
            if lib.ggml_backend_tensor_alloc(self._buffer, t, self.memory.ctypes.data + offset) != 0:
                raise RuntimeError("ggml_backend_tensor_alloc failed")
        src = np.ascontiguousarray(w, dtype=np.float32)
        self.payload = self.memory[: lib.ggml_nbytes(self._a)]
        written = lib.ggml_quantize_chunk(self._type, _floats(src), self.payload.ctypes.data, 0, rows, cols, None)
        if written != self.payload.nbytes or lib.ggml_row_size(self._type, cols) * rows != written:
            raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes for {self.payload.nbytes}")
        self._out = np.empty(rows, dtype=np.float32)

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized matrix (what one product reads)."""
        return int(self.payload.nbytes)

    def set_vector(self, x: Any) -> None:
        import numpy as np

        v = np.ascontiguousarray(x, dtype=np.float32).reshape(self.cols)
        self._lib.ggml_backend_tensor_set(self._b, v.ctypes.data, 0, v.nbytes)

    def __call__(self) -> None:
        status = self._lib.ggml_backend_graph_compute(self._backend, self._graph)
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute returned status {status}")

    def output(self) -> Any:
        """A copy of the last product's ``y`` (float32, ``rows``)."""
        self._lib.ggml_backend_tensor_get(self._y, self._out.ctypes.data, 0, self._out.nbytes)
        return self._out.copy()

    def dequantized(self) -> Any:
        """The quantized matrix decoded back to float32 by ggml's own ``to_float``."""
        import numpy as np

        out = np.empty((self.rows, self.cols), dtype=np.float32)
        to_float = _TO_FLOAT(self._lib.ggml_get_type_traits(self._type).contents.to_float)
        to_float(self.payload.ctypes.data, _floats(out), out.size)
        return out

    def close(self) -> None:
        lib = self._lib
        if self._buffer:
            lib.ggml_backend_buffer_free(self._buffer)
        if self._backend:
            lib.ggml_backend_free(self._backend)
        if self._ctx:
            lib.ggml_free(self._ctx)
        self._buffer = self._backend = self._ctx = None
        self.memory = self.payload = None


def add_ggml_matvec(
    fns: dict[str, Callable[[], object]], w: Any, x: Any, threads: int, huge: bool
) -> dict[str, float] | None:
    """Adds ggml's q4_K product of ``w`` by ``x`` to ``fns`` as ``"ggml q4_K"`` when the shared ggml is built (None
    when it is not), after checking its output: returns its relative errors against the float64 product and
    against the product of ggml's own dequantized matrix."""
    import numpy as np

    lib = load_ggml()
    if lib is None:
        return None
    mv = GgmlMatVec(lib, w, "q4_K", threads=threads, huge=huge)
    mv.set_vector(x)
    mv()
    y, exact = mv.output().astype(np.float64), w.astype(np.float64) @ x
    own = mv.dequantized().astype(np.float64) @ x
    errors = {
        "ggml": float(np.linalg.norm(y - exact) / np.linalg.norm(exact)),
        "ggml own": float(np.linalg.norm(y - own) / np.linalg.norm(own)),
    }
    if errors["ggml own"] > 0.02:  # only the vector's rounding to q8_K stands between the two
        raise SystemExit(f"ggml's q4_K product disagrees with its own dequantized matrix: {errors}")
    fns["ggml q4_K"] = mv
    return errors
