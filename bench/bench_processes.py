"""Throughput of ``carton serve --processes N`` against one process, over HTTP and gRPC, A/B alternated in one run.

    python bench/bench_processes.py [--processes 2] [--rounds 4] [--requests 4000] [--concurrency 8]
                                    [--client-processes]

Both servers (``--processes 1`` and ``--processes N``) serve the same ONNX Identity carton and run at once on other
ports; each round measures them in turn (the one-process server first in odd rounds, second in even ones) with
tritonclient at `--concurrency` clients, `[1,16]` FP32 binary: threads of this process, or with
`--client-processes` as many processes (no GIL shared by the clients). Each client has its own connection, gRPC
ones included: the kernel spreads connections, not requests, across the processes
(``SO_REUSEPORT``). Each row is the median over rounds: the throughput, the CPU time per request of the server's
whole process tree (server processes and runners, from /proc) and of its server processes alone, how evenly the
server processes shared the work, the ratio to one process, and the 1-minute load average. The last lines turn CPU
per request into what it implies for a machine with more cores.

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

from _server_load import ClientProcesses, LoadResult, run_load
from _servers import Served, build_repository, carton_served

_TICKS = os.sysconf("SC_CLK_TCK")


def server_processes(coordinator: int) -> list[int]:
    """The server's own processes: the coordinator and its ``carton.server._child`` children (not the runners)."""
    found = [coordinator]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(b")") + 2 :].split()[1]) == coordinator and b"carton.server._child" in command:
            found.append(int(entry))
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (all its threads), from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def main() -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2, help="server processes of the server compared")
    parser.add_argument("--rounds", type=int, default=4, help="A/B-alternated rounds")
    parser.add_argument("--requests", type=int, default=4000, help="requests per measurement")
    parser.add_argument("--concurrency", type=int, default=8, help="clients")
    parser.add_argument(
        "--client-processes", action="store_true", help="one client process per client instead of one thread each"
    )
    args = parser.parse_args()
    protocols = ("http", "grpc")
    results: dict[tuple[int, str], list[LoadResult]] = {}
    # Per measurement: CPU per request of the server processes alone (not the runners), and the busiest one's share.
    own: dict[tuple[int, str], list[tuple[float, float]]] = {}
    root = Path(tempfile.mkdtemp(prefix="carton-bench-processes-"))
    try:
        repo = build_repository(root)
        with ExitStack() as stack:
            clients = stack.enter_context(ClientProcesses(args.concurrency)) if args.client_processes else None
            servers: dict[int, Served] = {
                n: stack.enter_context(carton_served(repo, "--processes", str(n))) for n in (1, args.processes)
            }
            for index in range(args.rounds):
                order = [1, args.processes] if index % 2 == 0 else [args.processes, 1]
                for n in order:
                    served = servers[n]
                    pids = server_processes(served.pid)
                    for protocol in protocols:
                        port = served.http if protocol == "http" else served.grpc
                        before = [cpu_seconds(pid) for pid in pids]
                        if clients is None:
                            result = run_load(
                                port, "identity", (1, 16), args.concurrency, args.requests, protocol=protocol,
                                pid=served.pid, own_connections=True,
                            )  # fmt: skip
                        else:
                            result = clients.run(
                                port, "identity", (1, 16), args.requests, protocol=protocol, pid=served.pid
                            )
                        spent = [cpu_seconds(pid) - start for pid, start in zip(pids, before, strict=True)]
                        results.setdefault((n, protocol), []).append(result)
                        served_requests = (args.requests // args.concurrency) * args.concurrency
                        own.setdefault((n, protocol), []).append(
                            (sum(spent) / served_requests * 1e6, max(spent) / max(sum(spent), 1e-9))
                        )
                print(f"round {index + 1}/{args.rounds} done (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    kind = "client processes" if args.client_processes else "client threads"
    title = f"[1,16] FP32 binary, {args.concurrency} {kind}, {os.cpu_count()} cores"
    print(f"\n{title} (medians over {args.rounds} rounds)")
    header = (
        f"{'protocol':<10}{'processes':>10}{'req/s':>10}{'ratio':>8}{'CPU us/req':>12}{'server part':>13}"
        f"{'busiest':>9}{'p50 ms':>9}{'load':>7}"
    )
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
            server_part = statistics.median(part for part, _ in own[(n, protocol)])
            busiest = statistics.median(share for _, share in own[(n, protocol)])
            print(
                f"{protocol:<10}{n:>10}{rate:>10.0f}{ratio:>7.2f}x{cpu:>12.0f}{server_part:>13.0f}{busiest:>8.0%}"
                f"{p50:>9.3f}{load:>7.2f}"
            )
    print("CPU us/req: server processes and runners; server part: the server processes alone; busiest: the share")
    print("of the server processes' CPU spent by the busiest one (50% = evenly spread over two)")
    print("\nwhat it implies for a machine with more cores (one server process runs on one core at a time):")
    for protocol in protocols:
        cpu = statistics.median(r.cpu_us for r in results[(args.processes, protocol)])
        part = statistics.median(p for p, _ in own[(args.processes, protocol)])
        print(
            f"  {protocol}: {1e6 / cpu:.0f} req/s per core (server + runners); one server process caps at about "
            f"{1e6 / part:.0f} req/s, so N processes reach min(N x {1e6 / part:.0f}, cores x {1e6 / cpu:.0f})"
        )


if __name__ == "__main__":
    main()
