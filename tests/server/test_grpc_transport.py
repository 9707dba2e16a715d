"""The gRPC transport's own answers (carton/server/_grpc_transport.py): what it does with calls that never reach a
method, messages too large or not messages at all, responses larger than the client's flow-control window, and
bytes that are not HTTP/2."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from carton.server import Server
from carton.server._grpc import GrpcService
from carton.server._grpc_transport import GrpcServer, _Connection
from tritonclient.utils import InferenceServerException

from .in_process import in_process_app
from .test_http_fixed_heads import Echo

SERVICE = "/inference.GRPCInferenceService"


@pytest.fixture
def channel(server: Server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as opened:
        yield opened


def _raw_call(channel: grpc.Channel, path: str, payload: bytes) -> bytes:
    call = channel.unary_unary(path)  # no serializers: the bytes go as they are
    return call(payload, timeout=30)  # type: ignore[no-any-return]


def _still_serves(server: Server) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert client.is_server_live() and client.is_model_ready("identity")
    client.close()


@pytest.mark.parametrize("path", [f"{SERVICE}/NoSuchMethod", "/other.Service/ModelInfer", "/"])
def test_an_unknown_method_is_unimplemented(server: Server, channel: grpc.Channel, path: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _raw_call(channel, path, b"")
    assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "unknown method" in caught.value.details()
    _still_serves(server)


def test_a_request_that_is_not_a_message_is_invalid_argument(server: Server, channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _raw_call(channel, f"{SERVICE}/ModelInfer", b"\xff\xff\xff\xff not protobuf")
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "the ModelInfer request is not a valid ModelInferRequest message"
    _still_serves(server)


def test_a_message_over_the_size_limit_is_resource_exhausted(server: Server, channel: grpc.Channel) -> None:
    limit = server.options.max_body_size
    with pytest.raises(grpc.RpcError) as caught:
        _raw_call(channel, f"{SERVICE}/ModelInfer", b"\x00" * (limit + 1))
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.details() == f"request message of {limit + 1} bytes is over the {limit}-byte limit"
    _still_serves(server)


def test_a_message_of_exactly_the_size_limit_reaches_its_method(server: Server, channel: grpc.Channel) -> None:
    from carton.server._grpc import message_type

    limit = server.options.max_body_size
    request = message_type("ModelInferRequest")(model_name="no_such_model")
    request.id = "x" * (limit - request.ByteSize() - 5)  # the field's tag and 4-byte length take 5 bytes
    payload = request.SerializeToString()
    assert len(payload) == limit
    with pytest.raises(grpc.RpcError) as caught:
        _raw_call(channel, f"{SERVICE}/ModelInfer", payload)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND  # parsed and answered by the method
    _still_serves(server)


def test_large_streamed_messages_arrive_in_pieces_and_whole(server: Server, channel: grpc.Channel) -> None:
    from carton.server._grpc import message_type

    request_type, response_type = message_type("ModelInferRequest"), message_type("ModelStreamInferResponse")
    requests = [request_type(model_name="no_such_model", id=str(n) + "x" * 3_000_000) for n in range(3)]
    stream = channel.stream_stream(
        f"{SERVICE}/ModelStreamInfer",
        request_serializer=request_type.SerializeToString,
        response_deserializer=response_type.FromString,
    )
    responses = list(stream(iter(requests), timeout=30))
    assert len(responses) == 3  # each message parsed once whole, in order
    assert all("no_such_model" in response.error_message for response in responses)
    _still_serves(server)


def test_a_response_larger_than_the_flow_control_window_arrives_whole(server: Server) -> None:
    # A fresh connection's window is 64 KiB: the 3 MB response is sent in pieces as the client gives window back.
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}", channel_args=options)
    x = np.random.default_rng(0).random((1, 750_000), dtype=np.float32)
    tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("identity", [tensor]).as_numpy("OUTPUT0"), x * 2)
    client.close()


def test_an_error_message_keeps_characters_outside_ascii(server: Server) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    with pytest.raises(InferenceServerException, match="modèle-ü%") as caught:
        client.get_model_metadata("modèle-ü%")
    assert caught.value.status() == str(grpc.StatusCode.NOT_FOUND)
    client.close()


def test_bytes_that_are_not_http2_close_only_that_connection(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=30) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):  # the server's SETTINGS and GOAWAY, then the end of the connection
            received += chunk
    assert received[3:4] == b"\x04"  # a SETTINGS frame first: it spoke HTTP/2 and no HTTP/1.1
    _still_serves(server)


def test_a_connection_keeps_its_attributes_inline(tmp_path: Path) -> None:
    # Python 3.11 keeps an instance's attributes inline (each read specialized) only while it has fewer than 30; past
    # that every attribute read of a connection, several dozen per call, is a dictionary lookup.
    _, repository = in_process_app(tmp_path, ("echo",), lambda spec: Echo(), asyncio.run)
    try:
        server = GrpcServer(GrpcService(repository, server_version="t"), max_message_size=1 << 20)
        assert len(vars(_Connection(server))) < 30
    finally:
        asyncio.run(repository.close())
