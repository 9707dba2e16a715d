"""`serve run carton.ray:build_app repository=...` from a shell, against the test cluster: it answers, and SIGINT
leaves no replica and no runner behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from carton_ray_support import expected, free_port, replica_pids, runner_pids

pytestmark = pytest.mark.timeout(600)


def test_serve_run_answers_and_sigint_leaves_nothing_behind(ray_cluster: object, ray_repository: Path) -> None:
    import tritonclient.http as httpclient
    from ray import serve

    port = free_port()
    # `serve run` keeps the HTTP options of a Serve instance already running on the cluster: this one listens on a
    # free loopback port instead of Serve's default 8000.
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    command = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
    process = subprocess.Popen(
        [command, "run", "--address", ray_cluster.address, "carton.ray:build_app",  # type: ignore[attr-defined]
         f"repository={ray_repository}", "max_models_per_replica=1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )  # fmt: skip
    hosts: list[int] = []
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120)
        deadline = time.monotonic() + 240
        while True:
            try:
                if client.is_server_ready():
                    break
            except Exception:
                pass
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "serve run did not answer"
            time.sleep(0.5)
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        tensor = httpclient.InferInput("x", [2, 4], "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("beta", [tensor]).as_numpy("y"), expected("beta", x))
        hosts = replica_pids()
        assert runner_pids(hosts)
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
