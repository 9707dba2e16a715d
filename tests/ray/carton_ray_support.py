"""Helpers of the Ray tests: the three models and their in-process reference, free ports, and replica and runner
processes found in /proc."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

#: Each model adds its own constant to a [n, 4] FP32 input (so a wrong route gives a wrong answer).
CONSTANTS = {"alpha": 1.5, "beta": -2.25, "gamma": 1e-3}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def onnx_model(constant: float) -> object:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        initializer=[helper.make_tensor("c", TensorProto.FLOAT, [], [constant])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def spinning_model() -> object:
    """y = x + trips, computed by a Loop of `trips` iterations: a large `trips` keeps the runner busy for hours."""
    fp32 = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["acc_in", "one"], ["acc"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", fp32, [1]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc", fp32, [1]),
        ],
        [helper.make_tensor("one", fp32, [1], [1.0])],
    )
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMax", ["trips"], ["count"], keepdims=0),
            helper.make_node("Loop", ["count", "go", "x"], ["y"], body=body),
        ],
        "spin",
        [helper.make_tensor_value_info("x", fp32, [1]), helper.make_tensor_value_info("trips", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", fp32, [1])],
        initializer=[helper.make_tensor("go", TensorProto.BOOL, [], [True])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def expected(name: str, x: np.ndarray) -> np.ndarray:
    """What onnxruntime computes in this process for model `name` (the reference the served results must equal)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(onnx_model(CONSTANTS[name]).SerializeToString())  # type: ignore[attr-defined]
    return np.asarray(session.run(["y"], {"x": x})[0])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        pid = _parent(pid)
        if pid == ancestor:
            return True
    return False


def replica_pids(deployment: str = "CartonModels") -> list[int]:
    """Processes of the deployment's replicas (Ray titles them ``ray::ServeReplica:<app>:<deployment>``) in this
    test session's cluster, whose raylets are children of this process: another cluster on the machine is not
    counted."""
    return [
        pid
        for pid in pids()
        if f":{deployment}" in _cmdline(pid) and "ServeReplica" in _cmdline(pid) and _descends_from(pid, os.getpid())
    ]


def runner_pids(hosts: Iterable[int], *, direct: bool = False) -> list[int]:
    """carton runner processes (``python -m carton_protocol ... --host-pid PID``) started by the processes `hosts`
    (whether or not those still run: a runner outliving its host is what the tests look for). `direct`: only the
    hosts' own children, one per runner (a runner's own helper processes carry the same command line)."""
    wanted = {str(pid) for pid in hosts}
    found = []
    for pid in pids():
        words = _cmdline(pid).split()
        if "carton_protocol" in words and "--host-pid" in words:
            host = words[words.index("--host-pid") + 1] if words.index("--host-pid") + 1 < len(words) else ""
            if host in wanted and (not direct or str(_parent(pid)) == host):
                found.append(pid)
    return found


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead and not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def parent_of(pid: int) -> int:
    return _parent(pid)
