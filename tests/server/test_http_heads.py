"""Learnt request heads (``_http_heads.py`` and `_Connection._replay`): a request whose head repeats one the parser
already took is answered exactly as the parser would have it.

The oracle is the same connection with learning off: every byte stream below is fed, in the pieces given, to a
connection that learns and to one that never does (both real `_Connection`s with real httptools parsers on a uvloop
loop, writing to a recording transport), and what each writes back, and whether it closes, must be identical. Each
test also checks that the learnt path was taken, by counting the bytes the parser was fed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httptools
import pytest
from carton.server._http_heads import GIVE_UP, HEAD_LIMIT, HEADS, learn_head
from carton.server._http_messages import HttpRequest, HttpResponse, collect_body
from carton.server._http_server import HttpServer, _Connection
from carton.server.errors import ServerError

from .test_http_transport import connect, read_response, served

uvloop = pytest.importorskip("uvloop")

BODY = b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","parameters":{"binary_data_size":64}}]}' + bytes(
    range(64)
)
HEAD = (
    b"POST /v2/models/identity/infer HTTP/1.1\r\nUser-Agent: python/gevent-http-client-2.6.1\r\n"
    b"Inference-Header-Content-Length: 100\r\nHost: 127.0.0.1:8000\r\nContent-Length: %d\r\n\r\n" % len(BODY)
)
REQUEST = HEAD + BODY


async def echo(request: HttpRequest) -> HttpResponse:
    """Everything the handler was given, written back (/skip: answered without reading the body)."""
    if request.raw_path == b"/skip":
        return HttpResponse(200, [], [b"skipped"])
    try:
        body = await collect_body(request.body, declared=request.headers.get(b"content-length"), limit=8192)
    except ServerError as exc:
        return HttpResponse(exc.http_status, [], [str(exc).encode()])
    fields = [request.method.encode(), request.raw_path, *(b"%s=%s" % item for item in request.headers.items())]
    return HttpResponse(200, [(b"x-fields", b"|".join(fields))], [bytes(body)])


class Recorder:
    """The transport side of a connection: what it writes, and its closing."""

    def __init__(self, connection: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.connection = connection
        self.loop = loop
        self.written = bytearray()
        self.closed = False
        self.eof_written = False

    def write(self, data: Any) -> None:
        self.written += data

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.call_soon(self.connection.connection_lost, None)

    abort = close


class CountingParser:
    """The connection's parser, counting the bytes it is fed."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.fed = 0

    def feed_data(self, data: bytes) -> None:
        self.fed += len(data)
        self.parser.feed_data(data)

    def get_method(self) -> bytes:
        return bytes(self.parser.get_method())

    def should_keep_alive(self) -> bool:
        return bool(self.parser.should_keep_alive())


@contextmanager
def connection(*, learn: bool) -> Iterator[tuple[_Connection, Recorder, CountingParser, Any]]:
    loop = uvloop.new_event_loop()
    try:
        server = HttpServer(echo, loop, 30.0)
        conn = _Connection(server)
        if not learn:
            conn.unused = GIVE_UP
        parser = CountingParser(conn.parser)
        conn.parser = parser  # type: ignore[assignment]
        recorder = Recorder(conn, loop)
        conn.connection_made(recorder)  # type: ignore[arg-type]

        def settle() -> None:
            for _ in range(20):
                loop.run_until_complete(asyncio.sleep(0))

        yield conn, recorder, parser, settle
        conn.connection_lost(None)
        settle()
    finally:
        loop.close()


def transcript(pieces: list[bytes], *, learn: bool, prime: bytes = REQUEST) -> tuple[bytes, bool, bool, int]:
    """What a connection writes back for `prime` then `pieces` (fed one at a time, the loop run between them):
    the bytes, whether it closed, whether it shut its side, and how many bytes of `pieces` its parser was fed."""
    with connection(learn=learn) as (conn, recorder, parser, settle):
        conn.data_received(prime)
        settle()
        primed = parser.fed
        for piece in pieces:
            conn.data_received(piece)
            settle()
        return bytes(recorder.written), recorder.closed, recorder.eof_written, parser.fed - primed


def same_as_parser(pieces: list[bytes], *, prime: bytes = REQUEST) -> int:
    """Assert a learning connection answers `pieces` exactly as one that only parses; the bytes its parser saw."""
    learnt = transcript(pieces, learn=True, prime=prime)
    parsed = transcript(pieces, learn=False, prime=prime)
    assert learnt[:3] == parsed[:3]
    return learnt[3]


