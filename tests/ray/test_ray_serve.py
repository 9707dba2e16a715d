"""carton.ray on a real two-node Ray cluster: Serve's HTTP and gRPC proxies on free loopback ports, two model
replicas holding at most two models each, three real cartons and a corrupt one."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from carton_ray_support import CONSTANTS, alive, expected, free_port, parent_of, replica_pids, runner_pids
from serving_process import wait_answering

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app(ray_cluster: object, ray_repository: Path) -> Iterator[tuple[int, int]]:
    """The application on Serve, as ``serve run`` would run it; yields (HTTP port, gRPC port)."""
    import carton.ray
    from ray import serve

    http_port, grpc_port = free_port(), free_port()
    servicer = "carton.ray.add_GRPCInferenceServiceServicer_to_server"
    serve.start(
        http_options={"host": "127.0.0.1", "port": http_port},
        grpc_options={"port": grpc_port, "grpc_servicer_functions": [servicer]},
    )
    hosts: list[int] = []
    try:
        application = carton.ray.build_app(
            {
                "repository": str(ray_repository),
                "num_replicas": "2",
                "max_models_per_replica": "2",
                "request_timeout": "3",
            }
        )
        serve.run(application, name="carton", route_prefix="/")
        yield http_port, grpc_port
    finally:
        hosts = replica_pids()
        serve.shutdown()
    # Serve's shutdown ends the replicas and so their runners.
    _wait_until(lambda: not replica_pids() and not runner_pids(hosts), 60)


def _wait_until(condition: Callable[[], object], seconds: float, state: Callable[[], object] = lambda: "") -> None:
    """Polls `condition` for up to `seconds`; a timeout says what `state` then returns (what the test saw)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {seconds} s: {state()}"
        time.sleep(0.1)


def _raylet_pid(node: object) -> int:
    """The pid of a `ray.cluster_utils` node's raylet, the parent of every worker process on that node."""
    return int(node.all_processes["raylet"][0].process.pid)  # type: ignore[attr-defined]


def _placement(cluster: object) -> dict[str, object]:
    """Which raylet each model replica runs under, and the cluster's raylets: what a failed wait reports."""
    nodes = [cluster.head_node, *cluster.worker_nodes]  # type: ignore[attr-defined]
    return {
        "replica: raylet": {pid: parent_of(pid) for pid in replica_pids()},
        "raylets": [_raylet_pid(n) for n in nodes],
    }


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((3, 4)).astype(np.float32)


def _infer(client: object, name: str, x: np.ndarray) -> np.ndarray:
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    return np.asarray(client.infer(name, [tensor]).as_numpy("y"))  # type: ignore[attr-defined]


def test_interleaved_requests_to_three_models_are_bit_identical(app: tuple[int, int]) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{app[0]}", network_timeout=120)
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["name"] == "carton"
    names = list(CONSTANTS) * 4
    for index, name in enumerate(names):
        x = _x(index)
        np.testing.assert_array_equal(_infer(client, name, x), expected(name, x))
        assert client.is_model_ready(name)
    # JSON tensors too (the same decoder as carton serve).
    tensor = httpclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32), binary_data=False)
    out = client.infer("gamma", [tensor], outputs=[httpclient.InferRequestedOutput("y", binary_data=False)])
    np.testing.assert_array_equal(out.as_numpy("y"), expected("gamma", np.ones((1, 4), np.float32)))
    # Two replicas on two nodes (each node's raylet is a replica's parent), at most two models (runners) each.
    replicas = replica_pids()
    assert len(replicas) == 2
    assert parent_of(replicas[0]) != parent_of(replicas[1])
    for replica in replicas:
        assert len(runner_pids([replica], direct=True)) <= 2 + 1  # two models' runners and at most one idle spare
    index = {e["name"]: e for e in client.get_model_repository_index() if "version" in e or "state" in e}
    assert {"alpha", "beta", "gamma"} <= {name for name, e in index.items() if e.get("state") == "READY"}


def test_grpc_through_serves_grpc_proxy(app: tuple[int, int]) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{app[1]}")
    assert client.is_server_live() and client.is_server_ready()
    metadata = client.get_model_metadata("beta")
    assert metadata.name == "beta" and metadata.inputs[0].datatype == "FP32"
    x = _x(7)
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("beta", [tensor]).as_numpy("y"), expected("beta", x))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("nosuch", [tensor])
    assert "StatusCode.NOT_FOUND" in str(caught.value.status()) and "'nosuch' is not found" in caught.value.message()
    bad = grpcclient.InferInput("x", [2, 4], "INT64")
    bad.set_data_from_numpy(np.zeros((2, 4), np.int64))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("beta", [bad])
    assert "INVALID_ARGUMENT" in str(caught.value.status())
    assert {m.name for m in client.get_model_repository_index().models} >= set(CONSTANTS)


