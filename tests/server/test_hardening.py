"""What a client can learn from or leave behind in the server: messages (paths, internal names, its own names echoed
verbatim), index entries for names that exist nowhere, request timeouts, uploads over tritonclient.http, and upload
folders of killed servers."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from carton.server import ModelControlMode, Server, ServerOptions, load_carton, serve_in_thread
from tritonclient.utils import InferenceServerException

from .conftest import _onnx_model, _pack, _vi, assert_doubles

_UUID = re.compile(r"[0-9a-f]{32}")


def _post(server: Server, path: str, document: object) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}{path}", data=json.dumps(document).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


def _index(server: Server) -> list[dict[str, str]]:
    status, text = _post(server, "/v2/repository/index", {})
    assert status == 200
    return json.loads(text)  # type: ignore[no-any-return]


# ---- 1: relative repository roots are not replaced inside names ----------------------------------------------------
@pytest.mark.parametrize("root", ["models/", "repo"])
def test_relative_repository_root_leaves_names_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cartons: dict[str, Path], root: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / root / "sum" / "1").mkdir(parents=True)
    shutil.copy(cartons["sum"], tmp_path / root / "sum" / "1" / "model.carton")
    (tmp_path / root / "bad" / "1").mkdir(parents=True)
    (tmp_path / root / "bad" / "1" / "model.carton").write_bytes(b"PK\x03\x04 not a carton")
    options = ServerOptions(
        repository=Path(root), http_port=0, grpc_port=None, model_control_mode=ModelControlMode.EXPLICIT
    )
    with serve_in_thread(options) as server:
        status, message = _post(server, "/v2/repository/models/nomodels/load", {})
        assert (status, message) == (400, "failed to load 'nomodels': no such model in the repository")
        status, message = _post(server, "/v2/repository/models/repository/load", {})
        assert (status, message) == (400, "failed to load 'repository': no such model in the repository")
        status, message = _post(server, "/v2/repository/models/bad/load", {})
        assert status == 400 and message.startswith("failed to load 'bad': version 1: "), message
        assert "bad/1/model.carton" in message and str(tmp_path) not in message, message
        assert _post(server, "/v2/repository/models/sum/load", {})[0] == 200


# ---- 2: failed loads leave the index as it was ---------------------------------------------------------------------
def test_failed_loads_leave_the_index_unchanged(server: Server, cartons: dict[str, Path]) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    before = client.get_model_repository_index()
    for name in ("doesnotexist", "a%2Fb", "a/b", ".."):
        with pytest.raises(InferenceServerException):
            client.load_model(name)
    with pytest.raises(InferenceServerException, match="plain name"):
        client.load_model("evil", config="{}", files={"file:1/../../x": b"x"})
    with pytest.raises(InferenceServerException, match="failed to load 'corrupt'"):
        client.load_model("corrupt", config="{}", files={"file:1/model.carton": b"PK\x03\x04 junk"})
    assert client.get_model_repository_index() == before
    for name in ("doesnotexist", "evil"):
        client.unload_model(name)
        with pytest.raises(InferenceServerException, match="is not found"):
            client.get_model_metadata(name)
    assert client.get_model_repository_index() == before

    # An uploaded model is listed while it serves, and forgotten once unloaded (it exists nowhere else).
    client.load_model("transient", config="{}", files={"file:1/model.carton": cartons["identity"].read_bytes()})
    assert {"name": "transient", "version": "1", "state": "READY"} in client.get_model_repository_index()
    client.unload_model("transient")
    deadline = time.monotonic() + 30
    while client.get_model_repository_index() != before:
        assert time.monotonic() < deadline, client.get_model_repository_index()
        time.sleep(0.05)


# ---- 3: messages carry no internal names, no upload folders, and echo the client's names verbatim ------------------
def test_upload_errors_name_the_clients_parameters(server: Server) -> None:
    payload = base64.b64encode(b"PK\x03\x04 not a carton").decode()
    status, message = _post(
        server, "/v2/repository/models/bad1/load", {"parameters": {"config": "{}", "file:1/model.carton": payload}}
    )
    assert status == 400 and message.startswith("failed to load 'bad1': version 1: "), message
    assert "file:1/model.carton" in message, message
    assert "<upload>" not in message and not _UUID.search(message) and "/tmp" not in message, message


def test_the_clients_own_names_are_echoed_verbatim(server: Server) -> None:
    status, message = _post(server, "/v2/repository/models/m/load", {"parameters": {"config": "{}", "file:/etc/x": ""}})
    assert status == 400 and "'file:/etc/x'" in message, message
    status, message = _post(
        server, "/v2/repository/models/m/load", {"parameters": {"config": "{}", "file:1/../../etc/x": ""}}
    )
    assert status == 400 and "'file:1/../../etc/x'" in message, message


@pytest.fixture(scope="module")
def spinning_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real ONNX model that loops (practically) forever, served with a 1 s request timeout."""
    from onnx import TensorProto, helper

    fp32 = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["acc_in", "one"], ["acc"])],
        "body",
        [_vi("i", TensorProto.INT64, []), _vi("cond_in", TensorProto.BOOL, []), _vi("acc_in", fp32, [1])],
        [_vi("cond_out", TensorProto.BOOL, []), _vi("acc", fp32, [1])],
        [helper.make_tensor("one", fp32, [1], [1.0])],
    )
    model = _onnx_model(
        [helper.make_node("Loop", ["trips", "go", "INPUT0"], ["OUTPUT0"], body=body)],
        [_vi("INPUT0", fp32, [1])],
        [_vi("OUTPUT0", fp32, [1])],
        [
            helper.make_tensor("trips", TensorProto.INT64, [], [10**15]),
            helper.make_tensor("go", TensorProto.BOOL, [], [True]),
        ],
    )
    root = tmp_path_factory.mktemp("spinning")
    (root / "repo" / "spin" / "1").mkdir(parents=True)
    _pack(model, root / "src", root / "repo" / "spin" / "1" / "model.carton")
    from carton import RunnerLimits

    options = ServerOptions(
        repository=root / "repo", http_port=0, grpc_port=0, model_control_mode=ModelControlMode.NONE,
        loader=functools.partial(load_carton, limits=RunnerLimits(request_seconds=1.0)),
    )  # fmt: skip
    with serve_in_thread(options) as running:
        yield running


