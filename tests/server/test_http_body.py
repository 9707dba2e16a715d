"""Large request bodies received straight into one reused buffer (``_http_body.py``, ``_http_server.py``): at the
socket level against `serve_http` on a uvloop loop (the helpers of ``test_http_transport.py``), and `BodyBuffers`
alone."""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
from carton.server._http_body import BodyBuffers
from carton.server._http_messages import HttpRequest, HttpResponse, collect_body
from carton.server.errors import ServerError

from .test_http_transport import Handler, connect, read_response, served, wait_until

pytest.importorskip("uvloop")

SIZE = 3 << 20  # over the size from which a declared body is received into one buffer


def body_of(seed: int, size: int = SIZE) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def request(body: bytes, path: bytes = b"/digest", extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n" % (path, extra, len(body)) + body


def digest(body: bytes) -> bytes:
    return hashlib.sha256(body).hexdigest().encode()


class BodyHandler(Handler):
    """/digest answers the body's SHA-256 and its type; /keep keeps an array over the body as well."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[np.ndarray] = []

    async def answer(self, request: HttpRequest) -> HttpResponse:
        if request.raw_path not in (b"/digest", b"/keep"):
            return await super().answer(request)
        try:
            body = await collect_body(request.body, declared=request.headers.get(b"content-length"), limit=1 << 30)
        except ServerError as exc:
            self.failures.append(str(exc))
            return HttpResponse(exc.http_status, [], [str(exc).encode()])
        if request.raw_path == b"/keep":
            self.kept.append(np.frombuffer(body, np.uint8))
        return HttpResponse(200, [(b"x-type", type(body).__name__.encode())], [digest(bytes(body))])


def test_large_bodies_arrive_whole_in_one_reused_buffer() -> None:
    handler = BodyHandler()
    with served(handler) as (port, server), connect(port) as sock:
        buffer = bytearray()
        # The first request's head goes through the parser, the next ones' are replayed (learnt): both paths hand
        # the rest of the body to the sink. Each body differs, so a stale byte would show in the digest.
        for seed in range(4):
            body = body_of(seed)
            sock.sendall(request(body))
            status, headers, answer = read_response(sock, buffer)
            assert (status, answer, headers[b"x-type"]) == (200, digest(body), b"bytearray"), seed
        assert (server.buffers.made, server.buffers.reused) == (1, 3)
        # Another size within the kept buffer's allocation takes it too; small bodies never do.
        smaller = body_of(9, SIZE - 12345)
        sock.sendall(request(smaller) + request(b"tiny"))
        assert read_response(sock, buffer)[2] == digest(smaller)
        assert read_response(sock, buffer)[2] == digest(b"tiny")
        assert (server.buffers.made, server.buffers.reused) == (1, 4)


def test_a_large_body_sent_in_pieces_with_requests_pipelined_behind_it() -> None:
    handler = BodyHandler()
    with served(handler) as (port, _), connect(port) as sock:
        bodies = [body_of(seed) for seed in range(2)]
        wire = request(bodies[0]) + request(b"small") + request(bodies[1]) + b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n"
        for start in range(0, len(wire), 100_003):  # odd pieces: heads and bodies split anywhere
            sock.sendall(wire[start : start + 100_003])
        buffer = bytearray()
        answers = [read_response(sock, buffer)[2] for _ in range(4)]
        assert answers == [digest(bodies[0]), digest(b"small"), digest(bodies[1]), b"/after"]


def test_a_body_still_referenced_is_not_reused() -> None:
    handler = BodyHandler()
    with served(handler) as (port, server), connect(port) as sock:
        first, second = body_of(1), body_of(2)
        buffer = bytearray()
        sock.sendall(request(first, b"/keep"))
        assert read_response(sock, buffer)[2] == digest(first)
        sock.sendall(request(second, b"/keep"))
        assert read_response(sock, buffer)[2] == digest(second)
        assert [digest(kept.tobytes()) for kept in handler.kept] == [digest(first), digest(second)]
        assert server.buffers.reused == 0 and server.buffers.made == 2


def test_concurrent_large_bodies_get_buffers_of_their_own() -> None:
    handler = BodyHandler()
    results: dict[int, bytes] = {}
    with served(handler) as (port, server):

        def client(seed: int) -> None:
            with connect(port) as sock:
                buffer = bytearray()
                for round_ in range(3):
                    body = body_of(seed * 10 + round_)
                    sock.sendall(request(body))
                    answer = read_response(sock, buffer)[2]
                    results[seed * 10 + round_] = b"ok" if answer == digest(body) else answer

        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(1, 4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert results == {seed * 10 + r: b"ok" for seed in range(1, 4) for r in range(3)}
        assert server.buffers.made <= 3 and len(server.buffers.free) <= server.buffers.keep_count


@pytest.mark.parametrize("how", ["close", "half-close"])
def test_a_client_leaving_mid_body(how: str, caplog: pytest.LogCaptureFixture) -> None:
    handler = BodyHandler()
    with caplog.at_level(logging.DEBUG, "carton"), served(handler) as (port, server):
        body = body_of(5)
        with connect(port) as sock:
            sock.sendall(request(body)[: SIZE // 2])
            assert wait_until(lambda: handler.started)
            if how == "half-close":
                sock.shutdown(socket.SHUT_WR)
                assert read_response(sock, bytearray())[0] == 400
        assert wait_until(lambda: handler.finished and not server.connections)
        assert handler.failures == ["the client disconnected before sending the whole body"]
        # The buffer of the body cut short is not kept, and the server reads the next large body as ever.
        assert server.buffers.free == []
        with connect(port) as sock:
            sock.sendall(request(body))
            assert read_response(sock, bytearray())[2] == digest(body)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_expect_continue_with_a_large_body() -> None:
    handler = BodyHandler()
    with served(handler) as (port, _), connect(port) as sock:
        body = body_of(7)
        head, _, _ = request(body, extra=b"Expect: 100-continue\r\n").partition(b"\r\n\r\n")
        sock.sendall(head + b"\r\n\r\n")
        buffer = bytearray()
        assert read_response(sock, buffer)[0] == 100
        sock.sendall(body)
        assert read_response(sock, buffer)[2] == digest(body)


def test_a_declared_length_over_the_limit_is_refused_before_a_buffer_is_taken() -> None:
    handler = Handler()  # /echo reads under an 8 KiB limit
    with served(handler) as (port, server), connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % SIZE + b"x" * 1000)
        assert read_response(sock, bytearray())[0] == 413
        assert server.buffers.made == 0


def test_body_buffers_are_bounded_and_exact() -> None:
    buffers = BodyBuffers(keep_bytes=3 * SIZE, keep_count=2)
    taken = [buffers.take(SIZE) for _ in range(3)]
    assert [len(buffer) for buffer in taken] == [SIZE] * 3 and buffers.made == 3
    while taken:
        buffers.give(taken.pop(), 1)  # (the argument is the only reference)
    assert len(buffers.free) == 2  # the count bound
    # A buffer is taken for a size it holds without moving (at least half its allocation), at exactly that size.
    assert len(buffers.take(SIZE // 2 + 1)) == SIZE // 2 + 1 and buffers.reused == 1
    assert len(buffers.take(SIZE // 3)) == SIZE // 3 and buffers.made == 4
    # One still referenced elsewhere is not kept.
    held = buffers.take(SIZE)
    other = held
    buffers.give(held, 1)
    assert all(buffer is not other for buffer in buffers.free)
    # Nor one past the byte bound.
    small = BodyBuffers(keep_bytes=SIZE - 1)
    small.give(small.take(SIZE), 1)
    assert small.free == []


def _infer_request(x: np.ndarray) -> bytes:
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor], outputs=[output])
    head = b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body)
    return head + b"Inference-Header-Content-Length: %d\r\n\r\n" % json_size + body


def _output(answer: bytes, headers: dict[bytes, bytes], x: np.ndarray) -> np.ndarray:
    json_size = int(headers[b"inference-header-content-length"])
    return np.frombuffer(answer[json_size:], np.float32).reshape(x.shape)


def test_a_response_in_lent_memory_is_intact_however_slowly_the_client_reads(repository: Path) -> None:
    """The identity model's output (its version 2 doubles) lies in its runner's shared memory, lent to the
    response until it is written: a client that reads slowly holds it, and answers to other clients meanwhile go
    elsewhere."""
    from carton.server import ModelControlMode, ServerOptions, serve_in_thread

    options = ServerOptions(
        repository=repository, http_port=0, grpc_port=None, model_control_mode=ModelControlMode.EXPLICIT,
        load_models=("identity",), max_body_size=64 << 20, upload_sandbox=None,
    )  # fmt: skip
    xs = [np.random.default_rng(seed).standard_normal((1, 4 << 20), np.float32) for seed in range(4)]  # 16 MiB
    with serve_in_thread(options) as server:
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        slow.settimeout(30)
        slow.connect(("127.0.0.1", server.http_port))
        with slow, connect(server.http_port) as other:
            slow.sendall(_infer_request(xs[0]))
            first = slow.recv(4096)  # its answer has begun, and waits on the client
            buffer = bytearray()
            for x in xs[1:]:
                other.sendall(_infer_request(x))
                status, headers, answer = read_response(other, buffer)
                assert status == 200 and np.array_equal(_output(answer, headers, x), x * 2)
            status, headers, answer = read_response(slow, bytearray(first))
            assert status == 200 and np.array_equal(_output(answer, headers, xs[0]), xs[0] * 2)


def test_a_response_is_done_only_once_the_transport_holds_none_of_it() -> None:
    """`HttpResponse.done` (what gives lent memory back) is called once per response, after its parts have left
    the transport's buffer (which may hold the parts themselves rather than copies), with the transport's
    flow-control limits as they were."""
    payload = np.arange(38_535_168 // 4, dtype=np.float32)
    seen: list[tuple[int, tuple[int, int]]] = []

    class Lending(Handler):
        connection: object = None

        async def answer(self, request: HttpRequest) -> HttpResponse:
            transport = self.connection.transport  # type: ignore[attr-defined]

            def done() -> None:
                seen.append((transport.get_write_buffer_size(), transport.get_write_buffer_limits()))

            return HttpResponse(200, [], [payload.data.cast("B")], done=done)

    handler = Lending()
    with served(handler) as (port, server), connect(port) as sock:
        assert wait_until(lambda: server.connections)
        (handler.connection,) = server.connections
        limits = threading.Event()

        def set_limits() -> None:
            handler.connection.transport.set_write_buffer_limits(high=4 << 20, low=2 << 20)  # type: ignore[attr-defined]
            limits.set()

        server.loop.call_soon_threadsafe(set_limits)
        assert limits.wait(30)
        buffer = bytearray()
        for _ in range(3):
            sock.sendall(b"GET /lent HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, answer = read_response(sock, buffer)
            assert status == 200 and answer == payload.tobytes()
        assert wait_until(lambda: len(seen) == 3)
        # Nothing left in the transport, and its own limits back as they were.
        assert seen == [(0, (2 << 20, 4 << 20))] * 3
