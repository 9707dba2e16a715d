"""Wire protocol benchmarks: carton's RunnerProcess against raw references measured in the same run.

    python bench/bench_protocol.py [--quick] [--only small,large,threads,threshold,codec]

1. small: a [1,16] float32 infer (p50/p99) vs a raw pyzmq REQ/REP round trip of the same bytes between two
   processes.
2. large: 64 MiB in / 64 MiB out vs a raw shared-memory round trip between two processes (the host copies the
   input into a mapped segment, sends a small control message, the peer copies it into an output segment and
   replies, the host copies the output out), and vs carton with shared memory turned off (ZeroMQ frames).
3. threads: throughput with 1, 2, 4, 8 client threads against a concurrent runner whose infer waits 2 ms with the
   GIL released (a stand-in for a framework call) and against the same with no wait.
4. threshold: message frames vs shared memory by tensor size, to place the shared-memory threshold.
5. codec: the wire work of one round trip without the sockets, in one process: the host's codec encodes the
   request, the runner's decodes it and encodes the reply, the host's decodes that (best of 7 x N calls), for the
   header-template path ([1,16] float32), two tensors, and the full path (a string tensor beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import mmap
import multiprocessing
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from _timing import percentiles, timed, timed_async
from carton._runtime._process import RunnerProcess
from carton_protocol import RunnerSpec

ROOT = Path(__file__).resolve().parent.parent
TEST_RUNNERS = str(ROOT / "tests" / "protocol")


def spec(entry: str, name: str = "bench") -> RunnerSpec:
    return RunnerSpec(runner_name=name, framework_version="1.0.0", runner_compat_version=1, entry=entry)


def start(entry: str, **kwargs: object) -> RunnerProcess:
    runner = RunnerProcess.start(spec(entry), extra_env={"PYTHONPATH": TEST_RUNNERS}, **kwargs)  # type: ignore[arg-type]
    runner.load(model_dir=ROOT, opts={}, inputs=(), outputs=())
    return runner


# --- references ------------------------------------------------------------------------------------------------
def _rep_server(endpoint: str, ready: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    context = zmq.Context()
    sock = context.socket(zmq.REP)
    sock.bind(endpoint)
    ready.set()
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 1 and frames[0].bytes == b"stop":
            sock.send(b"")
            context.destroy(linger=1000)
            return
        sock.send_multipart(frames, copy=False)


def _shm_server(conn: multiprocessing.connection.Connection, size: int) -> None:  # type: ignore[name-defined]
    fd_in, fd_out = conn.recv()
    input_map = mmap.mmap(fd_in, size)
    output_map = mmap.mmap(fd_out, size)
    source = np.frombuffer(input_map, np.uint8)
    target = np.frombuffer(output_map, np.uint8)
    conn.send(b"ready")
    while conn.recv() == b"go":
        np.copyto(target, source)
        conn.send(b"done")


def raw_shm_round_trip(size: int, repeat: int) -> list[float]:
    mp = multiprocessing.get_context("fork")
    fd_in = os.memfd_create("bench-in")
    fd_out = os.memfd_create("bench-out")
    os.ftruncate(fd_in, size)
    os.ftruncate(fd_out, size)
    host_conn, peer_conn = mp.Pipe()
    peer = mp.Process(target=_shm_server, args=(peer_conn, size), daemon=True)
    peer.start()
    host_conn.send((fd_in, fd_out))
    assert host_conn.recv() == b"ready"
    input_map = mmap.mmap(fd_in, size)
    output_map = mmap.mmap(fd_out, size, access=mmap.ACCESS_READ)
    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    segment = np.frombuffer(input_map, np.uint8)
    result = np.frombuffer(output_map, np.uint8)

    def call() -> None:
        np.copyto(segment, data)
        host_conn.send(b"go")
        host_conn.recv()
        result.copy()

    samples = timed(call, repeat, warmup=2)
    host_conn.send(b"stop")
    peer.join()
    return samples


# --- sections --------------------------------------------------------------------------------------------------
def row(name: str, samples: list[float], reference: float, unit: float = 1e6, label: str = "us") -> str:
    p50, p99 = percentiles(samples)
    return f"| {name:<44} | {p50 * unit:>9.1f} {label} | {p99 * unit:>9.1f} {label} | {p50 / reference:>6.2f}x |"


def _lean_rep_server(endpoint: str, ready: Any) -> None:
    from carton_protocol._zmqio import recv_message, send_message

    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        frames = recv_message(sock)
        if len(frames) == 2 and frames[1].bytes == b"stop":
            send_message(sock, [frames[0], b""])
            context.destroy(linger=1000)
            return
        send_message(sock, frames)


def bench_small(repeat: int, rounds: int) -> None:
    """Rounds alternate reference and carton so both see the same machine load; each round's p50 gives a ratio."""
    from carton_protocol import Infer
    from carton_protocol._framing import encode_tensors
    from carton_protocol._messages import encode
    from carton_protocol._zmqio import recv_message, send_message

    x = np.random.default_rng(0).random((1, 16), dtype=np.float32)
    encoded = encode_tensors({"x": x}, pool=None, threshold=1 << 62)
    frames = [encode(Infer(id=1, tensors=encoded.entries)), x.tobytes()]
    mp = multiprocessing.get_context("spawn")
    runtime = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    servers = []
    sockets = []
    paths: list[Path] = []
    context = zmq.Context()
    for kind, target in (("rep", _rep_server), ("lean", _lean_rep_server)):
        paths.append(runtime / f"carton-bench-{kind}-{os.getpid()}.sock")
        endpoint = f"ipc://{paths[-1]}"
        ready = mp.Event()
        server = mp.Process(target=target, args=(endpoint, ready), daemon=True)
        server.start()
        ready.wait()
        sock = context.socket(zmq.REQ if kind == "rep" else zmq.DEALER)
        sock.connect(endpoint)
        servers.append(server)
        sockets.append(sock)
    rep, lean = sockets

    def raw_call() -> None:
        rep.send_multipart(frames, copy=False)
        rep.recv_multipart(copy=False)

    def lean_call() -> None:
        send_message(lean, frames)
        recv_message(lean)

    runner = start("runners_for_tests:Echo")
    names = ("raw", "lean", "carton", "async")
    samples: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    loop = asyncio.new_event_loop()

    try:
        for _ in range(rounds):
            medians = {}
            for name, call in (("raw", raw_call), ("lean", lean_call), ("carton", lambda: runner.infer({"x": x}))):
                taken = timed(call, repeat, warmup=200)
                samples[name] += taken
                medians[name] = statistics.median(taken)
            taken = loop.run_until_complete(timed_async(lambda: runner.infer_async({"x": x}), repeat, 200))
            samples["async"] += taken
            medians["async"] = statistics.median(taken)
            for name in medians:
                ratios[name].append(medians[name] / medians["raw"])
    finally:
        loop.close()
        runner.close()
        rep.send(b"stop")
        rep.recv()
        send_message(lean, [b"stop"])
        recv_message(lean)
        for server in servers:
            server.join()
        context.destroy()
        for path in paths:
            path.unlink(missing_ok=True)  # libzmq leaves the ipc socket file behind
    reference = percentiles(samples["raw"])[0]
    print(f"\n## small: [1,16] float32 round trip, {rounds} interleaved rounds of {repeat} calls\n")
    print("| path                                         |       p50    |       p99    | p50 ratio | round ratios |")
    print("|----------------------------------------------|--------------|--------------|-----------|--------------|")
    for name, label in (
        ("raw", "raw pyzmq REQ/REP, same bytes (reference)"),
        ("lean", "raw pyzmq DEALER/ROUTER, lean send/recv"),
        ("carton", "carton RunnerProcess.infer (Echo runner)"),
        ("async", "carton RunnerProcess.infer_async (asyncio)"),
    ):
        print(row(label, samples[name], reference) + f" {statistics.median(ratios[name]):>11.2f}x |")


