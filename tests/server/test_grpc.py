"""Every call tritonclient.grpc offers for the endpoints the server implements, including model upload."""

from __future__ import annotations

import asyncio
import json
import queue
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from carton.server import Server
from carton.server._proto import message_class
from tritonclient.utils import InferenceServerException

from .conftest import arange


@pytest.fixture(scope="module")
def client(server: Server) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


def _input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_health_metadata_config(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.get_server_metadata(as_json=True)["name"] == "carton"
    assert client.is_model_ready("identity")
    assert not client.is_model_ready("identity", "1")
    metadata = client.get_model_metadata("identity", as_json=True)
    assert metadata["versions"] == ["2"]
    assert metadata["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": ["-1", "-1"]}]
    config = client.get_model_config("batched", as_json=True)["config"]
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "20000"
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("nosuch")
    assert caught.value.status() == str(grpc.StatusCode.NOT_FOUND)


def test_infer_raw_and_typed_contents(client: grpcclient.InferenceServerClient) -> None:
    x = arange((2, 8))
    result = client.infer("identity", [_input("INPUT0", x, "FP32")], request_id="g1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)
    assert result.get_response().id == "g1"
    a, b = np.array([3, 4], np.int64), np.array([1, 1], np.int64)
    result = client.infer(
        "sum", [_input("INPUT0", a, "INT64"), _input("INPUT1", b, "INT64")],
        outputs=[grpcclient.InferRequestedOutput("OUTPUT0")],
    )  # fmt: skip
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    assert result.as_numpy("OUTPUT1") is None
    text = np.array([b"a", "ü".encode(), b""], dtype=object)
    echoed = client.infer("strings", [_input("TEXT", text, "BYTES")]).as_numpy("ECHO")
    assert echoed.tolist() == text.tolist()


def test_infer_errors(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="data-type is 'INT32'") as caught:
        client.infer("identity", [_input("INPUT0", np.zeros((1, 2), np.int32), "INT32")])
    assert caught.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(InferenceServerException, match="unexpected inference output 'NOPE'"):
        client.infer("identity", [_input("INPUT0", arange((1, 2)), "FP32")],
                     outputs=[grpcclient.InferRequestedOutput("NOPE")])  # fmt: skip


def test_raw_inputs_of_a_layout_seen_before_are_checked_again(server: Server) -> None:
    request_class = message_class("ModelInferRequest")

    def request(raw: bytes) -> object:
        message = request_class(model_name="identity")
        message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 2])
        message.raw_input_contents.append(raw)
        return message

    x = arange((1, 2))
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=message_class("ModelInferResponse").FromString,
        )
        for round_ in range(3):
            response = infer(request((x + round_).tobytes()))
            output = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(1, 2)
            np.testing.assert_array_equal(output, (x + round_) * 2)
        with pytest.raises(grpc.RpcError) as caught:
            infer(request(x.tobytes()[:4]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "4 bytes of data, but shape [1, 2] of FP32 needs 8" in caught.value.details()
        np.testing.assert_array_equal(
            np.frombuffer(infer(request(x.tobytes())).raw_output_contents[0], np.float32), x.ravel() * 2
        )


def test_stream_infer(client: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(3):
            client.async_stream_infer("identity", [_input("INPUT0", arange((1, 4)) + i, "FP32")], request_id=str(i))
        client.async_stream_infer("identity", [_input("INPUT0", np.zeros((1, 2), np.int32), "INT32")])
        received = [results.get(timeout=30) for _ in range(4)]
    finally:
        client.stop_stream()
    ok = {r.get_response().id: r.as_numpy("OUTPUT0") for r, e in received if e is None}
    for i in range(3):
        np.testing.assert_array_equal(ok[str(i)], (arange((1, 4)) + i) * 2)
    errors = [e for _, e in received if e is not None]
    assert len(errors) == 1 and "data-type" in str(errors[0])


def test_statistics_and_index(client: grpcclient.InferenceServerClient) -> None:
    client.infer("identity", [_input("INPUT0", arange((1, 2)), "FP32")])
    stats = client.get_inference_statistics("identity", as_json=True)["model_stats"][0]
    assert stats["name"] == "identity" and int(stats["inference_stats"]["success"]["count"]) >= 1
    models = client.get_model_repository_index(as_json=True)["models"]
    assert {"name": "identity", "version": "2", "state": "READY"} in models


def test_upload_whole_carton(client: grpcclient.InferenceServerClient, cartons: dict[str, Path]) -> None:
    files = {"file:3/model.carton": cartons["double"].read_bytes()}
    with pytest.raises(InferenceServerException, match="'config' parameter is required"):
        client.load_model("uploaded", files=files)
    client.load_model("uploaded", config=json.dumps({"name": "uploaded"}), files=files)
    assert client.get_model_metadata("uploaded", as_json=True)["versions"] == ["3"]
    result = client.infer("uploaded", [_input("INPUT0", arange((1, 3)), "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), arange((1, 3)) * 2)
    client.unload_model("uploaded")
    assert not client.is_model_ready("uploaded")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"file:1/../../escape.carton": b"x"}, "plain name"),
        ({"file:../model.carton": b"x"}, "expected 'file:<version>/<path>'"),
        ({"file:0/model.carton": b"x"}, "expected 'file:<version>/<path>'"),
        ({"file:1//etc/passwd": b"x"}, "plain name"),
        ({"file:1/model.carton": b"PK\x03\x04 not a zip at all"}, "failed to load 'up'"),
    ],
)
def test_upload_refused(client: grpcclient.InferenceServerClient, files: dict[str, bytes], message: str) -> None:
    with pytest.raises(InferenceServerException, match=message) as caught:
        client.load_model("up", config="{}", files=files)
    assert caught.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert "/tmp" not in caught.value.message() and "carton-serve-uploads" not in caught.value.message()
    assert client.is_server_live() and client.is_model_ready("identity")


def test_repository_calls_run_in_a_task_and_infer_answers_without_one(
    server: Server, client: grpcclient.InferenceServerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The repository's load waits with a timeout, which from Python 3.12 needs a current task; an infer call runs
    # without one (the transport steps it), so what it runs must only await futures.
    control = type(server.repository if server.peers is None else server.peers)
    seen: dict[str, asyncio.Task[Any] | None] = {}
    original_load = control.load

    async def load(self: Any, name: str, **kwargs: Any) -> None:
        seen["load"] = asyncio.current_task()
        await original_load(self, name, **kwargs)

    monkeypatch.setattr(control, "load", load)
    client.load_model("strings")
    assert seen["load"] is not None
    # The probe is what a call runs the model through: the handle's `infer`, called by `ServedVersion.infer` and,
    # for a version without batching, directly (`ServedVersion.direct`, bound at load, so patched on the version).
    served = server.repository.get("identity")
    assert served.direct is not None
    original_infer = served.handle.infer

    async def infer(inputs: dict[str, np.ndarray]) -> Any:
        seen["infer"] = asyncio.current_task()
        return await original_infer(inputs)

    monkeypatch.setattr(served.handle, "infer", infer)
    monkeypatch.setattr(served, "direct", infer)
    x = arange((1, 4))
    result = client.infer("identity", [_input("INPUT0", x, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)
    assert "infer" in seen and seen["infer"] is None
