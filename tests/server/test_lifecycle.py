"""Loads and unloads with requests in flight, load timeouts, readiness, and dynamic batching, on real cartons.

A loader wrapping the real `load_carton` holds a load or a request open where the test needs a window (a load under
way, requests queued or in flight), until the test has seen the state it checks; the models themselves are real
cartons run by real runner processes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from carton.server import LoadSpec, ModelControlMode, ModelHandle, Server, ServerOptions, load_carton, serve_in_thread
from carton.server._repository import ServedVersion
from carton_protocol import Tensor, TensorSpec
from tritonclient.utils import InferenceServerException

from .conftest import arange


class _Slow:
    """A real model handle whose requests take `delay` seconds longer (the window for an unload to land in), and
    wait for `gate` when one is set (held shut until the test has what it wants queued)."""

    def __init__(self, inner: ModelHandle, delay: float, gate: threading.Event | None = None) -> None:
        self.inner, self.delay, self.gate = inner, delay, gate
        self.closed = threading.Event()

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.inner.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self.inner.outputs

    async def infer(self, inputs: dict[str, np.ndarray]) -> Mapping[str, Tensor]:
        if self.gate is not None and not self.gate.is_set():
            await asyncio.to_thread(self.gate.wait, 60)
        await asyncio.sleep(self.delay)
        return await self.inner.infer(inputs)

    def close(self) -> None:
        self.inner.close()
        self.closed.set()


class _Loader:
    """Loads real cartons; while `held` is set, a load first waits for `release` (a load the test holds open)."""

    def __init__(self) -> None:
        self.handles: list[tuple[str, _Slow]] = []
        self.held = threading.Event()
        self.release = threading.Event()
        #: What the batched model's requests wait for (set: they run at once).
        self.batched_gate = threading.Event()
        self.batched_gate.set()

    def __call__(self, spec: LoadSpec) -> ModelHandle:
        if self.held.is_set():
            self.release.wait(120)
        gate = self.batched_gate if "batched" in str(spec.path) else None
        handle = _Slow(load_carton(spec), 0.5 if "identity" in str(spec.path) else 0.0, gate)
        self.handles.append((str(spec.path), handle))
        return handle


@pytest.fixture
def loader() -> Iterator[_Loader]:
    made = _Loader()
    yield made
    made.release.set()  # a load a failed test still holds ends, and its runner is closed
    made.batched_gate.set()


@pytest.fixture
def lifecycle_server(repository: Path, loader: _Loader) -> Iterator[Server]:
    # The load timeout is the default's: a runner's start on a slow, loaded machine takes seconds.
    options = ServerOptions(
        repository=repository, http_port=0, grpc_port=None, model_control_mode=ModelControlMode.EXPLICIT,
        load_models=("identity", "batched"), loader=loader,
    )  # fmt: skip
    with serve_in_thread(options) as running:
        yield running


def _infer(port: int, model: str, x: np.ndarray) -> np.ndarray:
    """One JSON inference over plain httpx, safe from any thread.

    tritonclient.http is gevent-based; a client that dies while a worker thread exits can no longer reach that
    thread's hub and raises from `__del__` (gevent#1961), so worker threads here do not use it.
    """
    body = {"inputs": [{"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    response = httpx.post(f"http://127.0.0.1:{port}/v2/models/{model}/infer", json=body, timeout=60)
    if response.status_code != 200:
        raise InferenceServerException(msg=response.json()["error"], status=str(response.status_code))
    output = next(o for o in response.json()["outputs"] if o["name"] == "OUTPUT0")
    return np.array(output["data"], np.float32).reshape(output["shape"])


def _load(port: int, model: str) -> None:
    response = httpx.post(f"http://127.0.0.1:{port}/v2/repository/models/{model}/load", timeout=60)
    assert response.status_code == 200, response.text


def test_unload_lets_in_flight_requests_finish(lifecycle_server: Server, loader: _Loader) -> None:
    port = lifecycle_server.http_port
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(_infer, port, "identity", arange((1, 4)) + i) for i in range(4)]
        # Wait until all four are inside the model (each takes 0.5 s there), however loaded the machine is.
        (served,) = lifecycle_server.repository.versions("identity")
        deadline = time.monotonic() + 30
        while served.in_flight < 4:
            assert time.monotonic() < deadline, served.in_flight
            time.sleep(0.01)
        client.unload_model("identity")
        with pytest.raises(InferenceServerException, match="has no available versions"):
            _infer(port, "identity", arange((1, 4)))
        for i, future in enumerate(running):
            np.testing.assert_array_equal(future.result(timeout=30), (arange((1, 4)) + i) * 2)
    # The index reports UNLOADING until the runner is closed, then UNAVAILABLE: wait for the second report (the
    # runner closes in a worker thread and the state changes on the event loop after it, so polling the handle is
    # not enough) and check that the runner was indeed closed by then.
    unloaded = {"name": "identity", "version": "2", "state": "UNAVAILABLE", "reason": "unloaded"}
    deadline = time.monotonic() + 30
    while unloaded not in (index := client.get_model_repository_index()):
        assert time.monotonic() < deadline, index
        time.sleep(0.05)
    identity = next(handle for path, handle in loader.handles if "identity" in path)
    assert identity.closed.is_set()
    assert client.is_server_ready()


def _wait_in_flight(served: ServedVersion, count: int) -> None:
    """Until `count` requests are inside `served` (sent from other threads, they arrive when the machine lets them)."""
    deadline = time.monotonic() + 30
    while served.in_flight < count:
        assert time.monotonic() < deadline, served.in_flight
        time.sleep(0.01)


def test_reload_while_serving_swaps_versions(lifecycle_server: Server) -> None:
    port = lifecycle_server.http_port
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    (version_2,) = lifecycle_server.repository.versions("identity")
    with ThreadPoolExecutor(2) as pool:
        before = pool.submit(_infer, port, "identity", arange((1, 2)))
        _wait_in_flight(version_2, 1)  # the request is inside version 2 (for 0.5 s) when the reload comes
        client.load_model("identity", config='{"version_policy": {"specific": {"versions": [1]}}}')
        np.testing.assert_array_equal(before.result(timeout=30), arange((1, 2)) * 2)  # finished on version 2
    np.testing.assert_array_equal(_infer(port, "identity", arange((1, 2))), arange((1, 2)))  # now version 1
    assert client.get_model_metadata("identity")["versions"] == ["1"]


def test_readiness_false_while_loading(lifecycle_server: Server, loader: _Loader) -> None:
    port = lifecycle_server.http_port
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    loader.held.set()  # the load waits in the loader until released
    try:
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(_load, port, "sum")
            deadline = time.monotonic() + 30
            while {"name": "sum", "version": "1", "state": "LOADING"} not in (
                index := client.get_model_repository_index()
            ):
                assert time.monotonic() < deadline, index
                time.sleep(0.02)
            assert not client.is_server_ready()
            loader.release.set()
            loading.result(timeout=60)
    finally:
        loader.release.set()
    assert client.is_server_ready() and client.is_model_ready("sum")


def test_load_timeout(repository: Path, loader: _Loader) -> None:
    # A server of its own, whose short load timeout no real load has to meet: the only load is one held in the
    # loader until the test has its answer, so the answer can only come from the timeout.
    options = ServerOptions(
        repository=repository, http_port=0, grpc_port=None, model_control_mode=ModelControlMode.EXPLICIT,
        load_models=(), loader=loader, load_timeout=2.0,
    )  # fmt: skip
    loader.held.set()
    try:
        with serve_in_thread(options) as running:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}", network_timeout=120)
            with pytest.raises(InferenceServerException, match=r"load timed out after 2s"):
                client.load_model("strings")
            entry = next(e for e in client.get_model_repository_index() if e["name"] == "strings")
            assert entry["state"] == "UNAVAILABLE" and "timed out" in entry["reason"]
            assert client.is_server_ready()
            # What the loader returns after the timeout is closed, not served.
            loader.release.set()
            deadline = time.monotonic() + 60
            while not (loader.handles and loader.handles[0][1].closed.is_set()):
                assert time.monotonic() < deadline, loader.handles
                time.sleep(0.02)
            assert not client.is_model_ready("strings")
    finally:
        loader.release.set()


def test_dynamic_batching_merges_concurrent_requests(lifecycle_server: Server, loader: _Loader) -> None:
    port = lifecycle_server.http_port
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    (batched,) = lifecycle_server.repository.versions("batched")
    loader.batched_gate.clear()  # the model holds the first batch until the other requests are queued behind it
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_infer, port, "batched", np.full((1, 4), i, np.float32)) for i in range(16)]
            _wait_in_flight(batched, 8)  # the first batch held in the model, the other requests queued behind it
            loader.batched_gate.set()
            for i, future in enumerate(futures):
                np.testing.assert_array_equal(future.result(timeout=30), np.full((1, 4), 2 * i, np.float32))
    finally:
        loader.batched_gate.set()
    stats = client.get_inference_statistics("batched")["model_stats"][0]
    assert stats["inference_count"] == 16
    assert stats["execution_count"] < 16  # some requests ran together
    assert any(batch["batch_size"] > 1 for batch in stats["batch_stats"])
    with pytest.raises(InferenceServerException, match="larger than the model's max_batch_size 8"):
        _infer(port, "batched", np.zeros((9, 4), np.float32))
