"""Load generators for bench_server.py: tritonclient over HTTP and gRPC (client threads of this process, or client
processes), CPU time of a server's process tree from /proc, and the JSON-tensor request timed while health and a
small inference are probed (imported as a sibling)."""

from __future__ import annotations

import contextlib
import http.client
import json
import multiprocessing
import os
import statistics
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

_TICKS = os.sysconf("SC_CLK_TCK")

#: The most client threads one load may use.
MAX_CLIENT_THREADS = 64
#: The threads every load's clients run on, kept for the whole run. tritonclient's HTTP client runs on its thread's
#: gevent hub, which keeps two descriptors open after its thread ends (destroying it leaked the client's buffers):
#: with threads made per load, a long run pushed this process's descriptors past 1023, where the client's sockets
#: take a much slower path, and every HTTP row fell for both servers (docs/performance.md,
#: "2026-11-30 (evening, end of session)").
_CLIENT_THREADS = ThreadPoolExecutor(MAX_CLIENT_THREADS, thread_name_prefix="client")


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU time of process `root` and every descendant (every thread), from /proc."""
    parents: dict[int, int] = {}
    times: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                text = file.read()
        except OSError:
            continue
        fields = text[text.rindex(b")") + 2 :].split()
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = int(fields[11]) + int(fields[12])
    tree = {root}
    grown = True
    while grown:
        grown = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grown = True
    return sum(times.get(pid, 0) for pid in tree) / _TICKS


@dataclass(frozen=True, slots=True)
class LoadResult:
    p50_ms: float
    p99_ms: float
    rate: float
    #: CPU time of the server's process tree per request, in microseconds (0 when no pid was given).
    cpu_us: float
    load: float
    #: CPU time of the clients per request, in microseconds: this process's (every thread) for `run_load`, the client
    #: processes' own for `ClientProcesses.run`. The clients share the machine's cores with the server, so a load's
    #: throughput is bounded by the two together (docs/server.md, "What bounds the eight-client rows").
    client_cpu_us: float = 0.0


def _client(
    protocol: str, port: int, shape: tuple[int, ...], data: np.ndarray, binary: bool, *, own_connection: bool = False
) -> Any:
    """A callable sending one inference to model `identity`-like endpoints, made for one thread. gRPC clients of one
    process share one connection (grpc's global subchannel pool) unless `own_connection`."""
    if protocol == "grpc":
        import tritonclient.grpc as grpcclient

        channel_args = [("grpc.use_local_subchannel_pool", 1)] if own_connection else None
        grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}", channel_args=channel_args)
        grpc_tensor = grpcclient.InferInput("INPUT0", list(shape), "FP32")
        grpc_tensor.set_data_from_numpy(data)
        grpc_outputs = [grpcclient.InferRequestedOutput("OUTPUT0")]

        def grpc_call(model: str) -> None:
            grpc_client.infer(model, [grpc_tensor], outputs=grpc_outputs).as_numpy("OUTPUT0")

        return grpc_call
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=300, connection_timeout=300)
    tensor = httpclient.InferInput("INPUT0", list(shape), "FP32")
    tensor.set_data_from_numpy(data, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]

    def call(model: str) -> None:
        client.infer(model, [tensor], outputs=outputs).as_numpy("OUTPUT0")

    return call


