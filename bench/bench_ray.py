"""carton on Ray Serve against `carton serve` alone, on the same model, one run, alternated rounds.

    python bench/bench_ray.py [--rounds 2] [--requests 300] [--concurrent-requests 800]

Starts `carton serve` on an ONNX Identity carton ([1,16] FP32, binary tensor data) and a one-node Ray cluster
(`ray.init(num_cpus=2)`, no dashboard) running `carton.ray.build_app` on the same repository behind Serve's HTTP
proxy, first with one model replica, then two (`serve.run` again with ``num_replicas=2``), alternating with
`carton serve` in every round. Clients are tritonclient.http threads (p50 at one client, throughput at eight), on
the same machine as every server process, which matters on a 2-core machine: see docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import build_repository, carton_server, free_port, run_load, wait_ready

SHAPE = (1, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=300, help="requests at concurrency 1, per measurement")
    parser.add_argument("--concurrent-requests", type=int, default=800, help="requests at concurrency 8")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import carton.ray
    import ray
    from ray import serve

    results: dict[str, list[tuple[float, float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as temp:
        repo = build_repository(Path(temp))
        load_before = os.getloadavg()
        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})

        def deploy(replicas: int) -> None:
            app = carton.ray.build_app({"repository": str(repo), "num_replicas": str(replicas), "num_cpus": "1"})
            serve.run(app, name="carton", route_prefix="/")
            wait_ready(port)

        def measure(label: str, target: int) -> None:
            run_load(target, "identity", SHAPE, 1, 50)  # warm: the model loads on its first request
            p50, _, _ = run_load(target, "identity", SHAPE, 1, args.requests)
            c8_p50, _, throughput = run_load(target, "identity", SHAPE, 8, args.concurrent_requests)
            results.setdefault(label, []).append((p50, c8_p50, throughput, os.getloadavg()[0]))
            print(f"  {label:<28} c=1 p50 {p50:6.2f} ms   c=8 {throughput:7.0f} req/s (p50 {c8_p50:.2f} ms)")

        try:
            with carton_server(repo) as local:
                for round_ in range(args.rounds):
                    print(f"round {round_ + 1}", flush=True)
                    for replicas in (1, 2):
                        measure("carton serve", local)
                        deploy(replicas)
                        measure(f"Ray Serve, {replicas} replica{'s' * (replicas > 1)}", port)
        finally:
            serve.shutdown()
            ray.shutdown()
    base_p50 = statistics.median(r[0] for r in results["carton serve"])
    base_rate = statistics.median(r[2] for r in results["carton serve"])
    print(f"\nload average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}; "
          f"after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")  # fmt: skip
    print("| server | c=1 p50 ms | c=8 req/s | c=8 p50 ms | load (1 min) |")
    print("|---|---|---|---|---|")
    for label, rows in results.items():
        p50, c8, rate = (statistics.median(r[i] for r in rows) for i in (0, 1, 2))
        load = max(r[3] for r in rows)
        print(f"| {label} | {p50:.2f} ({p50 / base_p50:.2f}x) | {rate:.0f} ({rate / base_rate:.2f}x) | {c8:.2f} | "
              f"<= {load:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
