"""What the repository reports about models that did not load, and uploads that replace a repository model:
a bad config.json is named as config.json and listed UNAVAILABLE with its reason, `strict_readiness` (Triton's
--strict-readiness) makes the server not ready while such a model is failed, and a ``file:`` upload of a new version
of a repository model is served whatever the carton's file name, with messages that name the model, never the
server's upload folder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from carton.server import ModelControlMode, Server, ServerOptions, serve_in_thread
from tritonclient.utils import InferenceServerException

from .conftest import assert_doubles


def _repository(root: Path, cartons: dict[str, Path]) -> Path:
    """sum (REPO/sum.carton), good (double), badconfig (a valid carton, a config.json with a wrong field),
    truncated (version 1 is a truncated carton)."""
    repo = root / "repo"
    repo.mkdir()
    shutil.copy(cartons["sum"], repo / "sum.carton")
    (repo / "good" / "1").mkdir(parents=True)
    shutil.copy(cartons["double"], repo / "good" / "1" / "model.carton")
    (repo / "badconfig" / "1").mkdir(parents=True)
    shutil.copy(cartons["double"], repo / "badconfig" / "1" / "model.carton")
    (repo / "badconfig" / "config.json").write_text(json.dumps({"max_batch_size": "eight"}))
    (repo / "truncated" / "1").mkdir(parents=True)
    data = cartons["double"].read_bytes()
    (repo / "truncated" / "1" / "model.carton").write_bytes(data[: len(data) // 2])
    return repo


def _options(repo: Path, **overrides: object) -> ServerOptions:
    settings: dict[str, object] = {
        "repository": repo,
        "http_port": 0,
        "grpc_port": 0,
        "model_control_mode": ModelControlMode.EXPLICIT,
        "load_models": ("*",),
        "upload_sandbox": None,
    }
    settings.update(overrides)
    return ServerOptions(**settings)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, cartons: dict[str, Path]) -> Path:
    return _repository(tmp_path_factory.mktemp("states"), cartons)


@pytest.fixture
def server(repo: Path) -> Iterator[Server]:
    with serve_in_thread(_options(repo)) as running:
        yield running


def _http(server: Server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")


def _grpc_ready(server: Server) -> bool:
    return bool(grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}").is_server_ready())


# ---- config.json errors ---------------------------------------------------------------------------------------------
def test_a_bad_config_json_is_named_as_such_and_listed_unavailable_with_its_reason(server: Server) -> None:
    client = _http(server)
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("badconfig")
    message = caught.value.message()
    assert caught.value.status() == "400"
    assert "config.json" in message and "max_batch_size" in message and "'config' parameter" not in message
    entries = [entry for entry in client.get_model_repository_index() if entry["name"] == "badconfig"]
    assert len(entries) == 1 and entries[0]["state"] == "UNAVAILABLE", entries
    assert "config.json" in entries[0]["reason"] and "max_batch_size" in entries[0]["reason"], entries
    assert "repo" not in entries[0]["reason"] and "/" not in entries[0]["reason"], entries
    grpc_entries = [
        entry for entry in grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        .get_model_repository_index(as_json=True)["models"]
        if entry["name"] == "badconfig"
    ]  # fmt: skip
    assert grpc_entries == entries


def test_a_config_parameter_is_named_as_the_config_parameter(server: Server) -> None:
    with pytest.raises(InferenceServerException) as caught:
        _http(server).load_model("good", config=json.dumps({"max_batch_size": "eight"}))
    assert "the 'config' parameter" in caught.value.message() and "config.json" not in caught.value.message()
    assert _http(server).is_model_ready("good")  # a failed reload leaves the serving version alone


def test_a_truncated_carton_is_listed_unavailable_with_its_reason(server: Server) -> None:
    (entry,) = [entry for entry in _http(server).get_model_repository_index() if entry["name"] == "truncated"]
    assert entry["version"] == "1" and entry["state"] == "UNAVAILABLE" and entry["reason"], entry


def test_fixing_config_json_and_loading_again_clears_the_failure(tmp_path: Path, cartons: dict[str, Path]) -> None:
    repo = _repository(tmp_path, cartons)
    with serve_in_thread(_options(repo)) as running:
        client = _http(running)
        (repo / "badconfig" / "config.json").write_text(json.dumps({"max_batch_size": 0}))
        client.load_model("badconfig")
        entries = [entry for entry in client.get_model_repository_index() if entry["name"] == "badconfig"]
        assert entries == [{"name": "badconfig", "version": "1", "state": "READY"}], entries


# ---- strict readiness -----------------------------------------------------------------------------------------------
def test_readiness_by_default_ignores_failed_models(server: Server) -> None:
    assert _http(server).is_server_ready() and _grpc_ready(server)


def test_strict_readiness_is_false_while_a_model_that_should_be_loaded_failed(
    tmp_path: Path, cartons: dict[str, Path]
) -> None:
    repo = _repository(tmp_path, cartons)
    with serve_in_thread(_options(repo, strict_readiness=True)) as running:
        client = _http(running)
        assert client.is_server_live() and client.is_model_ready("good")
        assert not client.is_server_ready() and not _grpc_ready(running)
        client.unload_model("badconfig")
        assert not client.is_server_ready()  # truncated is still failed
        client.unload_model("truncated")
        # An unload says the operator no longer wants the model: it is "unloaded", which strict readiness accepts.
        assert client.is_server_ready() and _grpc_ready(running)
        index = {entry["name"]: entry for entry in client.get_model_repository_index()}
        assert index["truncated"]["state"] == "UNAVAILABLE" and index["truncated"]["reason"] == "unloaded", index
        assert index["badconfig"]["state"] == "UNAVAILABLE" and index["badconfig"]["reason"] == "unloaded", index


def test_strict_readiness_ignores_models_never_asked_for(tmp_path: Path, cartons: dict[str, Path]) -> None:
    repo = _repository(tmp_path, cartons)
    with serve_in_thread(_options(repo, strict_readiness=True, load_models=("good",))) as running:
        assert _http(running).is_server_ready() and _grpc_ready(running)


# ---- file: uploads that replace a repository model ------------------------------------------------------------------
@pytest.mark.parametrize("filename", ["model.carton", "model.bin"])
def test_upload_replaces_a_repository_model_with_a_new_version(
    server: Server, cartons: dict[str, Path], filename: str
) -> None:
    """As in Triton: the upload is served instead of the repository's model; a plain load goes back to the latter."""
    client = _http(server)
    x = np.array([3, 4], dtype=np.int64)
    tensors = [httpclient.InferInput("INPUT0", [2], "INT64"), httpclient.InferInput("INPUT1", [2], "INT64")]
    for tensor in tensors:
        tensor.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("sum", tensors).as_numpy("OUTPUT0"), x + x)

    files = {f"file:2/{filename}": cartons["double"].read_bytes()}
    client.load_model("sum", config=json.dumps({"name": "sum"}), files=files)
    assert client.get_model_metadata("sum")["versions"] == ["2"]
    assert_doubles(client, "sum")

    client.load_model("sum")
    assert client.get_model_metadata("sum")["versions"] == ["1"]
    np.testing.assert_array_equal(client.infer("sum", tensors).as_numpy("OUTPUT0"), x + x)