def parsed_fields(data: bytes) -> tuple[str, bytes, dict[bytes, bytes], bool]:
    """The method, target, headers and keep-alive httptools gives for the head `data` begins with."""
    got: dict[str, Any] = {"url": b"", "headers": {}}

    class Probe:
        def on_url(self, url: bytes) -> None:
            got["url"] += url

        def on_header(self, name: bytes, value: bytes) -> None:
            got["headers"][name.lower()] = value

        def on_headers_complete(self) -> None:
            got["method"] = parser.get_method().decode()
            got["keep_alive"] = parser.should_keep_alive()

    parser = httptools.HttpRequestParser(Probe())
    with contextlib.suppress(httptools.HttpParserUpgrade):  # what came before the switch is parsed all the same
        parser.feed_data(data)
    return got["method"], got["url"], got["headers"], got["keep_alive"]


def learn(data: bytes) -> Any:
    method, url, headers, keep_alive = parsed_fields(data)
    return learn_head(data, method=method, raw_path=url, headers=headers, keep_alive=keep_alive)


# ---- what a head means ---------------------------------------------------------------------------------------------
def test_a_learnt_head_means_what_httptools_parses_of_its_bytes() -> None:
    learnt = learn(REQUEST)
    assert learnt is not None
    head, known = learnt
    assert head == HEAD
    method, url, headers, keep_alive = parsed_fields(REQUEST)
    assert (known.method, known.raw_path, known.headers, known.length) == (method, url, headers, len(BODY))
    assert keep_alive


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", id="chunked"),
        pytest.param(b"POST /a HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\nab", id="expect"),
        pytest.param(b"POST /a HTTP/1.1\r\nContent-Length: 2\r\nUpgrade: h2c\r\nConnection: x\r\n\r\nab", id="upgrade"),
        pytest.param(b"POST /a HTTP/1.1\r\nContent-Length: 2\r\nConnection: Upgrade\r\n\r\nab", id="connection-up"),
        pytest.param(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n", id="no-content-length"),
        pytest.param(b"POST /a HTTP/1.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\nab", id="close"),
        pytest.param(b"POST /a HTTP/1.0\r\nContent-Length: 2\r\n\r\nab", id="http-1.0"),
        pytest.param(b"POST /a HTTP/1.1\r\nContent-Length: 2 \r\n\r\nab", id="length-with-space"),
        pytest.param(b"POST /a HTTP/1.1\r\nContent-Length: 70000\r\n\r\n", id="large-body"),
        pytest.param(b"POST /a HTTP/1.1\r\nX-Pad: " + b"p" * HEAD_LIMIT + b"\r\nContent-Length: 0\r\n\r\n", id="long"),
    ],
)
def test_heads_never_learnt(request_bytes: bytes) -> None:
    assert learn(request_bytes) is None


def test_a_head_just_under_the_limit_is_learnt_and_one_over_is_not() -> None:
    base = b"POST /a HTTP/1.1\r\nContent-Length: 0\r\nX-Pad: \r\n\r\n"
    fits = base.replace(b"X-Pad: ", b"X-Pad: " + b"p" * (HEAD_LIMIT - len(base)))
    assert len(fits) == HEAD_LIMIT and learn(fits) is not None
    assert learn(fits.replace(b"X-Pad: ", b"X-Pad: p")) is None


# ---- replayed exactly as parsed ------------------------------------------------------------------------------------
def test_a_learnt_head_is_answered_without_the_parser() -> None:
    assert same_as_parser([REQUEST] * 3) == 0