def test_errors_are_carton_serves(app: tuple[int, int], ray_repository: Path) -> None:
    """The same requests get the same status and body from Serve's proxy as from `carton serve` itself."""
    from carton.server import ModelControlMode, ServerOptions, serve_in_thread

    short = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}'
    unknown = b'{"inputs": [{"name": "q", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}'
    requests = [
        ("GET", "/v2/models/nosuch", b""),
        ("GET", "/v2/models/alpha/versions/9", b""),
        ("POST", "/v2/models/alpha/infer", b"{not json"),
        ("POST", "/v2/models/alpha/infer", short),
        ("POST", "/v2/models/alpha/infer", unknown),
        ("GET", "/v2/models/alpha/infer", b""),
        ("GET", "/v2/models/%2e%2e", b""),
        ("GET", "/v2/systemsharedmemory/status", b""),
        ("GET", "/v2/nothing", b""),
        ("GET", "/v2/models/alpha/ready", b""),
        ("GET", "/v2/models/alpha", b""),
        ("GET", "/v2/models/alpha/config", b""),
    ]  # fmt: skip
    options = ServerOptions(
        repository=ray_repository, http_port=0, grpc_port=None, model_control_mode=ModelControlMode.EXPLICIT,
        load_models=("alpha",),
    )  # fmt: skip
    with serve_in_thread(options) as server, httpx.Client(timeout=120) as client:
        for method, path, body in requests:
            local = client.request(method, f"http://127.0.0.1:{server.http_port}{path}", content=body)
            served = client.request(method, f"http://127.0.0.1:{app[0]}{path}", content=body)
            assert (served.status_code, served.content) == (local.status_code, local.content), path


def test_corrupt_carton_is_unavailable_with_its_reason_and_the_others_serve(
    app: tuple[int, int], ray_repository: Path
) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(f"127.0.0.1:{app[0]}", network_timeout=120)
    assert not client.is_model_ready("broken")
    with pytest.raises(InferenceServerException, match="has no available versions"):
        client.infer("broken", [httpclient.InferInput("x", [1, 4], "FP32").set_data_from_numpy(_x(1)[:1])])
    with pytest.raises(InferenceServerException, match="not a zip archive"):
        client.load_model("broken")
    entries = [e for e in client.get_model_repository_index() if e["name"] == "broken"]
    assert entries and entries[0]["state"] == "UNAVAILABLE" and "not a zip archive" in entries[0]["reason"]
    assert str(ray_repository) not in entries[0]["reason"]  # the server's paths are not shown
    x = _x(3)
    np.testing.assert_array_equal(_infer(client, "alpha", x), expected("alpha", x))
    with pytest.raises(InferenceServerException, match="not unloaded through the API"):
        client.unload_model("alpha")
    with pytest.raises(InferenceServerException, match="not supported on Ray Serve"):
        client.load_model("alpha", config="{}")
    # Fixed in the repository, the model loads again on its next request (on every replica that had it failed) and
    # serves; the index says so.
    broken = ray_repository / "broken" / "1" / "model.carton"
    original = broken.read_bytes()
    try:
        shutil.copy(ray_repository / "gamma" / "1" / "model.carton", broken)
        for _ in range(4):
            np.testing.assert_array_equal(_infer(client, "broken", x), expected("gamma", x))
        client.load_model("broken")
        assert {"name": "broken", "version": "1", "state": "READY"} in client.get_model_repository_index()
    finally:
        broken.write_bytes(original)


