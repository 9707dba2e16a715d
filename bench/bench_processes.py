"""Throughput of ``carton serve --processes N`` against one process, over HTTP and gRPC, A/B alternated in one run.

    python bench/bench_processes.py [--processes 2] [--rounds 4] [--requests 4000] [--concurrency 8]

Both servers (``--processes 1`` and ``--processes N``) serve the same ONNX Identity carton and run at once on other
ports; each round measures them in turn (the one-process server first in odd rounds, second in even ones) with
tritonclient at `--concurrency` clients (each thread its own client, so its own connection: the kernel spreads
connections across the processes, ``SO_REUSEPORT``), `[1,16]` FP32 binary. Each row is the median over rounds: the
throughput, the CPU time per request of the server's whole process tree (server processes and runners, from /proc),
the ratio to one process, and the 1-minute load average. The last lines turn CPU per request into what it implies
for a machine with more cores: each core serves at most 1 / (CPU per request) requests per second.

The client runs on the same machine and takes its share of the cores: on a machine with as many cores as server
processes, the client and the servers compete, and the throughput ratio shows the cores, not the design.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from _server_load import LoadResult, run_load
from bench_server import Served, build_repository, carton_served


def main() -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2, help="server processes of the server compared")
    parser.add_argument("--rounds", type=int, default=4, help="A/B-alternated rounds")
    parser.add_argument("--requests", type=int, default=4000, help="requests per measurement")
    parser.add_argument("--concurrency", type=int, default=8, help="client threads")
    args = parser.parse_args()
    protocols = ("http", "grpc")
    results: dict[tuple[int, str], list[LoadResult]] = {}
    root = Path(tempfile.mkdtemp(prefix="carton-bench-processes-"))
    try:
        repo = build_repository(root)
        with ExitStack() as stack:
            servers: dict[int, Served] = {
                n: stack.enter_context(carton_served(repo, "--processes", str(n))) for n in (1, args.processes)
            }
            for index in range(args.rounds):
                order = [1, args.processes] if index % 2 == 0 else [args.processes, 1]
                for n in order:
                    served = servers[n]
                    for protocol in protocols:
                        port = served.http if protocol == "http" else served.grpc
                        result = run_load(
                            port, "identity", (1, 16), args.concurrency, args.requests, protocol=protocol,
                            pid=served.pid,
                        )  # fmt: skip
                        results.setdefault((n, protocol), []).append(result)
                print(f"round {index + 1}/{args.rounds} done (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    title = f"[1,16] FP32 binary, {args.concurrency} clients, {os.cpu_count()} cores"
    print(f"\n{title} (medians over {args.rounds} rounds)")
    header = f"{'protocol':<10}{'processes':>10}{'req/s':>10}{'ratio':>8}{'CPU us/req':>12}{'p50 ms':>9}{'load':>7}"
    print(header)
    print("-" * len(header))
    for protocol in protocols:
        for n in (1, args.processes):
            found = results[(n, protocol)]
            rate = statistics.median(r.rate for r in found)
            ratios = [r.rate / b.rate for r, b in zip(found, results[(1, protocol)], strict=True)]
            cpu = statistics.median(r.cpu_us for r in found)
            p50 = statistics.median(r.p50_ms for r in found)
            load = statistics.mean(r.load for r in found)
            ratio = statistics.median(ratios) if n != 1 else 1.0
            print(f"{protocol:<10}{n:>10}{rate:>10.0f}{ratio:>7.2f}x{cpu:>12.0f}{p50:>9.3f}{load:>7.2f}")
    print("\nwhat CPU per request implies: requests per second one core can serve (server processes + runners)")
    for protocol in protocols:
        for n in (1, args.processes):
            cpu = statistics.median(r.cpu_us for r in results[(n, protocol)])
            print(f"  {protocol} with {n} process(es): {cpu:.0f} us -> {1e6 / cpu:.0f} req/s per core")


if __name__ == "__main__":
    main()
