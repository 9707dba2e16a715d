"""The host against a runner that lies: the test plays the runner on the real endpoint and sends bad replies.

`wrap` swaps the runner for a sleeping process (so the host's pidfd stays quiet) and hands the endpoint and the
runner's end of the shared-memory channel to a thread here, which answers with whatever the case needs.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import carton
import msgspec
import numpy as np
import pytest
import zmq
from carton._runtime._launch import LaunchPlan
from carton._runtime._process import DEFAULT_SHM_THRESHOLD, RunnerProcess
from carton_protocol import PROTOCOL_VERSION, Hello, RemoteError
from carton_protocol._messages import encode

from .conftest import make_spec

Script = Callable[["FakeRunner"], None]


class FakeRunner:
    def __init__(self, plan: LaunchPlan, script: Script) -> None:
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.linger = 0
        if plan.listen_fd is not None:  # as the real runner does: adopt the socket the host bound at the endpoint
            self.router.setsockopt(zmq.USE_FD, os.dup(plan.listen_fd))
        self.router.bind(plan.endpoint)
        self.channel = socket.socket(fileno=os.dup(plan.pass_fds[0])) if plan.pass_fds else None
        self.received: list[list[bytes]] = []
        self.script = script
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the test is over and closed the context
            self.script(self)

    def receive(self) -> tuple[bytes, dict[str, Any]]:
        frames = self.router.recv_multipart()
        self.received.append(frames[1:])
        return frames[0], msgspec.msgpack.decode(frames[1])

    def reply(self, ident: bytes, header: Any, *frames: bytes, raw_header: bytes | None = None) -> None:
        data = raw_header if raw_header is not None else msgspec.msgpack.encode(header)
        self.router.send_multipart([ident, data, *frames])

    def hello(self) -> None:
        ident, header = self.receive()
        self.reply(
            ident,
            {
                "reply": "hello",
                "id": header["id"],
                "protocol": PROTOCOL_VERSION,
                "pid": os.getpid(),
                "entry": "fake:Runner",
            },
        )

    def close(self) -> None:
        self.context.destroy(linger=0)
        if self.channel is not None:
            self.channel.close()


@pytest.fixture
def fake() -> Iterator[Callable[[Script], tuple[RunnerProcess, FakeRunner]]]:
    made: list[tuple[RunnerProcess | None, FakeRunner]] = []

    def start(script: Script, **kwargs: Any) -> tuple[RunnerProcess, FakeRunner]:
        holder: list[FakeRunner] = []

        def wrap(plan: LaunchPlan) -> LaunchPlan:
            holder.append(FakeRunner(plan, script))
            made.append((None, holder[0]))
            return replace(plan, argv=(sys.executable, "-c", "import time; time.sleep(120)"))

        runner = RunnerProcess.start(make_spec("fake:Runner"), wrap=wrap, handshake_timeout=5, **kwargs)
        made[-1] = (runner, holder[0])
        return runner, holder[0]

    yield start
    for runner, fake_runner in made:
        if runner is not None:
            runner.close(timeout=0.2)
        fake_runner.close()


def serve_one_infer(reply: Callable[[FakeRunner, bytes, dict[str, Any]], None]) -> Script:
    def script(runner: FakeRunner) -> None:
        runner.hello()
        ident, header = runner.receive()
        reply(runner, ident, header)

    return script


def test_the_host_sends_the_documented_hello(fake: Any) -> None:
    runner, peer = fake(lambda peer: peer.hello())
    expected = Hello(id=1, protocol=PROTOCOL_VERSION, host_pid=os.getpid(), shm_threshold=DEFAULT_SHM_THRESHOLD)
    assert peer.received[0] == [encode(expected)]
    assert runner.alive


def test_a_garbled_handshake_is_runner_protocol_error(fake: Any) -> None:
    def script(peer: FakeRunner) -> None:
        ident, _ = peer.receive()
        peer.reply(ident, None, raw_header=b"\xc1\xc1")

    with pytest.raises(carton.RunnerProtocolError, match="malformed handshake: header frame is not valid msgpack"):
        fake(script)


@pytest.mark.parametrize(
    "reply",
    [
        {"id": 1, "ok": True, "protocol": 7},  # laid out as protocol 1 did: no tag
        {"reply": "hello", "id": 1, "protocol": 7, "pid": 1, "entry": "fake:Runner"},
        {"reply": "error", "id": 1, "code": "protocol", "message": "no", "protocol": 7},
    ],
)
def test_a_handshake_from_another_version_is_protocol_mismatch(fake: Any, reply: dict[str, Any]) -> None:
    def script(peer: FakeRunner) -> None:
        ident, _ = peer.receive()
        peer.reply(ident, reply)

    expected = f"host speaks carton protocol {PROTOCOL_VERSION}, runner fake:Runner speaks 7"
    with pytest.raises(carton.ProtocolMismatch, match=expected) as caught:
        fake(script)
    assert (caught.value.host_version, caught.value.runner_version) == (PROTOCOL_VERSION, 7)


def test_stale_replies_are_skipped(fake: Any) -> None:
    def reply(peer: FakeRunner, ident: bytes, header: dict[str, Any]) -> None:
        peer.reply(ident, {"reply": "infer", "id": header["id"] - 1, "tensors": []})  # a late answer to an older call
        entry = {"name": "y", "datatype": "INT8", "shape": [1], "size": 1}
        peer.reply(ident, {"reply": "infer", "id": header["id"], "tensors": [entry]}, b"\x05")

    runner, _ = fake(serve_one_infer(reply))
    assert runner.infer({"x": np.zeros(1)})["y"].tolist() == [5]


def test_replies_in_a_learnt_layout_are_still_checked(fake: Any) -> None:
    """A reply whose header bytes repeat one the host accepted before is read through the header template's plan,
    without decoding the message: a stale reply in that layout is still skipped, and a data frame of the wrong size
    is still refused, naming the tensor."""
    entry = {"name": "y", "datatype": "INT8", "shape": [1], "size": 1}

    def script(peer: FakeRunner) -> None:
        peer.hello()
        for frame in (b"\x05", b"\x06", b"\x07\x07"):
            ident, header = peer.receive()
            if frame == b"\x06":  # first a late answer to the call before, in the same layout
                peer.reply(ident, {"reply": "infer", "id": header["id"] - 1, "tensors": [entry]}, b"\x09")
            peer.reply(ident, {"reply": "infer", "id": header["id"], "tensors": [entry]}, frame)

    runner, _ = fake(script)
    assert runner.infer({"x": np.zeros(1)})["y"].tolist() == [5]
    assert runner.infer({"x": np.zeros(1)})["y"].tolist() == [6]
    with pytest.raises(carton.RunnerProtocolError, match=r"malformed .*'y': data frame is 2 bytes, header says 1"):
        runner.infer({"x": np.zeros(1)})


@pytest.mark.parametrize(
    ("tensors", "frames", "message"),
    [
        ([{"name": "y", "datatype": "FP32", "shape": [4], "size": 16}], [b"\x00" * 8], "data frame is 8 bytes"),
        ([{"name": "y", "datatype": "FP32", "shape": [1 << 40], "size": 4}], [b"\x00" * 4], "needs 4398046511104"),
        ([{"name": "y", "datatype": "BYTES", "shape": [1 << 22], "size": 1 << 24}], [b""], "BYTES elements, over"),
        (
            [{"name": "y", "datatype": "FP32", "shape": [1], "size": 4, "shm": ["../../etc/passwd", 0]}],
            [],
            "segment '../../etc/passwd' was never passed",
        ),
        ("not a list", [], r"Expected `array`, got `str` - at `\$.tensors`"),
    ],
)
def test_lying_outputs_are_runner_protocol_errors(fake: Any, tensors: Any, frames: list[bytes], message: str) -> None:
    def reply(peer: FakeRunner, ident: bytes, header: dict[str, Any]) -> None:
        peer.reply(ident, {"reply": "infer", "id": header["id"], "tensors": tensors}, *frames)

    runner, _ = fake(serve_one_infer(reply))
    begin = time.monotonic()
    with pytest.raises(carton.RunnerProtocolError, match=f"malformed .*{message}"):
        runner.infer({"x": np.zeros(1)})
    assert time.monotonic() - begin < 3


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("invalid_input", carton.InvalidInput),
        ("invalid_output", carton.InvalidOutput),
        ("out_of_memory", carton.RunnerMemoryLimit),
        ("protocol", carton.RunnerProtocolError),
        ("unsupported_model", carton.RunnerFailed),
        ("internal", carton.RunnerFailed),
        ("a_code_from_a_newer_runner", carton.RunnerFailed),
    ],
)
def test_error_codes_become_their_carton_exceptions(fake: Any, code: str, error: type[Exception]) -> None:
    def reply(peer: FakeRunner, ident: bytes, header: dict[str, Any]) -> None:
        failure = {
            "reply": "error",
            "id": header["id"],
            "code": code,
            "message": "no!",
            "exception": "Oops",
            "traceback": "Traceback: ...",
            "tensor": "x",
        }
        peer.reply(ident, failure)

    runner, _ = fake(serve_one_infer(reply))
    with pytest.raises(error, match="no!") as caught:
        runner.infer({"x": np.zeros(1)})
    failure = caught.value
    cause = failure.__cause__
    assert isinstance(cause, RemoteError) and (cause.code, cause.exception, cause.tensor) == (code, "Oops", "x")
    assert cause.traceback == "Traceback: ..."
    if isinstance(failure, carton.RunnerError):
        assert (failure.remote_kind, failure.remote_message) == (code, "no!")
    else:
        assert failure.tensor == "x"  # type: ignore[attr-defined]


def _memfd(size: int, *, sealed: bool) -> int:
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


@pytest.mark.parametrize(
    ("sealed", "announced", "offset", "message"),
    [
        (False, 1 << 20, 0, "segment 'r0' is not sealed against shrinking"),
        (True, 1 << 21, 0, "segment 'r0' is 1048576 bytes, announced as 2097152"),
        (True, 1 << 20, (1 << 20) - 2, r"bytes 1048574..1048578 lie outside segment 'r0'"),
    ],
)
def test_shared_memory_the_host_cannot_trust_is_refused(
    fake: Any, sealed: bool, announced: int, offset: int, message: str
) -> None:
    def reply(peer: FakeRunner, ident: bytes, header: dict[str, Any]) -> None:
        fd = _memfd(1 << 20, sealed=sealed)
        assert peer.channel is not None
        socket.send_fds(peer.channel, [f"r0 {announced}".encode()], [fd])
        os.close(fd)
        entry = {"name": "y", "datatype": "FP32", "shape": [1], "size": 4, "shm": ["r0", offset]}
        peer.reply(ident, {"reply": "infer", "id": header["id"], "tensors": [entry]})

    runner, _ = fake(serve_one_infer(reply))
    with pytest.raises(carton.RunnerProtocolError, match=message):
        runner.infer({"x": np.zeros(1)})


def test_a_runner_truncating_its_segment_cannot_crash_the_host(fake: Any) -> None:
    """Seals make the kernel refuse the truncation that would otherwise SIGBUS the host while it copies."""
    outcome: list[str] = []

    def reply(peer: FakeRunner, ident: bytes, header: dict[str, Any]) -> None:
        fd = _memfd(1 << 20, sealed=True)
        mapping = mmap.mmap(fd, 1 << 20)
        mapping[:4] = np.float32(7).tobytes()
        assert peer.channel is not None
        socket.send_fds(peer.channel, [f"r0 {1 << 20}".encode()], [fd])
        try:
            os.ftruncate(fd, 0)
        except PermissionError:
            outcome.append("refused")
        entry = {"name": "y", "datatype": "FP32", "shape": [1], "size": 4, "shm": ["r0", 0]}
        peer.reply(ident, {"reply": "infer", "id": header["id"], "tensors": [entry]})
        peer.receive()  # the host releases the segment once it has copied the output
        os.close(fd)

    runner, _ = fake(serve_one_infer(reply))
    assert runner.infer({"x": np.zeros(1)})["y"].tolist() == [7.0]
    assert outcome == ["refused"]