def test_limits_apply_per_replica_and_a_killed_runner_restarts(app: tuple[int, int]) -> None:
    """`request_timeout` (as `carton serve --request-timeout`): a request that runs past it gets carton serve's 503,
    its runner is killed, and the replica serves the model's next request from a new runner."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(f"127.0.0.1:{app[0]}", network_timeout=120)

    def spin(trips: int) -> np.ndarray:
        x = httpclient.InferInput("x", [1], "FP32")
        x.set_data_from_numpy(np.zeros(1, np.float32))
        count = httpclient.InferInput("trips", [1], "INT64")
        count.set_data_from_numpy(np.array([trips], np.int64))
        return np.asarray(client.infer("spin", [x, count]).as_numpy("y"))

    np.testing.assert_array_equal(spin(3), [3.0])
    with pytest.raises(InferenceServerException) as caught:
        spin(10**15)
    assert caught.value.status() == "503"
    assert "did not answer within the server's request timeout of 3 s" in caught.value.message()
    np.testing.assert_array_equal(spin(5), [5.0])


def test_killed_replica_fails_cleanly_and_leaves_no_runner(app: tuple[int, int]) -> None:
    """SIGKILL one model replica while a client loops: in-flight requests fail with an HTTP error (or succeed),
    nothing hangs, later requests succeed, and the replica's runners are gone."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(f"127.0.0.1:{app[0]}", network_timeout=60)
    for name in CONSTANTS:  # every replica holds something
        _infer(client, name, _x(0))
    victim = next(pid for pid in replica_pids() if runner_pids([pid]))
    runners = runner_pids([victim])
    outcomes: list[str] = []
    stop = threading.Event()

    def loop() -> None:
        looping = httpclient.InferenceServerClient(f"127.0.0.1:{app[0]}", network_timeout=60)
        index = 0
        while not stop.is_set() and index < 2000:
            name = list(CONSTANTS)[index % 3]
            x = _x(index)
            try:
                np.testing.assert_array_equal(_infer(looping, name, x), expected(name, x))
                outcomes.append("ok")
            except InferenceServerException as exc:
                outcomes.append(f"http {exc.status()}: {exc.message()}")
            index += 1

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        _wait_until(lambda: not any(alive(pid) for pid in runners), 30)
        time.sleep(3.0)
    finally:
        stop.set()
        thread.join(120)
    assert not thread.is_alive(), "the client loop hung"
    errors = [o for o in outcomes if o != "ok"]
    assert outcomes.count("ok") > 0
    for error in errors:
        assert error.startswith(("http 503", "http 500")), error
    # Serve starts a new replica; every model answers again.
    deadline = time.monotonic() + 120
    for name in CONSTANTS:
        while True:
            try:
                x = _x(11)
                np.testing.assert_array_equal(_infer(client, name, x), expected(name, x))
                break
            except InferenceServerException:
                assert time.monotonic() < deadline
                time.sleep(0.5)
    _wait_until(lambda: len(replica_pids()) == 2, 120)
    with contextlib.suppress(Exception):
        client.close()


def test_ray_kill_of_a_replica_actor_leaves_no_runner(app: tuple[int, int]) -> None:
    """`ray.kill` of a model replica's actor: the process goes, its runners with it, and Serve replaces it."""
    import ray
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{app[0]}", network_timeout=120)
    for name in CONSTANTS:
        _infer(client, name, _x(0))
    before = {pid: runner_pids([pid]) for pid in replica_pids()}
    actors = [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == "serve" and "#CartonModels#" in entry["name"]
    ]
    assert len(actors) == 2
    ray.kill(ray.get_actor(actors[0], namespace="serve"), no_restart=True)
    _wait_until(lambda: set(before) - set(replica_pids()), 60)
    # The killed actor's replica goes; Serve may also be retiring a replica left over from the previous test's
    # recovery at the same moment, so every replica gone is held to the same promise: none leaves a runner behind.
    gone = set(before) - set(replica_pids())
    _wait_until(lambda: not runner_pids(gone), 30)
    assert not any(alive(pid) for replica in gone for pid in before[replica])
    _wait_until(lambda: len(replica_pids()) == 2, 120)
    deadline = time.monotonic() + 120
    for name in CONSTANTS:
        while True:
            try:
                np.testing.assert_array_equal(_infer(client, name, _x(2)), expected(name, _x(2)))
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.5)


