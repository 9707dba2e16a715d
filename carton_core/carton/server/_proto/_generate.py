"""Generate ``kserve_v2_pb2.py`` from ``kserve_v2.proto`` with protoc (from ``grpcio-tools``).

The build backend (``build_backend/carton_build_backend.py``) loads this file by path and runs `generate` before
setuptools builds a wheel or an editable install, so nothing generated is committed. It imports nothing of carton's
(the build runs before carton is installed) and only the standard library plus ``grpc_tools`` at call time.
``python -m carton.server._proto`` runs it by hand, for a source tree installed without the build backend.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["PROTO_RELATIVE", "generate"]

#: The .proto, relative to the folder that holds the ``carton`` package; this path is also the name the file is
#: registered under in protobuf's descriptor pool, so it must stay unique (tritonclient's is ``grpc_service.proto``).
PROTO_RELATIVE = "carton/server/_proto/kserve_v2.proto"


def generate(source_root: Path) -> Path:
    """Compile ``source_root/carton/server/_proto/kserve_v2.proto`` next to itself; returns the generated module.

    The module is written to a temporary folder and moved into place, so a concurrent import never reads half a file.
    `RuntimeError` if ``grpcio-tools`` is missing or protoc fails.
    """
    proto = source_root / PROTO_RELATIVE
    if not proto.is_file():
        raise RuntimeError(f"{proto} is missing")
    try:
        from grpc_tools import protoc  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError(
            "generating carton's gRPC stubs needs grpcio-tools (pip install grpcio-tools, or build carton with its "
            "build backend, which requires it)"
        ) from exc
    target = proto.with_name(proto.stem + "_pb2.py")
    with tempfile.TemporaryDirectory(prefix="carton-protoc-") as scratch:
        status = protoc.main(["protoc", f"-I{source_root}", f"--python_out={scratch}", PROTO_RELATIVE])
        produced = Path(scratch) / PROTO_RELATIVE.replace(".proto", "_pb2.py")
        if status != 0 or not produced.is_file():
            raise RuntimeError(f"protoc failed on {PROTO_RELATIVE} (exit status {status})")
        fd, partial = tempfile.mkstemp(dir=target.parent, prefix=".kserve_v2_pb2-", suffix=".partial")
        os.close(fd)
        try:
            shutil.copyfile(produced, partial)
            Path(partial).replace(target)
        finally:
            Path(partial).unlink(missing_ok=True)
    return target