def run_load(
    port: int,
    model: str,
    shape: tuple[int, ...],
    concurrency: int,
    requests: int,
    *,
    binary: bool = True,
    protocol: str = "http",
    pid: int | None = None,
    own_connections: bool = False,
) -> LoadResult:
    """`requests` inferences over `concurrency` client threads (each with its own client, warmed up first)."""
    if not 1 <= concurrency <= MAX_CLIENT_THREADS:
        raise ValueError(f"concurrency must be 1 to {MAX_CLIENT_THREADS}, not {concurrency}")
    data = _sample(shape)
    latencies: list[float] = []
    lock = threading.Lock()
    per_thread = max(1, requests // concurrency)
    barrier = threading.Barrier(concurrency + 1)

    def worker() -> None:
        try:
            call = _client(protocol, port, shape, data, binary, own_connection=own_connections)
            call(model)  # warm the connection
            barrier.wait()
        except BaseException:
            barrier.abort()  # the load fails here (BrokenBarrierError, then this error) instead of waiting forever
            raise
        mine = _timed_calls(call, model, per_thread)
        with lock:
            latencies.extend(mine)

    workers = [_CLIENT_THREADS.submit(worker) for _ in range(concurrency)]
    try:
        barrier.wait()
    except threading.BrokenBarrierError as broken:
        # A client failed before its calls: raise its own error, not the broken barrier its siblings saw.
        failures = (done.exception() for done in workers)
        raise next((e for e in failures if e and not isinstance(e, threading.BrokenBarrierError)), broken) from None
    cpu_before = tree_cpu_seconds(pid) if pid is not None else 0.0
    client_before = time.process_time()
    started = time.perf_counter()
    for done in workers:
        done.result()
    elapsed = time.perf_counter() - started
    client_cpu = time.process_time() - client_before
    cpu = (tree_cpu_seconds(pid) - cpu_before) if pid is not None else 0.0
    return _load_result(latencies, elapsed, cpu, client_cpu)


def _load_result(latencies: Iterable[float], elapsed: float, cpu: float, client_cpu: float) -> LoadResult:
    """A load's figures from its requests' latencies, its wall time, the server tree's and the clients' CPU time
    (seconds)."""
    ordered = sorted(latencies)
    return LoadResult(
        p50_ms=statistics.median(ordered) * 1e3,
        p99_ms=ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
        rate=len(ordered) / elapsed,
        cpu_us=cpu / len(ordered) * 1e6,
        load=os.getloadavg()[0],
        client_cpu_us=client_cpu / len(ordered) * 1e6,
    )


def _timed_calls(call: Callable[[str], None], model: str, count: int) -> array[float]:
    """`count` calls of `call` one after another, and each one's latency in seconds: the timing of every client,
    thread or process."""
    latencies = array("d")
    for _ in range(count):
        started = time.perf_counter()
        call(model)
        latencies.append(time.perf_counter() - started)
    return latencies


def _sample(shape: tuple[int, ...]) -> np.ndarray:
    """The input every client sends: the same numbers in every thread and process."""
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def _client_process(pipe: Connection) -> None:
    """The loop of one of `ClientProcesses`' processes: a command (JSON) names the server and the load; the process
    warms its client for it (one per server and protocol, kept for later commands), answers ``ready``, waits for
    ``go``, runs its requests and answers with the CPU time they took this process, then their latencies (float64
    seconds, all of them). An empty command ends it."""
    clients: dict[tuple[str, int, tuple[int, ...]], Any] = {}
    while command := pipe.recv_bytes():
        load = json.loads(command)
        shape = tuple(load["shape"])
        key = (load["protocol"], load["port"], shape)
        if key not in clients:
            clients[key] = _client(load["protocol"], load["port"], shape, _sample(shape), True, own_connection=True)
        call = clients[key]
        call(load["model"])
        pipe.send_bytes(b"ready")
        pipe.recv_bytes()
        cpu_before = time.process_time()
        latencies = _timed_calls(call, load["model"], load["requests"])
        pipe.send_bytes(array("d", [time.process_time() - cpu_before]).tobytes() + latencies.tobytes())


class ClientProcesses:
    """`count` client processes, each with its own tritonclient (so its own connection), started once and reused for
    every load (`run`): the load of `run_load` at that concurrency, without one GIL shared by every client. A
    Python client's threads take turns on their process's GIL, so what eight threads of one process achieve moves
    with how that turn-taking goes as much as with the server. Use as a context manager."""

    def __init__(self, count: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipes: list[Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        for _ in range(count):
            ours, theirs = context.Pipe()
            process = context.Process(target=_client_process, args=(theirs,), daemon=True)
            process.start()
            theirs.close()
            self._pipes.append(ours)
            self._processes.append(process)

    def __enter__(self) -> ClientProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for pipe in self._pipes:
            with contextlib.suppress(OSError):
                pipe.send_bytes(b"")
        for process in self._processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self._pipes:
            pipe.close()

    def run(
        self, port: int, model: str, shape: tuple[int, ...], requests: int, *, protocol: str = "http", pid: int
    ) -> LoadResult:
        """`requests` inferences spread over the processes (binary tensors), timed from the moment all are ready;
        CPU is `pid`'s process tree's, as in `run_load`."""
        per_process = max(1, requests // len(self._pipes))
        command = json.dumps(
            {"protocol": protocol, "port": port, "model": model, "shape": list(shape), "requests": per_process}
        ).encode()
        for pipe in self._pipes:
            pipe.send_bytes(command)
        for pipe in self._pipes:
            if pipe.recv_bytes() != b"ready":
                raise RuntimeError("a client process did not get ready")
        cpu_before = tree_cpu_seconds(pid)
        started = time.perf_counter()
        for pipe in self._pipes:
            pipe.send_bytes(b"go")
        latencies = array("d")
        client_cpu = 0.0
        for pipe in self._pipes:
            answer = array("d", pipe.recv_bytes())
            client_cpu += answer[0]  # the process's CPU time, then its latencies
            latencies.extend(answer[1:])
        elapsed = time.perf_counter() - started
        return _load_result(latencies, elapsed, tree_cpu_seconds(pid) - cpu_before, client_cpu)


def json_tensor_body(elements: int, *, binary_output: bool = True) -> bytes:
    """An inference request for model `identity` whose input is `elements` FP32 numbers as a JSON list (shape
    [1, elements]); the output is asked for as binary data, so the response costs little to either server, or with
    `binary_output` false as JSON, so the response is as large as the request."""
    import orjson

    values = (np.arange(elements, dtype=np.float32) % 1000) / np.float32(8)
    document = {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, elements], "data": values}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": binary_output}}],
    }
    return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)


@dataclass(frozen=True, slots=True)
class JsonResult:
    seconds: float
    #: The slowest health probe and the slowest small inference of another model while the request was in flight.
    health_max_ms: float
    other_max_ms: float
    probes: int
    load: float


def json_request(port: int, body: bytes) -> JsonResult:
    """Time one JSON-tensor request while another thread probes ``/v2/health/ready`` and infers on `identity4`."""
    done = threading.Event()
    health: list[float] = []
    other: list[float] = []
    ready = threading.Event()

    def probe() -> None:
        # tritonclient's HTTP client runs on gevent: made and used on this thread only.
        small = _client("http", port, (1, 1, 1, 16), np.ones((1, 1, 1, 16), np.float32), True)
        small("identity4")
        ready.set()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while not done.is_set():
            started = time.perf_counter()
            connection.request("GET", "/v2/health/ready")
            connection.getresponse().read()
            health.append(time.perf_counter() - started)
            started = time.perf_counter()
            small("identity4")
            other.append(time.perf_counter() - started)
            time.sleep(0.002)
        connection.close()

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    prober = _CLIENT_THREADS.submit(probe)
    ready.wait()
    started = time.perf_counter()
    connection.request("POST", "/v2/models/identity/infer", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    response.read()
    seconds = time.perf_counter() - started
    done.set()
    prober.result()
    connection.close()
    if response.status != 200:
        raise RuntimeError(f"the JSON-tensor request failed with HTTP {response.status}")
    return JsonResult(
        seconds=seconds,
        health_max_ms=max(health, default=0.0) * 1e3,
        other_max_ms=max(other, default=0.0) * 1e3,
        probes=len(health),
        load=os.getloadavg()[0],
    )