def test_a_dead_node_leaves_no_runner_and_serve_recovers(app: tuple[int, int], ray_cluster: object) -> None:
    """The worker node dies (its raylet and every process of it SIGKILLed): the model replica it held goes, and its
    runners with it; with a new node in its place, Serve places a replacement and every model serves again."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{app[0]}", network_timeout=120)
    (worker,) = ray_cluster.worker_nodes  # type: ignore[attr-defined]
    raylet = _raylet_pid(worker)

    def settled() -> bool:
        """One replica per node (a CPU each), once Serve has settled after the previous tests' kills."""
        parents = [parent_of(pid) for pid in replica_pids()]
        return len(parents) == 2 and parents.count(raylet) == 1

    _wait_until(settled, 120, lambda: _placement(ray_cluster))
    for name in CONSTANTS:
        _infer(client, name, _x(0))
    (victim,) = [pid for pid in replica_pids() if parent_of(pid) == raylet]
    runners = runner_pids([victim])
    ray_cluster.remove_node(worker, allow_graceful=False)  # type: ignore[attr-defined]
    try:
        _wait_until(lambda: not alive(victim), 60, lambda: _placement(ray_cluster))
        _wait_until(lambda: not runner_pids([victim]), 30, lambda: runner_pids([victim]))
        assert not any(alive(pid) for pid in runners)
    finally:
        # Whatever happened above, the module's later tests get their two nodes back.
        ray_cluster.add_node(num_cpus=1)  # type: ignore[attr-defined]
    _wait_until(lambda: len(replica_pids()) == 2, 180, lambda: _placement(ray_cluster))
    deadline = time.monotonic() + 180
    for name in CONSTANTS:
        while True:
            try:
                np.testing.assert_array_equal(_infer(client, name, _x(3)), expected(name, _x(3)))
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.5)


def test_a_url_repository_serves_the_cartons_under_it(
    app: tuple[int, int], ray_repository: Path, tmp_path: Path
) -> None:
    """``repository=http://...``: model ``m`` is ``<url>/m.carton``, fetched by the replica that loads it (served
    here by a plain HTTP server on 127.0.0.1, which ignores Range requests). Redeploys the module's application."""
    import functools
    import http.server

    import carton.ray
    import ray
    import tritonclient.http as httpclient
    from ray import serve
    from tritonclient.utils import InferenceServerException

    # serve.run waits for both replicas, which need both nodes: a lost node fails here rather than hang there.
    _wait_until(lambda: sum(bool(node["Alive"]) for node in ray.nodes()) == 2, 60, ray.nodes)
    folder = tmp_path / "www"
    folder.mkdir()
    for name in ("alpha", "beta"):
        shutil.copy(ray_repository / name / "1" / "model.carton", folder / f"{name}.carton")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/"
        serve.run(carton.ray.build_app({"repository": url, "num_replicas": "2"}), name="carton", route_prefix="/")
        client = httpclient.InferenceServerClient(f"127.0.0.1:{app[0]}", network_timeout=120)
        for name in ("alpha", "beta", "alpha"):
            x = _x(5)
            np.testing.assert_array_equal(_infer(client, name, x), expected(name, x))
        with pytest.raises(InferenceServerException, match="'gamma' is not found"):
            _infer(client, "gamma", _x(5))
        names = {e["name"]: e.get("state") for e in client.get_model_repository_index()}
        assert names == {"alpha": "READY", "beta": "READY"}
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_serve_run_answers_and_sigint_leaves_nothing_behind(
    app: tuple[int, int], ray_cluster: object, ray_repository: Path
) -> None:
    """`serve run carton.ray:build_app repository=...` from a shell, on this cluster: it replaces the module's
    application (same name; Serve already listens on a free loopback port, which `serve run` keeps instead of its
    default 8000), answers, and SIGINT (which shuts Serve down) leaves no replica and no runner behind. Runs last."""
    import tritonclient.http as httpclient
    from ray import serve

    serve.delete("carton")  # nothing answers until `serve run` has deployed its application
    port = app[0]
    command = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
    process = subprocess.Popen(
        [command, "run", "--address", ray_cluster.address, "--name", "carton",  # type: ignore[attr-defined]
         "carton.ray:build_app", f"repository={ray_repository}", "max_models_per_replica=1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )  # fmt: skip
    hosts: list[int] = []
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120)
        wait_answering(process, client.is_server_ready, timeout=240, what="serve run")
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        tensor = httpclient.InferInput("x", [2, 4], "FP32")
        tensor.set_data_from_numpy(x)
        # One replica that keeps one model: each model evicts the previous one, whose runner is closed first.
        for name in ("beta", "alpha", "gamma", "beta"):
            np.testing.assert_array_equal(client.infer(name, [tensor]).as_numpy("y"), expected(name, x))
            ready = [e["name"] for e in client.get_model_repository_index() if e.get("state") == "READY"]
            assert ready == [name]
        hosts = replica_pids()
        assert len(hosts) == 1
        assert 1 <= len(runner_pids(hosts, direct=True)) <= 2  # the model's runner and at most one idle spare
        process.send_signal(signal.SIGINT)
        assert process.wait(120) is not None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    deadline = time.monotonic() + 60
    while replica_pids() or replica_pids("CartonIngress") or runner_pids(hosts):
        assert time.monotonic() < deadline, (replica_pids(), runner_pids(hosts))
        time.sleep(0.2)