def bench_large(repeat: int, size: int) -> None:
    count = size // 4
    x = np.random.default_rng(0).random(count, dtype=np.float32)
    raw = raw_shm_round_trip(size, repeat)
    runner = start("runners_for_tests:Echo")
    try:
        ours = timed(lambda: runner.infer({"x": x}), repeat, warmup=2)
    finally:
        runner.close()
    frames_runner = start("runners_for_tests:Echo", shm_threshold=None)
    try:
        framed = timed(lambda: frames_runner.infer({"x": x}), max(3, repeat // 3), warmup=1)
    finally:
        frames_runner.close()
    reference = percentiles(raw)[0]
    moved = 2 * size
    print(f"\n## large: {size >> 20} MiB in, {size >> 20} MiB out, {repeat} calls each\n")
    print("| path                                         |       p50    |       p99    | p50 ratio | GB/s  |")
    print("|----------------------------------------------|--------------|--------------|-----------|-------|")
    for name, samples in (
        ("raw shared memory, copy in/out (reference)", raw),
        ("carton RunnerProcess.infer (shared memory)", ours),
        ("carton RunnerProcess.infer (frames, no shm)", framed),
    ):
        gbps = moved / percentiles(samples)[0] / 1e9
        print(row(name, samples, reference, unit=1e3, label="ms") + f" {gbps:>5.2f} |")


def bench_threads(seconds: float) -> None:
    print(f"\n## threads: concurrent runner, calls per second over {seconds:g} s per row\n")
    print("| runner work            | threads | calls/s  | vs 1 thread |")
    print("|------------------------|---------|----------|-------------|")
    x = np.ones((1, 16), dtype=np.float32)
    for label, wait in (("2 ms, GIL released", 0.002), ("none (echo)", 0.0)):
        runner = start("runners_for_tests:ConcurrentEcho")
        try:
            single = None
            for threads in (1, 2, 4, 8):
                rate = _throughput(runner, {"x": x, "sleep": np.array([wait])}, threads, seconds)
                single = single or rate
                print(f"| {label:<22} | {threads:>7} | {rate:>8.0f} | {rate / single:>10.2f}x |")
        finally:
            runner.close()


def _throughput(runner: RunnerProcess, inputs: dict[str, np.ndarray], threads: int, seconds: float) -> float:
    stop = time.monotonic() + seconds
    counts = [0] * threads

    def work(index: int) -> None:
        while time.monotonic() < stop:
            runner.infer(inputs)
            counts[index] += 1

    pool = [threading.Thread(target=work, args=(index,)) for index in range(threads)]
    begin = time.monotonic()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return sum(counts) / (time.monotonic() - begin)


def bench_threshold(repeat: int) -> None:
    print("\n## threshold: Echo round trip p50 by tensor size, frames vs shared memory\n")
    print("| bytes     | frames      | shared mem  | shm / frames |")
    print("|-----------|-------------|-------------|--------------|")
    framed = start("runners_for_tests:Echo", shm_threshold=None)
    shared = start("runners_for_tests:Echo", shm_threshold=1)
    try:
        for size in (1 << 14, 1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 22, 1 << 24):
            x = np.ones(size // 4, dtype=np.float32)
            count = max(5, repeat // max(1, size >> 16))
            a = statistics.median(timed(lambda: framed.infer({"x": x}), count, warmup=3))  # noqa: B023
            b = statistics.median(timed(lambda: shared.infer({"x": x}), count, warmup=3))  # noqa: B023
            print(f"| {size:>9} | {a * 1e6:>8.0f} us | {b * 1e6:>8.0f} us | {b / a:>11.2f}x |")
    finally:
        framed.close()
        shared.close()


class _Frame:
    """What the codecs read of a received `zmq.Frame`: its bytes and a buffer over them."""

    __slots__ = ("buffer", "bytes")

    def __init__(self, part: object) -> None:
        self.bytes = part if isinstance(part, bytes) else np.ascontiguousarray(part).tobytes()
        self.buffer = memoryview(self.bytes)


def _round_trip(tensors: dict[str, Any]) -> Callable[[], None]:
    """One round trip through a fresh pair of codecs: request out, reply back, both read."""
    from carton_protocol import HostCodec, RunnerCodec

    host, runner = HostCodec(shm_threshold=None), RunnerCodec(channel=None)
    ids = itertools.count(1)

    def trip() -> None:
        request = host.encode_tensors(next(ids), tensors)
        received = runner.decode([_Frame(part) for part in request.parts])
        reply = runner.encode_tensors(received.message.id, runner.tensors(received))
        answer = host.decode([_Frame(part) for part in reply.parts])
        host.tensors(answer)
        host.release(answer, lambda: 0)
        request.done()

    return trip


def bench_codec(repeat: int) -> None:
    print(f"\n## codec: one round trip's wire work in-process, best of 7 x {repeat} calls\n")
    print("| message | us per round trip |")
    print("|---|---|")
    x = np.random.default_rng(0).random((1, 16), dtype=np.float32)
    cases = {
        "[1,16] float32 (template path)": {"x": x},
        "[1,16] float32 + [1,16] int64 (template path)": {"x": x, "mask": np.ones((1, 16), np.int64)},
        "[1,16] float32 + 2 strings (full path)": {"x": x, "words": np.array(["hello", "wire"])},
    }
    for label, tensors in cases.items():
        trip = _round_trip(tensors)
        for _ in range(repeat):
            trip()
        best = min(sum(timed(trip, repeat, 0)) for _ in range(7))
        print(f"| {label} | {best / repeat * 1e6:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, noisier)")
    parser.add_argument("--only", default="small,large,threads,threshold,codec", help="comma-separated sections")
    args = parser.parse_args()
    sections = set(args.only.split(","))
    print(
        f"# bench_protocol: python {sys.version.split()[0]}, pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, "
        f"{os.cpu_count()} CPUs"
    )
    if "small" in sections:
        bench_small(1000 if args.quick else 5000, 3 if args.quick else 8)
    if "large" in sections:
        bench_large(5 if args.quick else 30, 64 << 20)
    if "threads" in sections:
        bench_threads(0.5 if args.quick else 2.0)
    if "threshold" in sections:
        bench_threshold(50 if args.quick else 400)
    if "codec" in sections:
        bench_codec(1000 if args.quick else 5000)


if __name__ == "__main__":
    main()
