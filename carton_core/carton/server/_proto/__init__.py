"""The KServe v2 gRPC messages, compiled from `grpc_service.proto` by protoc into a private descriptor pool.

Why a descriptor set and a private pool rather than a generated ``_pb2`` module: tritonclient (and Triton's own
Python packages) register the same ``inference.*`` names in protobuf's process-wide default pool, so a second
``grpc_service.proto`` there makes whichever is imported last fail with "duplicate file name". Loading ours into a
pool of its own keeps the protocol's real package name (the wire never carries message names, only the method path
``/inference.GRPCInferenceService/...``) and lets carton's server and tritonclient live in one process.

protoc (from ``grpcio-tools``) runs once per version of the .proto: the compiled ``FileDescriptorSet`` is kept in
the carton cache keyed by the .proto's sha256, so nothing generated is ever written into the source tree.
``python -m carton.server._proto`` compiles it ahead of time (a packaging step can run it after install).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from ..._paths import cache_dir
from ...errors import ServerError

__all__ = ["PROTO_PATH", "SERVICE_NAME", "compile_descriptor_set", "message_class"]

PROTO_PATH = Path(__file__).with_name("grpc_service.proto")
SERVICE_NAME = "inference.GRPCInferenceService"


def _descriptor_set_path() -> Path:
    digest = hashlib.sha256(PROTO_PATH.read_bytes()).hexdigest()[:16]
    return cache_dir() / "server-proto" / f"grpc_service-{digest}.desc"


def compile_descriptor_set() -> Path:
    """Run protoc on `PROTO_PATH` (unless already compiled) and return the path of the ``FileDescriptorSet``."""
    target = _descriptor_set_path()
    if target.is_file():
        return target
    try:
        from grpc_tools import protoc  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ServerError(
            "the gRPC server needs its protocol compiled once and grpcio-tools is not installed: "
            "pip install 'carton[server]'"
        ) from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename, so concurrent first imports never read a half-written file.
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    os.close(fd)
    try:
        status = protoc.main(
            ["protoc", f"-I{PROTO_PATH.parent}", f"--descriptor_set_out={partial}", PROTO_PATH.name]
        )
        if status != 0:
            raise ServerError(f"protoc failed on {PROTO_PATH.name} (exit status {status})")
        Path(partial).replace(target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def _load_pool() -> descriptor_pool.DescriptorPool:
    descriptor_set = descriptor_pb2.FileDescriptorSet.FromString(compile_descriptor_set().read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file_proto in descriptor_set.file:
        pool.Add(file_proto)
    return pool


_POOL = _load_pool()


def message_class(name: str) -> Any:
    """The message class of ``inference.<name>`` (a protobuf `Message` subclass)."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"inference.{name}"))
