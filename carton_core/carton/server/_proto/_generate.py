"""Generate ``kserve_v2_pb2.py`` from ``kserve_v2.proto`` with protoc (from ``grpcio-tools``, a test dependency).

The generated module is committed; ``tests/server/test_proto.py`` regenerates it with the pinned grpcio-tools and
fails if anything changed, as MLServer does with its stubs. After editing the .proto, run
``python -m carton.server._proto`` (with the test extra installed) and commit both files.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["PROTO_RELATIVE", "generate", "render"]

#: The .proto, relative to the folder that holds the ``carton`` package; this path is also the name the file is
#: registered under in protobuf's descriptor pool, so it must stay unique (tritonclient's is ``grpc_service.proto``).
PROTO_RELATIVE = "carton/server/_proto/kserve_v2.proto"


def render(source_root: Path) -> bytes:
    """What protoc writes for ``source_root/carton/server/_proto/kserve_v2.proto``.

    `RuntimeError` if the .proto or ``grpcio-tools`` is missing, or protoc fails.
    """
    proto = source_root / PROTO_RELATIVE
    if not proto.is_file():
        raise RuntimeError(f"{proto} is missing")
    try:
        from grpc_tools import protoc  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError("generating carton's gRPC stubs needs grpcio-tools (in the test extra)") from exc
    with tempfile.TemporaryDirectory(prefix="carton-protoc-") as scratch:
        status = protoc.main(["protoc", f"-I{source_root}", f"--python_out={scratch}", PROTO_RELATIVE])
        produced = Path(scratch) / PROTO_RELATIVE.replace(".proto", "_pb2.py")
        if status != 0 or not produced.is_file():
            raise RuntimeError(f"protoc failed on {PROTO_RELATIVE} (exit status {status})")
        return produced.read_bytes()


def generate(source_root: Path) -> Path:
    """Write `render`'s output beside the .proto (through a temporary file, so an import never reads half of it)."""
    data = render(source_root)
    target = (source_root / PROTO_RELATIVE).with_name("kserve_v2_pb2.py")
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=".kserve_v2_pb2-", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
        Path(partial).chmod(0o644)
        Path(partial).replace(target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target
