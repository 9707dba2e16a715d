"""Several server processes on one port (``carton serve --processes N``): real processes, real sockets.

Which process a connection reaches is the kernel's choice (``SO_REUSEPORT``), so the tests tell them apart by the
coordinator's own counters: the coordinator runs in this process (`serve_in_thread`), its child is a real process.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from carton import RunnerLimits
from carton.server import ModelControlMode, Server, ServerOptions, load_carton, serve_in_thread
from carton.server._process_wire import (
    Call,
    ChildOptions,
    Counters,
    CountersSnapshot,
    Index,
    Readiness,
    Refused,
    Reply,
    Result,
    Statistics,
    StatisticsEntries,
    merge_statistics,
    metrics_text,
)
from carton.server._processes import ProcessGroup
from carton.server.errors import ServerError
from serving_process import Serving, alive, descendants, start_serving, wait_answering

from .conftest import arange

_INFER = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}]}
).encode()


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Server]:
    options = ServerOptions(
        repository=repository,
        http_port=0,
        grpc_port=0,
        model_control_mode=ModelControlMode.EXPLICIT,
        load_models=("identity", "sum"),
        upload_sandbox=None,
        processes=2,
    )
    with serve_in_thread(options) as running:
        yield running
    # Stopping the server stopped its child, and the child's runners with it.
    group = running.peers
    assert isinstance(group, ProcessGroup) and not group._children


def _group(server: Server) -> ProcessGroup:
    assert isinstance(server.peers, ProcessGroup)
    return server.peers


def _ask_child(server: Server, request: object) -> Result:
    """What the child process answers for itself (over the coordinator's channel to it)."""
    (child,) = _group(server)._children
    loop = server.loop
    assert loop is not None
    return asyncio.run_coroutine_threadsafe(child.channel.call(request), loop).result(30)  # type: ignore[arg-type]


def _local_success(server: Server, model: str = "identity") -> int:
    """Successful inferences the coordinator served itself."""
    return sum(v.stats.success.count for v in server.repository.versions(model))


def _rejected_404(server: Server) -> int:
    return int(server.metrics.rejected.labels("404")._value.get())


def _connection(server: Server, *, coordinator: bool) -> http.client.HTTPConnection:
    """A keep-alive connection the kernel gave to the coordinator (or to the child): each try opens one and asks
    for a path that is not found, which only the process holding the connection counts."""
    for _ in range(64):
        connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        before = _rejected_404(server)
        connection.request("GET", "/v2/which-process")
        assert connection.getresponse().read() and True
        if (_rejected_404(server) > before) == coordinator:
            return connection
        connection.close()
    raise AssertionError("the kernel never gave a connection to the process wanted")


def _call(connection: http.client.HTTPConnection, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    connection.request(method, path, body=body)
    response = connection.getresponse()
    return response.status, response.read()


def _fresh(server: Server, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        return _call(connection, method, path, body)
    finally:
        connection.close()


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} is not in /metrics")


def test_both_processes_serve_http_and_grpc_and_metrics_add_up(server: Server) -> None:
    _, text = _fresh(server, "GET", "/metrics")
    start = _metric(text.decode(), "carton_inference_requests_total", model="identity", outcome="success")
    coordinator_start = _local_success(server)

    sent = 0
    for _ in range(24):  # a new connection each time: the kernel spreads connections, not requests
        status, body = _fresh(server, "POST", "/v2/models/identity/infer", _INFER)
        assert status == 200, body
        sent += 1
    http_coordinator = _local_success(server) - coordinator_start
    assert 0 < http_coordinator < sent  # both processes answered HTTP

    for _ in range(16):  # each client its own connection (not grpc's process-wide subchannel pool)
        client = grpcclient.InferenceServerClient(
            f"127.0.0.1:{server.grpc_port}", channel_args=[("grpc.use_local_subchannel_pool", 1)]
        )
        tensor = grpcclient.InferInput("INPUT0", [1, 3], "FP32")
        tensor.set_data_from_numpy(arange((1, 3)))
        np.testing.assert_array_equal(client.infer("identity", [tensor]).as_numpy("OUTPUT0"), arange((1, 3)) * 2)
        client.close()
        sent += 1
    grpc_coordinator = _local_success(server) - coordinator_start - http_coordinator
    assert 0 < grpc_coordinator < 16  # both processes answered gRPC

    # Whichever process answers, /metrics and the statistics count every process's requests.
    for _ in range(4):
        _, text = _fresh(server, "GET", "/metrics")
        total = _metric(text.decode(), "carton_inference_requests_total", model="identity", outcome="success")
        assert total - start == sent
        _, stats = _fresh(server, "GET", "/v2/models/identity/stats")
        (entry,) = json.loads(stats)["model_stats"]
        assert entry["inference_stats"]["success"]["count"] == total
    own = _ask_child(server, Counters())
    assert isinstance(own, CountersSnapshot)
    (child_series,) = [s for s in own.series if s.model == "identity"]
    assert child_series.success + _local_success(server) == total and child_series.success > 0
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    (grpc_entry,) = client.get_inference_statistics("identity", as_json=True)["model_stats"]
    assert int(grpc_entry["inference_stats"]["success"]["count"]) == total
    client.close()


def _model_ready_everywhere(server: Server, model: str) -> set[bool]:
    """Whether `model` is ready, as the coordinator and the child each see it."""
    child = _ask_child(server, Index(ready_only=True))
    return {server.repository.model_ready(model), any(e["name"] == model for e in child.entries)}  # type: ignore[union-attr]


def _wait_ready(connection: http.client.HTTPConnection) -> None:
    deadline = time.monotonic() + 60
    while _call(connection, "GET", "/v2/health/ready")[0] != 200:
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.05)


def test_load_unload_and_index_through_either_process(server: Server) -> None:
    through_child = _connection(server, coordinator=False)
    through_coordinator = _connection(server, coordinator=True)
    try:
        # An unload asked of the child is applied on every process before it is answered.
        assert _call(through_child, "POST", "/v2/repository/models/sum/unload")[0] == 200
        assert _model_ready_everywhere(server, "sum") == {False}
        # Its runners close in the background on every process; the server is ready again once all have.
        _wait_ready(through_child)
        status, body = _call(through_child, "POST", "/v2/repository/index", b"{}")
        assert status == 200
        assert {"name": "sum", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} in json.loads(body)
        # ... and so is a load asked of the coordinator.
        assert _call(through_coordinator, "POST", "/v2/repository/models/sum/load")[0] == 200
        assert _model_ready_everywhere(server, "sum") == {True}
        assert _call(through_child, "GET", "/v2/models/sum/ready")[0] == 200
        # A load that fails, failed everywhere: the same answer and index whichever process is asked.
        for connection in (through_child, through_coordinator):
            status, body = _call(connection, "POST", "/v2/repository/models/broken/load")
            assert status == 400 and "failed to load 'broken'" in json.loads(body)["error"]
        status, body = _call(through_child, "POST", "/v2/repository/index", b"{}")
        (broken,) = [entry for entry in json.loads(body) if entry["name"] == "broken"]
        assert broken["state"] == "UNAVAILABLE" and broken["reason"]
        assert _ask_child(server, Index()).entries == server.repository.index()  # type: ignore[union-attr]
        # Readiness is the whole server's, asked of either process.
        for connection in (through_child, through_coordinator):
            assert _call(connection, "GET", "/v2/health/ready")[0] == 200
        # A refused request is refused the same way by the child (the coordinator's error, rebuilt).
        status, body = _call(through_child, "POST", "/v2/repository/models/a%2Fb/load")
        assert status == 400, body
    finally:
        through_child.close()
        through_coordinator.close()


def test_an_upload_through_the_child_serves_on_every_process(server: Server, cartons: dict[str, Path]) -> None:
    import base64

    through_child = _connection(server, coordinator=False)
    try:
        payload = base64.b64encode(cartons["double"].read_bytes()).decode()
        body = json.dumps({"parameters": {"config": "{}", "file:1/model.carton": payload}}).encode()
        status, answer = _call(through_child, "POST", "/v2/repository/models/uploaded/load", body)
        assert status == 200, answer
        assert _model_ready_everywhere(server, "uploaded") == {True}
        for _ in range(8):  # whichever process the connection reaches, the uploaded model answers
            status, answer = _fresh(server, "POST", "/v2/models/uploaded/infer", _INFER)
            assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [2.0, 4.0, 6.0]
        assert _fresh(server, "POST", "/v2/repository/models/uploaded/unload")[0] == 200
        assert _model_ready_everywhere(server, "uploaded") == {False}
        _wait_ready(through_child)
    finally:
        through_child.close()


def test_not_ready_anywhere_while_a_change_is_under_way(server: Server) -> None:
    group = _group(server)
    loop = server.loop
    assert loop is not None
    entered, release = asyncio.Event(), asyncio.Event()

    async def changing() -> None:
        async with group._changing("sum"):  # what a load or unload holds while every process applies it
            entered.set()
            await release.wait()

    through_child = _connection(server, coordinator=False)
    through_coordinator = _connection(server, coordinator=True)
    _wait_ready(through_child)  # what earlier tests unloaded has finished closing
    held = asyncio.run_coroutine_threadsafe(changing(), loop)
    asyncio.run_coroutine_threadsafe(entered.wait(), loop).result(10)
    try:
        for connection in (through_child, through_coordinator):
            assert _call(connection, "GET", "/v2/health/ready")[0] == 400
        loop.call_soon_threadsafe(release.set)
        held.result(10)
        for connection in (through_child, through_coordinator):
            assert _call(connection, "GET", "/v2/health/ready")[0] == 200
    finally:
        loop.call_soon_threadsafe(release.set)
        through_child.close()
        through_coordinator.close()
    assert not group._locks  # the lock of a name goes once nobody holds it


def test_a_partial_load_is_unloaded_everywhere(server: Server, repository: Path) -> None:
    group = _group(server)
    loop = server.loop
    assert loop is not None
    original = server.repository.load

    async def fails_here(name: str, **kwargs: object) -> None:
        raise ServerError(f"failed to load {name!r}: only in the coordinator")

    server.repository.load = fails_here  # type: ignore[method-assign]
    try:
        future = asyncio.run_coroutine_threadsafe(group.load("identity", config=None, files={}), loop)
        with pytest.raises(ServerError, match=r"loaded on 1 of 2 server processes, so it was unloaded from all"):
            future.result(60)
    finally:
        server.repository.load = original  # type: ignore[method-assign]
    assert _model_ready_everywhere(server, "identity") == {False}
    assert _fresh(server, "POST", "/v2/repository/models/identity/load")[0] == 200
    assert _model_ready_everywhere(server, "identity") == {True}


def test_options_several_processes_cannot_run(repository: Path) -> None:
    with pytest.raises(ServerError, match="at least 1"):
        Server(ServerOptions(repository=repository, processes=0))
    with pytest.raises(ServerError, match="cannot rebuild a custom one"):
        Server(ServerOptions(repository=repository, processes=2, loader=lambda spec: load_carton(spec)))
    limited = functools.partial(load_carton, limits=RunnerLimits(request_seconds=3.0))
    assert ProcessGroup(ServerOptions(repository=repository, processes=2, loader=limited))._limits == RunnerLimits(
        request_seconds=3.0
    )


def test_a_port_another_server_listens_on_is_refused(repository: Path) -> None:
    with socket.socket() as other:  # another server sharing its port, as `--processes` does
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        options = ServerOptions(repository=repository, http_port=port, grpc_port=None, processes=2)
        refused = pytest.raises(ServerError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use")
        with refused, serve_in_thread(options):
            pass


def test_child_options_cover_every_server_option() -> None:
    import dataclasses

    given = {f.name for f in dataclasses.fields(ServerOptions)} - {"loader", "processes"}
    assert given | {"limits"} == set(ChildOptions.__struct_fields__)


def test_channel_message_bytes() -> None:
    """The channel's framing: a 4-byte little-endian length, then the MessagePack of the tagged message."""
    from carton.server._process_wire import _LENGTH, _decoder, _encoder

    body = _encoder.encode(Call(7, Readiness()))
    assert body == b"\x83\xa4type\xa4Call\xa2id\x07\xa7request\x81\xa4type\xa9Readiness"
    assert _decoder.decode(body) == Call(7, Readiness())
    assert _LENGTH.pack(len(body)) == b"\x27\x00\x00\x00"  # 39 bytes
    refused = _encoder.encode(Reply(7, Refused(error="ModelNotFound", message="x")))
    assert refused == (
        b"\x83\xa4type\xa5Reply\xa2id\x07\xa6result\x83\xa4type\xa7Refused\xa5error\xadModelNotFound\xa7message\xa1x"
    )
    for malformed in (
        msgspec.msgpack.encode({"type": "Call", "id": 1, "request": {"type": "Shutdown"}}),  # an unknown request
        msgspec.msgpack.encode({"type": "Call", "id": "1", "request": {"type": "Readiness"}}),  # a wrong type
        body[:-3],  # truncated
    ):
        with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
            _decoder.decode(malformed)
    reply = _encoder.encode(Reply(7, StatisticsEntries(model_stats=[])))
    assert _decoder.decode(reply) == Reply(7, StatisticsEntries(model_stats=[]))


def test_statistics_and_counters_add_up() -> None:
    def entry(count: int, last: int, batch: int) -> dict[str, object]:
        return {
            "name": "m", "version": "1", "last_inference": last, "inference_count": count, "execution_count": count,
            "inference_stats": {"success": {"count": count, "ns": 10 * count}},
            "batch_stats": [{"batch_size": batch, "compute_infer": {"count": count, "ns": count}}],
        }  # fmt: skip

    (merged,) = merge_statistics([[entry(2, 5, 1)], [entry(3, 9, 1)], [entry(1, 7, 4)]])
    assert merged["inference_count"] == 6 and merged["last_inference"] == 9
    assert merged["inference_stats"] == {"success": {"count": 6, "ns": 60}}
    assert merged["batch_stats"] == [
        {"batch_size": 1, "compute_infer": {"count": 5, "ns": 5}},
        {"batch_size": 4, "compute_infer": {"count": 1, "ns": 1}},
    ]
    assert merge_statistics([[entry(1, 1, 1)], []]) == [entry(1, 1, 1)]
    assert Statistics() == Statistics(name="", version="")
    assert (
        metrics_text(
            [CountersSnapshot(series=[], rejected={"404": 2}), CountersSnapshot(series=[], rejected={"404": 3})]
        ).count(b'carton_http_requests_rejected_total{status="404"} 5.0')
        == 1
    )


# ---- the command: signals, a dead process, bad values ---------------------------------------------------------------
def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if alive(pid)}


def _serve(repository: Path, *extra: str) -> tuple[Serving, set[int]]:
    """``carton serve --processes 2`` answering, and its processes (the child, the runners of both)."""
    serving = start_serving(
        [sys.executable, "-m", "carton", "serve", str(repository), "--http-port", "0", "--no-grpc",
         "--processes", "2", "--model-control-mode", "explicit", "--load-model", "sum", *extra],
    )  # fmt: skip
    process, port = serving.process, serving.http_port
    try:
        wait_answering(serving, lambda: _fresh_status(port, "/v2/health/ready") == 200, timeout=90)
        tree = descendants(process.pid)
        (child,) = [pid for pid in tree if b"carton.server._child" in _command(pid)]
        # Ready means every process has loaded the model: the coordinator and the child each have a runner.
        below_child = descendants(child)
        assert any(b"carton_protocol" in _command(pid) for pid in below_child)
        assert any(b"carton_protocol" in _command(pid) for pid in tree - below_child)
    except BaseException:
        process.kill()
        process.wait(30)
        raise
    return serving, tree


def _command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _fresh_status(port: int, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def _wait_gone(pids: set[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids), f"processes left: {_alive(pids)}"


def test_sigterm_stops_every_process(repository: Path) -> None:
    serving, tree = _serve(repository)
    process = serving.process
    try:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        _wait_gone(tree)
        lines = serving.stderr_lines()
        assert f"carton server: HTTP on 127.0.0.1:{serving.http_port} (2 server processes)" in lines, lines
    finally:
        if process.poll() is None:
            process.kill()


def test_sigkill_of_the_coordinator_leaves_no_process(repository: Path) -> None:
    serving, tree = _serve(repository)
    process = serving.process
    process.kill()
    process.wait(30)
    _wait_gone(tree)


def test_a_dead_child_stops_the_server_with_an_error(repository: Path) -> None:
    serving, tree = _serve(repository)
    process = serving.process
    try:
        (child,) = [pid for pid in tree if b"carton.server._child" in _command(pid)]
        os.kill(child, signal.SIGKILL)
        assert process.wait(60) == 1
        _wait_gone(tree)
        error = serving.stderr_text()
        assert re.search(rf"server process 2 \(pid {child}\) was killed by SIGKILL; the server stops", error), error
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_processes_value(repository: Path, value: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "carton", "serve", str(repository), "--processes", value],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "argument --processes:" in result.stderr
    assert ("at least 1 server process" if value != "two" else "'two' is not a whole number") in result.stderr
