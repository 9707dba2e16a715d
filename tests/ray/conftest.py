"""A local two-node Ray cluster (`ray.cluster_utils.Cluster`, one CPU per node, no dashboard, logs in a temporary
folder) shared by the Ray tests, and a repository of three real ONNX cartons, one that can spin for hours, and a
corrupt one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("tritonclient.http")

import carton  # noqa: E402
from carton_ray_support import CONSTANTS, onnx_model, spinning_model  # noqa: E402


@pytest.fixture(scope="session")
def ray_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray-repo")
    repo = root / "repo"
    repo.mkdir()
    for name, constant in CONSTANTS.items():
        folder = root / "src" / name
        folder.mkdir(parents=True)
        onnx.save(onnx_model(constant), folder / "model.onnx")
        (repo / name / "1").mkdir(parents=True)
        carton.pack(
            folder, repo / name / "1" / "model.carton", runner_name="onnxruntime", required_framework_version="*"
        )
    (root / "src" / "spin").mkdir(parents=True)
    onnx.save(spinning_model(), root / "src" / "spin" / "model.onnx")
    (repo / "spin" / "1").mkdir(parents=True)
    carton.pack(root / "src" / "spin", repo / "spin" / "1" / "model.carton", runner_name="onnxruntime",
                required_framework_version="*")  # fmt: skip
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.carton").write_bytes(b"PK\x03\x04 this is not a carton")
    return repo


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[object]:
    """Two Ray nodes on this machine, one CPU each, so that two model replicas of one CPU land on different nodes."""
    import ray
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="carton-ray-")  # short: Ray's socket paths must fit in sun_path
    settings = {
        "RAY_TMPDIR": temp,
        "RAY_USAGE_STATS_ENABLED": "0",
        # Serve gives a starting proxy a few seconds before it kills it as unhealthy, and serve.start then fails; on
        # two cores shared with the rest of the suite a proxy can take longer than that to import and bind.
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    }
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(temp, ignore_errors=True)
