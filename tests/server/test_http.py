"""Every call tritonclient.http offers for the endpoints the server implements, against real cartons."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient
from carton.server import Server
from tritonclient.utils import InferenceServerException

from .conftest import arange


@pytest.fixture(scope="module")
def client(server: Server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", concurrency=4)


def _input(name: str, array: np.ndarray, datatype: str, *, binary: bool = True) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def test_health_and_server_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata["name"] == "carton"
    assert set(metadata["extensions"]) == {
        "binary_tensor_data", "model_repository", "model_repository(unload_dependents)", "model_configuration",
        "statistics",
    }  # fmt: skip


def test_model_metadata_readiness_and_versions(client: httpclient.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("identity")
    assert metadata == {
        "name": "identity",
        "versions": ["2"],
        "platform": "carton",
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, -1]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, -1]}],
    }
    assert client.get_model_metadata("identity", "2")["versions"] == ["2"]
    assert client.is_model_ready("identity")
    assert client.is_model_ready("identity", "2")
    assert not client.is_model_ready("identity", "1")
    assert not client.is_model_ready("nosuch")
    with pytest.raises(InferenceServerException, match="version 1 is not found"):
        client.get_model_metadata("identity", "1")
    with pytest.raises(InferenceServerException, match="'nosuch' is not found") as caught:
        client.get_model_metadata("nosuch")
    assert caught.value.status() == "404"
    strings = client.get_model_metadata("strings")
    assert strings["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [-1]}]


def test_model_config(client: httpclient.InferenceServerClient) -> None:
    config = client.get_model_config("batched")
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"] == {"preferred_batch_size": [8], "max_queue_delay_microseconds": 20000}
    assert config["input"] == [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}]
    assert client.get_model_config("identity", "2")["version_policy"] == {"latest": {"num_versions": 1}}


def test_infer_binary_and_json_with_request_id(client: httpclient.InferenceServerClient) -> None:
    x = arange((1, 16))
    result = client.infer("identity", [_input("INPUT0", x, "FP32")], request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)  # version 2 doubles
    response = result.get_response()
    assert response["id"] == "req-7"
    assert response["model_version"] == "2"
    assert response["outputs"][0]["parameters"] == {"binary_data_size": 64}

    json_out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)
    result = client.infer("identity", [_input("INPUT0", x, "FP32", binary=False)], outputs=[json_out])
    assert result.get_response()["outputs"][0]["data"] == (x * 2).ravel().tolist()
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)


def test_infer_specific_version_and_selected_outputs(client: httpclient.InferenceServerClient) -> None:
    client.load_model("identity", config='{"version_policy": {"all": {}}}')
    try:
        assert client.get_model_metadata("identity")["versions"] == ["1", "2"]
        x = arange((2, 3))
        one = client.infer("identity", [_input("INPUT0", x, "FP32")], model_version="1")
        np.testing.assert_array_equal(one.as_numpy("OUTPUT0"), x)
        latest = client.infer("identity", [_input("INPUT0", x, "FP32")])  # no version: the highest one serving
        assert latest.get_response()["model_version"] == "2"
        np.testing.assert_array_equal(latest.as_numpy("OUTPUT0"), x * 2)
    finally:
        client.load_model("identity")
    assert client.get_model_metadata("identity")["versions"] == ["2"]

    a, b = np.array([5, 7, 9], np.int64), np.array([1, 2, 3], np.int64)
    inputs = [_input("INPUT0", a, "INT64"), _input("INPUT1", b, "INT64", binary=False)]
    only_diff = [httpclient.InferRequestedOutput("OUTPUT1")]
    result = client.infer("sum", inputs, outputs=only_diff)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    both = client.infer("sum", inputs)
    np.testing.assert_array_equal(both.as_numpy("OUTPUT0"), a + b)


def test_infer_bytes_tensors(client: httpclient.InferenceServerClient) -> None:
    text = np.array(["héllo", "", "wörld" * 50], dtype=object)
    for binary in (True, False):
        result = client.infer(
            "strings", [_input("TEXT", text, "BYTES", binary=binary)],
            outputs=[httpclient.InferRequestedOutput("ECHO", binary_data=binary)],
        )  # fmt: skip
        echoed = result.as_numpy("ECHO")
        assert [value.decode() if isinstance(value, bytes) else value for value in echoed.tolist()] == list(text)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_request_compression(client: httpclient.InferenceServerClient, algorithm: str) -> None:
    x = arange((4, 8))
    result = client.infer(
        "identity", [_input("INPUT0", x, "FP32")], request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )  # fmt: skip
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)


def test_async_infer(client: httpclient.InferenceServerClient) -> None:
    pending = [client.async_infer("identity", [_input("INPUT0", arange((1, 4)) + i, "FP32")]) for i in range(8)]
    for i, request in enumerate(pending):
        np.testing.assert_array_equal(request.get_result().as_numpy("OUTPUT0"), (arange((1, 4)) + i) * 2)


def test_statistics(client: httpclient.InferenceServerClient) -> None:
    client.infer(
        "sum", [_input("INPUT0", np.ones(2, np.int64), "INT64"), _input("INPUT1", np.ones(2, np.int64), "INT64")]
    )
    stats = client.get_inference_statistics("sum")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("sum", "1")]
    assert stats[0]["inference_stats"]["success"]["count"] >= 1
    assert stats[0]["execution_count"] >= 1
    assert stats[0]["last_inference"] > 0
    everything = client.get_inference_statistics()["model_stats"]
    assert {"sum", "identity", "strings", "batched"} <= {s["name"] for s in everything}
    assert client.get_inference_statistics("sum", "1")["model_stats"][0]["version"] == "1"


def test_repository_index_load_unload(client: httpclient.InferenceServerClient) -> None:
    index = {entry["name"]: entry for entry in client.get_model_repository_index()}
    assert index["sum"] == {"name": "sum", "version": "1", "state": "READY"}
    assert index["broken"] == {"name": "broken"}  # in the repository, never loaded
    with pytest.raises(InferenceServerException, match="failed to load 'broken'"):
        client.load_model("broken")
    index = {entry["name"]: entry for entry in client.get_model_repository_index()}
    assert index["broken"]["state"] == "UNAVAILABLE"
    assert index["broken"]["reason"]
    assert "/" not in index["broken"]["reason"].replace("broken/1/model.carton", "")

    client.unload_model("sum", unload_dependents=True)
    with pytest.raises(InferenceServerException, match="has no available versions") as caught:
        client.infer(
            "sum", [_input("INPUT0", np.ones(1, np.int64), "INT64"), _input("INPUT1", np.ones(1, np.int64), "INT64")]
        )
    assert caught.value.status() == "404"
    states = {e["name"]: e.get("state") for e in client.get_model_repository_index()}
    assert states["sum"] in ("UNLOADING", "UNAVAILABLE")
    client.load_model("sum")
    assert client.is_model_ready("sum")


def test_metrics_endpoint(server: Server, client: httpclient.InferenceServerClient) -> None:
    import urllib.request

    client.infer("identity", [_input("INPUT0", arange((1, 2)), "FP32")])
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics").read().decode()
    assert 'carton_inference_requests_total{model="identity",outcome="success",version="2"}' in text
    assert "carton_inference_request_duration_seconds_bucket" in text
    assert "carton_inference_compute_duration_seconds_count" in text