def test_a_changed_byte_in_the_head_goes_to_the_parser() -> None:
    for at in (0, 5, len(HEAD) // 2, len(HEAD) - 3, len(HEAD) - 1):
        changed = bytearray(REQUEST)
        changed[at] ^= 0x20 if chr(changed[at]).isalpha() else 0x01
        fed = same_as_parser([REQUEST, bytes(changed), REQUEST])
        assert fed == len(changed)


def test_a_head_with_another_content_length_goes_to_the_parser() -> None:
    other = HEAD.replace(b"Content-Length: %d" % len(BODY), b"Content-Length: %d" % (len(BODY) - 1)) + BODY[:-1]
    assert same_as_parser([other, REQUEST]) == len(other)


def test_a_body_split_at_every_byte_is_taken_whole() -> None:
    for cut in range(1, len(REQUEST)):
        fed = same_as_parser([REQUEST[:cut], REQUEST[cut:]])
        # A head cut short cannot be recognised: that request is the parser's; a whole head is not.
        assert fed == (0 if cut >= len(HEAD) else len(REQUEST))


def test_every_byte_alone() -> None:
    same_as_parser([bytes((byte,)) for byte in REQUEST * 2])


def test_pipelined_learnt_and_unknown_heads_mixed() -> None:
    unknown = b"POST /other HTTP/1.1\r\nContent-Length: 3\r\n\r\nxyz"
    chunked = b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    stream = REQUEST + REQUEST + unknown + REQUEST + chunked + REQUEST + REQUEST
    fed = same_as_parser([stream])
    assert fed < len(stream)  # the learnt requests at the front were taken without the parser
    for cut in range(0, len(stream), 37):
        same_as_parser([stream[:cut], stream[cut:]])


def test_a_malformed_request_after_a_learnt_one_gets_its_400() -> None:
    for bad in (b"BOGUS\r\n\r\n", b"POST /a HTTP/1.1\r\nContent-Length: x\r\n\r\n"):
        same_as_parser([REQUEST + bad])
        same_as_parser([REQUEST, bad])
        written, closed, shut, _ = transcript([REQUEST, bad], learn=True)
        assert written.count(b"HTTP/1.1 200 OK") == 2 and b"HTTP/1.1 400 Bad Request" in written
        assert closed or shut


def test_a_body_left_unread_is_dropped_as_it_arrives() -> None:
    skip = REQUEST.replace(b"/v2/models/identity/infer", b"/skip")
    head = len(skip) - len(BODY)
    for cut in (head, head + 1, head + 50, len(skip) - 1):
        fed = same_as_parser([skip[:cut], skip[cut:] + skip + REQUEST], prime=skip)
        assert fed == len(REQUEST)  # only the head learnt on this connection is taken without the parser


def test_connection_close_is_honoured_after_learnt_requests() -> None:
    close = REQUEST.replace(b"Host:", b"Connection: close\r\nHost:")
    same_as_parser([REQUEST, close, REQUEST])
    written, _, shut, _ = transcript([REQUEST, close, REQUEST], learn=True)
    assert written.count(b"HTTP/1.1 200 OK") == 3 and shut and written.endswith(BODY)


def test_an_upgrade_after_a_learnt_request() -> None:
    upgrade = b"POST /u HTTP/1.1\r\nUpgrade: h2c\r\nConnection: upgrade\r\nContent-Length: 0\r\n\r\n"
    same_as_parser([REQUEST + upgrade + REQUEST])
    same_as_parser([REQUEST, upgrade, REQUEST])


def test_a_connection_stops_learning_when_its_heads_go_unused() -> None:
    with connection(learn=True) as (conn, _, parser, settle):
        for index in range(GIVE_UP + 3):  # a new target each time: every head is learnt, none replayed
            conn.data_received(REQUEST.replace(b"/infer", b"/%04d" % index))
            settle()
        assert conn.unused == GIVE_UP and len(conn.known) == HEADS
        learnt = set(conn.known)
        conn.data_received(REQUEST)  # a new head: parsed, not learnt
        settle()
        assert set(conn.known) == learnt and HEAD not in conn.known
        fed = parser.fed
        again = REQUEST.replace(b"/infer", b"/%04d" % (GIVE_UP - 1))  # a learnt head: replayed, learning resumes
        conn.data_received(again)
        settle()
        assert parser.fed == fed and conn.unused == 0
        conn.data_received(REQUEST)
        settle()
        assert HEAD in conn.known


def test_a_head_dropped_for_newer_ones_goes_to_the_parser_again() -> None:
    # The head a request last began with is compared first; once it is dropped from the learnt ones, it is not.
    others = [REQUEST.replace(b"/infer", b"/%04d" % index) for index in range(HEADS)]
    with connection(learn=True) as (conn, _, parser, settle):
        for data in (REQUEST, REQUEST, *others):  # learnt, replayed, then dropped as the oldest of HEADS + 1
            conn.data_received(data)
            settle()
        assert HEAD not in conn.known and conn.last_head is None
        fed = parser.fed
        conn.data_received(REQUEST)
        settle()
        assert parser.fed - fed == len(REQUEST)
        conn.data_received(REQUEST)
        settle()
        assert parser.fed - fed == len(REQUEST) and conn.last_head == HEAD
    same_as_parser([REQUEST, *others, REQUEST, REQUEST + REQUEST, REQUEST])


# ---- over a socket -------------------------------------------------------------------------------------------------
def test_over_a_socket_each_request_gets_the_fields_the_parser_gave_the_first() -> None:
    with served(echo) as (port, server):  # type: ignore[arg-type]
        sock = connect(port)
        buffer = bytearray()
        answers = []
        for _ in range(3):
            sock.sendall(REQUEST)
            answers.append(read_response(sock, buffer))
        sock.sendall(REQUEST * 3)
        answers += [read_response(sock, buffer) for _ in range(3)]
        (conn,) = server.connections
        assert HEAD in conn.known
        sock.close()
    assert len({(status, headers[b"x-fields"], body) for status, headers, body in answers}) == 1
    assert answers[0][0] == 200 and answers[0][2] == BODY
