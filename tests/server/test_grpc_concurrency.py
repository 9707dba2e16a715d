"""gRPC under concurrency: clients on several threads, the dynamic batcher, an unload under running calls, a client
that cancels mid-call, and the status codes of refused calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from carton.server import LoadSpec, ModelControlMode, ModelHandle, Server, ServerOptions, load_carton, serve_in_thread
from tritonclient.utils import InferenceServerException

from .conftest import arange
from .test_lifecycle import _Slow


class _Loader:
    def __init__(self) -> None:
        self.handles: dict[str, _Slow] = {}

    def __call__(self, spec: LoadSpec) -> ModelHandle:
        name = Path(spec.path).parts[-3]  # REPO/<model>/<version>/model.carton
        handle = _Slow(load_carton(spec), 0.0)
        self.handles[name] = handle
        return handle


@pytest.fixture(scope="module")
def loader() -> _Loader:
    return _Loader()


@pytest.fixture(scope="module")
def threaded_server(repository: Path, loader: _Loader) -> Iterator[Server]:
    options = ServerOptions(
        repository=repository, http_port=0, grpc_port=0, model_control_mode=ModelControlMode.EXPLICIT,
        load_models=("identity", "batched"), loader=loader, upload_sandbox=None,
    )  # fmt: skip
    with serve_in_thread(options) as running:
        yield running


def _input(array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("INPUT0", list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return tensor


def _infer_once(address: str, model: str, x: np.ndarray) -> np.ndarray:
    """One inference on a client of its own (for worker threads)."""
    client = grpcclient.InferenceServerClient(address)
    try:
        return client.infer(model, [_input(x)]).as_numpy("OUTPUT0")  # type: ignore[no-any-return]
    finally:
        client.close()


def _wait_for(condition: object, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _success_count(client: grpcclient.InferenceServerClient, model: str) -> int:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return int(stats["inference_stats"]["success"].get("count", 0))


def test_concurrent_clients_each_get_their_answer_and_every_call_is_counted(
    threaded_server: Server, loader: _Loader
) -> None:
    address = f"127.0.0.1:{threaded_server.grpc_port}"
    before = _success_count(grpcclient.InferenceServerClient(address), "identity")

    def calls(worker: int) -> None:
        client = grpcclient.InferenceServerClient(address)
        for i in range(40):
            x = arange((1, 8)) + 1000 * worker + i
            result = client.infer("identity", [_input(x)], request_id=f"{worker}-{i}")
            assert result.get_response().id == f"{worker}-{i}"
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)
        client.close()

    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(calls, worker) for worker in range(8)]:
            future.result(timeout=120)
    client = grpcclient.InferenceServerClient(address)
    assert _success_count(client, "identity") - before == 320
    (served,) = threaded_server.repository.versions("identity")
    assert served.in_flight == 0 and served.stats.series.in_flight == 0


def test_concurrent_grpc_calls_reach_the_dynamic_batcher(threaded_server: Server, loader: _Loader) -> None:
    address = f"127.0.0.1:{threaded_server.grpc_port}"
    (served,) = threaded_server.repository.versions("batched")
    # The model holds the first batch until all eight calls are in: each call opens a channel of its own, and on a
    # slow machine they may otherwise arrive one by one, further apart than the queue delay.
    gate = loader.handles["batched"].gate = threading.Event()
    try:
        with ThreadPoolExecutor(8) as pool:
            running = pool.map(lambda i: _infer_once(address, "batched", arange((1, 4)) + i), range(8))
            _wait_for(lambda: served.in_flight == 8, "eight calls in the model or queued for it")
            gate.set()
            results = list(running)
    finally:
        gate.set()
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result, (arange((1, 4)) + i) * 2)
    stats = grpcclient.InferenceServerClient(address).get_inference_statistics("batched", as_json=True)
    assert int(stats["model_stats"][0]["execution_count"]) < 8  # merged into batches


def test_unload_under_running_grpc_calls_lets_them_finish(threaded_server: Server, loader: _Loader) -> None:
    address = f"127.0.0.1:{threaded_server.grpc_port}"
    client = grpcclient.InferenceServerClient(address)
    handle = loader.handles["identity"]
    handle.delay = 0.5
    (served,) = threaded_server.repository.versions("identity")

    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(_infer_once, address, "identity", arange((1, 4)) + i) for i in range(4)]
        _wait_for(lambda: served.in_flight == 4, "four calls inside the model")
        client.unload_model("identity")
        with pytest.raises(InferenceServerException, match="has no available versions") as caught:
            client.infer("identity", [_input(arange((1, 4)))])
        assert caught.value.status() == str(grpc.StatusCode.NOT_FOUND)
        for i, future in enumerate(running):
            np.testing.assert_array_equal(future.result(timeout=30), (arange((1, 4)) + i) * 2)
    # UNAVAILABLE is reported once the runner is closed (the state changes after the close, on the event loop).
    unloaded = {"name": "identity", "version": "2", "state": "UNAVAILABLE", "reason": "unloaded"}
    _wait_for(
        lambda: unloaded in client.get_model_repository_index(as_json=True)["models"], "the version reported unloaded"
    )
    assert handle.closed.is_set()
    client.load_model("identity")
    np.testing.assert_array_equal(
        client.infer("identity", [_input(arange((1, 2)))]).as_numpy("OUTPUT0"), arange((1, 2)) * 2
    )


def test_a_cancelled_call_leaves_nothing_behind(threaded_server: Server, loader: _Loader) -> None:
    address = f"127.0.0.1:{threaded_server.grpc_port}"
    client = grpcclient.InferenceServerClient(address)
    handle = loader.handles["identity"]
    handle.delay = 0.5
    (served,) = threaded_server.repository.versions("identity")
    before = _success_count(client, "identity")
    answers: list[object] = []
    context = client.async_infer(
        "identity", [_input(arange((1, 4)))], callback=lambda result, error: answers.append(error)
    )
    _wait_for(lambda: served.in_flight == 1, "the call inside the model")
    context.cancel()
    _wait_for(lambda: answers, "the cancelled call's callback")
    assert answers[0] is not None and "CANCELLED" in str(answers[0])
    # The cancelled handler released the version and counted the call as failed; nothing waits for it any more.
    _wait_for(lambda: served.in_flight == 0, "the version released")
    assert served.stats.series.in_flight == 0
    assert _success_count(client, "identity") == before
    handle.delay = 0.0
    np.testing.assert_array_equal(
        client.infer("identity", [_input(arange((1, 3)))]).as_numpy("OUTPUT0"), arange((1, 3)) * 2
    )
    client.unload_model("identity")
    _wait_for(handle.closed.is_set, "the runner closed on unload")
    client.load_model("identity")


def test_errors_from_the_threaded_paths_keep_their_status(threaded_server: Server) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{threaded_server.grpc_port}")
    bad = _input(np.zeros((1, 2), np.float32))
    bad.set_shape([1, 4])  # 8 bytes for 4 FP32 elements
    with pytest.raises(InferenceServerException, match="needs 16") as caught:
        client.infer("identity", [bad])
    assert caught.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(InferenceServerException, match="batch size 9 is larger") as caught:
        client.infer("batched", [_input(np.zeros((9, 4), np.float32))])
    assert caught.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("nosuch")
    assert caught.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("nosuch", [_input(arange((1, 4)))])
    assert caught.value.status() == str(grpc.StatusCode.NOT_FOUND)
    assert client.is_server_ready() and client.is_model_ready("identity")


def test_a_call_past_its_deadline_inside_the_model_is_cancelled_and_released(
    threaded_server: Server, loader: _Loader
) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{threaded_server.grpc_port}")
    handle = loader.handles["identity"]
    (served,) = threaded_server.repository.versions("identity")
    failed = served.stats.fail.count
    assert client.is_server_live()  # the channel is connected: the deadline is not spent on connecting
    handle.delay = 60.0
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.infer("identity", [_input(arange((1, 4)))], client_timeout=1.0)
    finally:
        handle.delay = 0.0
    assert caught.value.status() == str(grpc.StatusCode.DEADLINE_EXCEEDED)
    _wait_for(lambda: served.stats.fail.count == failed + 1, "the call counted as failed")
    _wait_for(lambda: served.in_flight == 0, "the version released")
    np.testing.assert_array_equal(
        client.infer("identity", [_input(arange((1, 3)))]).as_numpy("OUTPUT0"), arange((1, 3)) * 2
    )


@pytest.mark.parametrize("delay", [0.3, 30.0], ids=["within-the-grace", "past-the-grace"])
def test_a_call_under_way_when_the_server_stops_is_answered_or_cancelled(repository: Path, delay: float) -> None:
    # The server's stop gives calls under way a grace of a second: a unary call stepped without a task is waited
    # for (answered), or cancelled past it (its version released and the call counted as failed).
    loader = _Loader()
    options = ServerOptions(
        repository=repository, http_port=0, grpc_port=0, model_control_mode=ModelControlMode.EXPLICIT,
        load_models=("identity",), loader=loader, upload_sandbox=None,
    )  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        with serve_in_thread(options) as running:
            loader.handles["identity"].delay = delay
            (served,) = running.repository.versions("identity")
            failed = served.stats.fail.count
            call = pool.submit(_infer_once, f"127.0.0.1:{running.grpc_port}", "identity", arange((1, 4)))
            _wait_for(lambda: served.in_flight == 1, "the call inside the model")
        if delay < 1.0:
            np.testing.assert_array_equal(call.result(timeout=60), arange((1, 4)) * 2)
            assert served.stats.fail.count == failed
        else:
            with pytest.raises(InferenceServerException):
                call.result(timeout=60)
            assert served.stats.fail.count == failed + 1
        assert served.in_flight == 0
