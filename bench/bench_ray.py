"""carton on Ray Serve against `carton serve` alone, on the same model, one run, alternated rounds.

    python bench/bench_ray.py [--rounds 2] [--requests 300] [--concurrent-requests 800]

Starts `carton serve` on an ONNX Identity carton ([1,16] FP32, binary tensor data) and a one-node Ray cluster
(`ray.init(num_cpus=2)`, no dashboard) running `carton.ray.build_app` on the same repository behind Serve's HTTP
proxy, first with one model replica, then two (`serve.run` again with ``num_replicas=2``), alternating with
`carton serve` in every round. Ray's own floor is measured in the same rounds: a plain Serve deployment that reads
the request and replays `carton serve`'s answer to it, once called by the proxy directly (one hop) and once through
an ingress deployment and a `DeploymentHandle` (two hops, the shape of `carton.ray`'s application), so the table
separates what Ray costs from what carton adds on top. Clients are tritonclient.http threads (p50 at one client,
throughput at eight), on the same machine as every server process, which matters on a 2-core machine: see
docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server_load import run_load
from _servers import build_repository, carton_server, free_port, wait_ready

SHAPE = (1, 16)


def canned_reply(port: int) -> tuple[bytes, dict[str, str]]:
    """`carton serve`'s answer (body and the headers a Triton client reads) to the request `run_load` sends."""
    import httpx
    import numpy as np
    import tritonclient.http as httpclient

    data = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    tensor = httpclient.InferInput("INPUT0", list(SHAPE), "FP32")
    tensor.set_data_from_numpy(data, binary_data=True)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]
    body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor], outputs=outputs)
    headers = {} if json_size is None else {"Inference-Header-Content-Length": str(json_size)}
    reply = httpx.post(f"http://127.0.0.1:{port}/v2/models/identity/infer", content=body, headers=headers)
    reply.raise_for_status()
    kept = {name: reply.headers[name] for name in ("content-type", "inference-header-content-length")}
    return reply.content, kept


def floor_app(body: bytes, headers: dict[str, str], *, hops: int) -> Any:
    """A Serve application that answers every request with `body`: Ray's proxy and replica cost, nothing of carton."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    class Replay:
        async def __call__(self, request: Request) -> Response:
            await request.body()
            return Response(body, headers=headers)

    class Backend:
        async def __call__(self, request_body: bytes) -> bytes:
            return body

    class Ingress:
        def __init__(self, backend: Any) -> None:
            self._backend = backend

        async def __call__(self, request: Request) -> Response:
            return Response(await self._backend.remote(await request.body()), headers=headers)

    if hops == 1:
        return serve.deployment(name="Replay", max_ongoing_requests=64)(Replay).bind()
    backend = serve.deployment(name="Backend", max_ongoing_requests=64)(Backend).bind()
    return serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)(Ingress).bind(
        backend
    )


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

        def deploy_floor(hops: int) -> None:
            serve.delete("carton")
            serve.run(floor_app(*reply, hops=hops), name="carton", route_prefix="/")
            wait_ready(port)

        def measure(label: str, target: int) -> None:
            run_load(target, "identity", SHAPE, 1, 50)  # warm: the model loads on its first request
            p50 = run_load(target, "identity", SHAPE, 1, args.requests).p50_ms
            busy = run_load(target, "identity", SHAPE, 8, args.concurrent_requests)
            c8_p50, throughput = busy.p50_ms, busy.rate
            results.setdefault(label, []).append((p50, c8_p50, throughput, os.getloadavg()[0]))
            print(f"  {label:<28} c=1 p50 {p50:6.2f} ms   c=8 {throughput:7.0f} req/s (p50 {c8_p50:.2f} ms)")

        try:
            with carton_server(repo) as local:
                reply = canned_reply(local)
                for round_ in range(args.rounds):
                    print(f"round {round_ + 1}", flush=True)
                    for replicas in (1, 2):
                        measure("carton serve", local)
                        deploy(replicas)
                        measure(f"Ray Serve, {replicas} replica{'s' * (replicas > 1)}", port)
                    for hops in (1, 2):
                        deploy_floor(hops)
                        measure(f"Ray floor, {hops} hop{'s' * (hops > 1)} (no carton)", port)
                        serve.delete("carton")
        finally:
            serve.shutdown()
            ray.shutdown()

    def medians(label: str) -> tuple[float, float, float]:
        rows = results[label]
        return (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows),
                statistics.median(r[2] for r in rows))  # fmt: skip

    base_p50, _, base_rate = medians("carton serve")
    floor_p50, _, floor_rate = medians("Ray floor, 2 hops (no carton)")
    print(f"\nload average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}; "
          f"after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")  # fmt: skip
    print("| server | c=1 p50 ms (vs carton serve) | c=8 req/s (vs carton serve) | c=8 p50 ms | "
          "p50 / Ray floor 2 hops | req/s / Ray floor 2 hops | load (1 min) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for label, rows in results.items():
        p50, c8, rate = medians(label)
        load = max(r[3] for r in rows)
        print(f"| {label} | {p50:.2f} ({p50 / base_p50:.2f}x) | {rate:.0f} ({rate / base_rate:.2f}x) | {c8:.2f} | "
              f"{p50 / floor_p50:.2f}x | {rate / floor_rate:.2f}x | <= {load:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
