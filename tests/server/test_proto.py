"""The committed gRPC stubs: regenerating them changes nothing, the protobuf pin matches their generator, carton's own
proto package is wire-identical to tritonclient's copy of the protocol and importable next to tritonclient in one
process."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import carton.server._proto as proto
import pytest
import tritonclient.grpc.service_pb2 as triton_pb2
from carton.server._proto._generate import PROTO_RELATIVE, generate, render
from carton.server.errors import ServerError
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from packaging.requirements import Requirement
from packaging.version import Version


def test_messages_live_in_carton_package_next_to_tritonclients() -> None:
    ours = proto.message_class("ModelInferRequest").DESCRIPTOR
    assert ours.full_name == "carton.kserve.v2.ModelInferRequest"
    assert ours.file.name == PROTO_RELATIVE
    # tritonclient's copy is registered too, under the protocol's own names: no clash in the default pool.
    pool = descriptor_pool.Default()
    assert pool.FindMessageTypeByName("inference.ModelInferRequest") is triton_pb2.ModelInferRequest.DESCRIPTOR
    assert pool.FindMessageTypeByName("carton.kserve.v2.ModelInferRequest") is ours
    assert proto.SERVICE_NAME == "inference.GRPCInferenceService"


def _repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _check_layout(ours: Descriptor, theirs: Descriptor, path: str, seen: set[str]) -> None:
    """Every field of ours has the number, name, type and repeatedness of Triton's (recursing into messages).

    Ours may leave fields out (config fields carton does not use): an unknown field is skipped by a reader, so the
    subset is what has to match.
    """
    if ours.full_name in seen:
        return
    seen.add(ours.full_name)
    by_number = {field.number: field for field in theirs.fields}
    for field in ours.fields:
        other = by_number.get(field.number)
        where = f"{path}.{field.name}"
        assert other is not None, f"{where}: field {field.number} is not in Triton's protocol"
        assert (field.name, field.type, _repeated(field)) == (other.name, other.type, _repeated(other)), where
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            _check_layout(field.message_type, other.message_type, where, seen)
        if field.type == FieldDescriptor.TYPE_ENUM:
            assert {v.name: v.number for v in field.enum_type.values}.items() <= {
                v.name: v.number for v in other.enum_type.values
            }.items(), where


def test_every_message_has_tritonclients_wire_layout() -> None:
    import tritonclient.grpc.model_config_pb2  # noqa: F401  (registers inference.ModelConfig)

    module = proto.messages()
    names = sorted(module.DESCRIPTOR.message_types_by_name)
    assert "ModelInferRequest" in names and "RepositoryModelLoadRequest" in names and "ModelConfig" in names
    pool = descriptor_pool.Default()
    seen: set[str] = set()
    for name in names:
        theirs = pool.FindMessageTypeByName(f"inference.{name}")
        _check_layout(module.DESCRIPTOR.message_types_by_name[name], theirs, name, seen)
    # The request and response messages of inference carry every field Triton's do.
    for name in ("ModelInferRequest", "ModelInferResponse", "RepositoryModelLoadRequest"):
        ours = {f.number for f in module.DESCRIPTOR.message_types_by_name[name].fields}
        assert ours == {f.number for f in pool.FindMessageTypeByName(f"inference.{name}").fields}, name


def test_bytes_cross_both_ways_unchanged() -> None:
    request = triton_pb2.ModelInferRequest(model_name="identity", model_version="2", id="r-1")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 2])
    tensor.parameters["binary_data_size"].int64_param = 8
    request.outputs.add(name="OUTPUT0").parameters["binary_data"].bool_param = True
    request.raw_input_contents.append(b"\x00\x00\x80?\x00\x00\x00@")
    request.parameters["sequence_id"].uint64_param = 7
    wire = request.SerializeToString(deterministic=True)
    ours = proto.message_class("ModelInferRequest").FromString(wire)
    assert ours.inputs[0].shape == [1, 2] and ours.raw_input_contents[0] == b"\x00\x00\x80?\x00\x00\x00@"
    assert ours.SerializeToString(deterministic=True) == wire
    load = proto.message_class("RepositoryModelLoadRequest")(model_name="m")
    load.parameters["file:1/model.carton"].bytes_param = b"\x00\x01"
    load.parameters["config"].string_param = "{}"
    wire = load.SerializeToString(deterministic=True)
    assert triton_pb2.RepositoryModelLoadRequest.FromString(wire).SerializeToString(deterministic=True) == wire


SOURCE_ROOT = Path(proto.__file__).resolve().parents[3]
STUBS = Path(proto.__file__).with_name("kserve_v2_pb2.py")


def test_regenerating_the_committed_stubs_changes_nothing() -> None:
    import grpc_tools  # the pinned generator of the test extra

    regenerated = render(SOURCE_ROOT)
    assert regenerated == STUBS.read_bytes(), (
        f"kserve_v2_pb2.py differs from what grpcio-tools {importlib.metadata.version('grpcio-tools')} generates "
        f"from kserve_v2.proto ({grpc_tools.__file__}): run `python -m carton.server._proto` with the test extra's "
        "grpcio-tools and commit the result"
    )


def test_protobuf_requirement_matches_the_stubs_generator() -> None:
    """The stubs refuse a protobuf runtime older than their generator, or of another major version."""
    stamped = re.search(r"^# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)$", STUBS.read_text(), re.MULTILINE)
    assert stamped is not None
    major, minor, patch = (int(part) for part in stamped.groups())
    requirements = importlib.metadata.requires("carton-runtime") or []
    (protobuf,) = [Requirement(text) for text in requirements if Requirement(text).name == "protobuf"]
    assert str(protobuf.specifier) == f"<{major + 1},>={major}.{minor}.{patch}", protobuf
    import google.protobuf

    assert Version(google.protobuf.__version__) in protobuf.specifier


def test_generate_writes_the_module_beside_the_proto(tmp_path: Path) -> None:
    target = tmp_path / PROTO_RELATIVE
    target.parent.mkdir(parents=True)
    target.write_bytes((SOURCE_ROOT / PROTO_RELATIVE).read_bytes())
    generated = generate(tmp_path)
    assert generated == target.with_name("kserve_v2_pb2.py")
    assert generated.read_bytes() == STUBS.read_bytes()
    # Written through a temporary file that is gone afterwards.
    assert {p.name for p in target.parent.iterdir()} == {"kserve_v2.proto", "kserve_v2_pb2.py"}


def test_generate_refuses_a_missing_proto(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"kserve_v2\.proto is missing"):
        generate(tmp_path)


def test_unknown_message_is_a_server_error() -> None:
    with pytest.raises(ServerError, match="no message 'Nope'"):
        proto.message_class("Nope")