def test_request_timeout_is_503_unavailable_without_internal_names(spinning_server: Server) -> None:
    expected = "model 'spin' version 1 did not answer within the server's request timeout of 1 s"
    client = httpclient.InferenceServerClient(f"127.0.0.1:{spinning_server.http_port}", network_timeout=60)
    tensor = httpclient.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.zeros(1, np.float32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("spin", [tensor])
    assert caught.value.status() == "503" and expected in caught.value.message(), caught.value
    for internal in ("carton_runner", "Runner", "pid", ":MCF", ":Onnx"):
        assert internal not in caught.value.message()

    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{spinning_server.grpc_port}")
    grpc_tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
    grpc_tensor.set_data_from_numpy(np.zeros(1, np.float32))
    with pytest.raises(InferenceServerException) as caught:
        grpc.infer("spin", [grpc_tensor], client_timeout=60)
    assert caught.value.status() == "StatusCode.UNAVAILABLE" and expected in caught.value.message()
    assert client.is_server_live() and client.is_model_ready("spin")


# ---- 6: uploading with tritonclient.http ---------------------------------------------------------------------------
def test_tritonclient_http_upload(server: Server, cartons: dict[str, Path]) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    files = {"file:2/model.carton": cartons["double"].read_bytes()}
    client.load_model("http_upload", config=json.dumps({"name": "http_upload"}), files=files)
    assert client.get_model_metadata("http_upload")["versions"] == ["2"]
    assert_doubles(client, "http_upload")
    client.unload_model("http_upload")
    assert not client.is_model_ready("http_upload")


def test_upload_under_the_default_best_effort_sandbox(repository: Path, cartons: dict[str, Path]) -> None:
    """The default upload policy runs the model in every sandbox layer this machine has (warning about the rest)."""
    options = ServerOptions(
        repository=repository, http_port=0, grpc_port=None, model_control_mode=ModelControlMode.EXPLICIT
    )
    assert options.upload_sandbox == "best_effort"
    with serve_in_thread(options) as running:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")
        client.load_model("sandboxed", config="{}", files={"file:1/model.carton": cartons["double"].read_bytes()})
        assert_doubles(client, "sandboxed", (1, 2))


# ---- 4: upload folders of killed servers are swept at start --------------------------------------------------------
def test_upload_folder_of_a_killed_server_is_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repository: Path
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "carton", "serve", str(repository), "--http-port", "0", "--no-grpc",
         "--model-control-mode", "explicit"],
        env={**os.environ, "TMPDIR": str(temp)}, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not list(temp.glob("carton-serve-uploads-*")):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        (left,) = temp.glob("carton-serve-uploads-*")
        assert left.name.startswith(f"carton-serve-uploads-{process.pid}-")
        (left / "m").mkdir()
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    assert left.is_dir()  # SIGKILL skipped the server's own cleanup

    live = temp / f"carton-serve-uploads-{os.getpid()}-other"  # a live server's folder (this process)
    live.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    server = Server(ServerOptions(repository=repository, http_port=0, grpc_port=None))
    try:
        assert not left.exists() and live.is_dir()
        assert server._upload_root.parent == temp and server._upload_root.is_dir()
    finally:
        asyncio.run(server.stop())
    assert not server._upload_root.exists() and live.is_dir()