def test_upload_over_grpc_with_any_file_name(server: Server, cartons: dict[str, Path]) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.load_model("grpc_bin", config="{}", files={"file:1/weights.bin": cartons["double"].read_bytes()})
    assert client.is_model_ready("grpc_bin")
    client.unload_model("grpc_bin")


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"file:1/model.bin": b"PK\x03\x04 not a carton"}, "failed to load 'sum': version 1: file:1/model.bin"),
        (
            {"file:1/a.bin": b"x", "file:1/b.bin": b"y"},
            "failed to load 'sum': version 1 holds neither model.carton, an unpacked carton (carton.toml), "
            "nor a single carton file",
        ),
    ],
)
def test_upload_errors_name_the_model_and_the_clients_files(
    server: Server, files: dict[str, bytes], expected: str
) -> None:
    for port, module in ((server.http_port, httpclient), (server.grpc_port, grpcclient)):
        client = module.InferenceServerClient(f"127.0.0.1:{port}")
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("sum", config="{}", files=files)
        message = caught.value.message()
        assert caught.value.status() in ("400", str(grpc.StatusCode.INVALID_ARGUMENT)), caught.value
        assert message.startswith(expected), message
        for internal in ("carton-serve-uploads", "/tmp", str(server.repository)):
            assert internal not in message, message
        assert not any(len(word) == 32 and set(word) <= set("0123456789abcdef") for word in message.split("/"))
        assert client.is_model_ready("sum")  # the repository's model keeps serving
