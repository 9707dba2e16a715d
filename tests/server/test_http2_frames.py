"""carton's HTTP/2 frame layer (carton/server/_http2.py, _http2_frames.py) byte for byte: hand-built frames over a
real socket to the gRPC port, and the exact frames that come back (settings, pings, header blocks, flow control,
connection errors)."""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from carton.server import Server
from carton.server._proto import message_class
from hpack import Decoder, Encoder

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 2, 3, 4, 6, 7, 8, 9
END_STREAM, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x4, 0x8, 0x20
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = 1, 3, 6, 7, 9
SERVICE = "/inference.GRPCInferenceService"

# What the server says first, exactly: MAX_CONCURRENT_STREAMS 1000, INITIAL_WINDOW_SIZE 4 MiB, MAX_FRAME_SIZE 1 MiB,
# then the connection's window raised from 65535 to 4 MiB.
SERVER_SETTINGS = bytes.fromhex("000012 04 00 00000000 0003000003e8 000400400000 000500100000".replace(" ", ""))
SERVER_WINDOW = bytes.fromhex("000004 08 00 00000000 003f0001".replace(" ", ""))
SETTINGS_ACK = bytes.fromhex("000000 04 01 00000000".replace(" ", ""))
# The response's header blocks through the client's dynamic table, as grpc's own servers send them: `:status: 200`
# from the static table; the first response's headers insert the other two (its trailers, in the same write, are a
# literal never indexed), the next OK trailers insert the status, and from then on every one is named by its index.
HEAD_FIRST = b"\x88\x5f\x10application/grpc\x40\x14grpc-accept-encoding\x08identity"
OK_LITERAL = b"\x00\x0bgrpc-status\x010"
HEAD_THEN = b"\x88\xbf\xbe"  # 63 content-type, 62 grpc-accept-encoding
OK_FIRST = b"\x40\x0bgrpc-status\x010"
HEAD_INDEXED = b"\x88\xc0\xbf"  # 64 content-type, 63 grpc-accept-encoding
OK_INDEXED = b"\xbe"  # 62 grpc-status
# The same headers never indexed, once the client's HEADER_TABLE_SIZE setting went below the default.
HEAD_LITERAL = b"\x88\x0f\x10\x10application/grpc\x00\x14grpc-accept-encoding\x08identity"
RESPONSE_HEADERS = [
    (b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-accept-encoding", b"identity"),
]  # fmt: skip
OK_TRAILERS = [(b"grpc-status", b"0")]


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


def settings(**values: int) -> bytes:
    codes = {"HEADER_TABLE_SIZE": 1, "INITIAL_WINDOW_SIZE": 4, "MAX_FRAME_SIZE": 5}
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", codes[key], value) for key, value in values.items()))


class Peer:
    """A hand-driven HTTP/2 client: frames out, frames in."""

    def __init__(self, server: Server) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.grpc_port), timeout=30)
        self.buffer = b""
        self.encoder = Encoder()

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def read_exact(self, size: int) -> bytes:
        while len(self.buffer) < size:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError(f"the connection ended with {self.buffer!r} pending")
            self.buffer += chunk
        out, self.buffer = self.buffer[:size], self.buffer[size:]
        return out

    def frame(self) -> tuple[int, int, int, bytes]:
        head = self.read_exact(9)
        payload = self.read_exact(int.from_bytes(head[:3], "big"))
        return head[3], head[4], int.from_bytes(head[5:9], "big"), payload

    def frame_of(self, stream_id: int) -> tuple[int, int, bytes]:
        """The next frame on `stream_id`, skipping the connection's (SETTINGS ACK, WINDOW_UPDATE)."""
        while True:
            kind, flags, sid, payload = self.frame()
            if sid == stream_id:
                return kind, flags, payload

    def start(self, **values: int) -> None:
        self.send(PREFACE, settings(**values))
        assert self.read_exact(len(SERVER_SETTINGS) + len(SERVER_WINDOW)) == SERVER_SETTINGS + SERVER_WINDOW
        assert self.read_exact(len(SETTINGS_ACK)) == SETTINGS_ACK

    def request_block(self, method: str) -> bytes:
        return self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", f"{SERVICE}/{method}"),
                (":authority", "127.0.0.1"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
        )

    def goaway(self) -> tuple[int, int]:
        """The GOAWAY the server ends with (its last stream id and error code), then the end of the connection."""
        while True:
            kind, _, _, payload = self.frame()
            if kind == GOAWAY:
                break
        assert self.sock.recv(65536) == b""
        return int.from_bytes(payload[:4], "big"), int.from_bytes(payload[4:8], "big")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def peer(server: Server, caplog: pytest.LogCaptureFixture) -> Iterator[Peer]:
    opened = Peer(server)
    with caplog.at_level(logging.DEBUG, logger="carton.server"):
        yield opened
    opened.close()
    assert not [record for record in caplog.records if record.exc_info or record.levelno >= logging.WARNING]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert client.is_server_live()
    client.close()


def message(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def infer_request(x: np.ndarray) -> bytes:
    request = message_class("ModelInferRequest")(model_name="identity")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=list(x.shape))
    del tensor
    request.raw_input_contents.append(x.tobytes())
    return message(request.SerializeToString())


def test_settings_exchange_and_ping(peer: Peer) -> None:
    peer.start()
    peer.send(frame(PING, 0, 0, b"12345678"), frame(SETTINGS, 1, 0))  # and an ACK of the server's SETTINGS
    assert peer.read_exact(17) == frame(PING, 1, 0, b"12345678")


def test_a_unary_call_answered_exactly(peer: Peer) -> None:
    peer.start()
    peer.send(
        frame(HEADERS, END_HEADERS, 1, peer.request_block("ServerLive")),
        frame(DATA, END_STREAM, 1, message(b"")),
    )
    assert peer.frame_of(1) == (HEADERS, END_HEADERS, HEAD_FIRST)
    assert peer.frame_of(1) == (DATA, 0, message(b"\x08\x01"))  # ServerLiveResponse(live=True)
    assert peer.frame_of(1) == (HEADERS, END_HEADERS | END_STREAM, OK_LITERAL)


def _live_calls(peer: Peer, stream_ids: range) -> list[tuple[int, int, bytes]]:
    """ServerLive called on each of `stream_ids` in turn: the HEADERS frames answering each (flags and block)."""
    answers = []
    for stream_id in stream_ids:
        peer.send(
            frame(HEADERS, END_HEADERS, stream_id, peer.request_block("ServerLive")),
            frame(DATA, END_STREAM, stream_id, message(b"")),
        )
        head = peer.frame_of(stream_id)
        assert peer.frame_of(stream_id) == (DATA, 0, message(b"\x08\x01"))
        answers += [head, peer.frame_of(stream_id)]
    return answers


def test_response_header_blocks_go_through_the_clients_dynamic_table(peer: Peer) -> None:
    peer.start()
    answers = _live_calls(peer, range(1, 9, 2))
    blocks = [HEAD_FIRST, OK_LITERAL, HEAD_THEN, OK_FIRST, HEAD_INDEXED, OK_INDEXED, HEAD_INDEXED, OK_INDEXED]
    assert answers == [
        (HEADERS, END_HEADERS | (END_STREAM if index % 2 else 0), block) for index, block in enumerate(blocks)
    ]
    client = Decoder()  # the client's decoder, block after block in the order they came
    assert [client.decode(block, raw=True) for _, _, block in answers] == [RESPONSE_HEADERS, OK_TRAILERS] * 4
    # A client whose table size setting stays at the default or above changes nothing.
    peer.send(settings(HEADER_TABLE_SIZE=4096), settings(HEADER_TABLE_SIZE=1 << 16))
    assert [block for _, _, block in _live_calls(peer, range(9, 13, 2))] == [HEAD_INDEXED, OK_INDEXED] * 2


@pytest.mark.parametrize("calls_before", [0, 3])
def test_a_lowered_header_table_size_empties_the_table_and_blocks_insert_nothing(peer: Peer, calls_before: int) -> None:
    peer.start()
    client = Decoder()
    before = _live_calls(peer, range(1, 1 + 2 * calls_before, 2))
    assert [client.decode(block, raw=True) for _, _, block in before] == [RESPONSE_HEADERS, OK_TRAILERS] * calls_before
    peer.send(settings(HEADER_TABLE_SIZE=100))
    assert peer.frame_of(0) == (SETTINGS, 1, b"")  # the setting taken
    after = [block for _, _, block in _live_calls(peer, range(1 + 2 * calls_before, 7 + 2 * calls_before, 2))]
    # The next block starts with a size update to 0, then none inserts anything.
    assert after == [b"\x20" + HEAD_LITERAL, OK_LITERAL, HEAD_LITERAL, OK_LITERAL, HEAD_LITERAL, OK_LITERAL]
    client.max_allowed_table_size = 100
    assert [client.decode(block, raw=True) for block in after] == [RESPONSE_HEADERS, OK_TRAILERS] * 3
    assert client.header_table_size == 0 and len(client.header_table.dynamic_entries) == 0


def test_frames_split_across_reads_are_answered_exactly(peer: Peer) -> None:
    # Reads that end inside a frame's head, inside its payload, and between frames (the client's window updates as a
    # gRPC client sends them: its stream's after the request's headers, the connection's after its DATA).
    peer.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sent = PREFACE + settings()
    for stream_id in (1, 3):
        sent += frame(HEADERS, END_HEADERS, stream_id, peer.request_block("ServerLive"))
        sent += frame(WINDOW_UPDATE, 0, stream_id, (5).to_bytes(4, "big"))
        sent += frame(DATA, END_STREAM, stream_id, message(b""))
        sent += frame(WINDOW_UPDATE, 0, 0, (105).to_bytes(4, "big"))
    for at in range(0, len(sent), 7):
        peer.send(sent[at : at + 7])
        time.sleep(0.002)  # so that the server reads the pieces one by one
    assert peer.read_exact(len(SERVER_SETTINGS) + len(SERVER_WINDOW)) == SERVER_SETTINGS + SERVER_WINDOW
    for stream_id, head, trailers in ((1, HEAD_FIRST, OK_LITERAL), (3, HEAD_THEN, OK_FIRST)):
        assert peer.frame_of(stream_id) == (HEADERS, END_HEADERS, head)
        assert peer.frame_of(stream_id) == (DATA, 0, message(b"\x08\x01"))
        assert peer.frame_of(stream_id) == (HEADERS, END_HEADERS | END_STREAM, trailers)


@pytest.mark.parametrize(
    ("body", "status", "text"),
    [
        (b"\x00\x00\x00", b"3", b"ServerLive takes exactly one whole request message"),  # shorter than a prefix
        (message(b"") + b"\x00", b"3", b"ServerLive takes exactly one whole request message"),  # and a piece more
        (b"\x01" + message(b"")[1:], b"12", b"compressed messages are not supported (send identity)"),
    ],
    ids=["short", "one-and-a-piece", "compressed"],
)
def test_a_unary_body_that_is_not_one_plain_message_is_refused(
    peer: Peer, body: bytes, status: bytes, text: bytes
) -> None:
    peer.start()
    peer.send(frame(HEADERS, END_HEADERS, 1, peer.request_block("ServerLive")), frame(DATA, END_STREAM, 1, body))
    kind, flags, payload = peer.frame_of(1)
    assert (kind, flags) == (HEADERS, END_HEADERS | END_STREAM)  # trailers only
    headers = dict(Decoder().decode(payload, raw=True))
    assert (headers[b"grpc-status"], headers[b"grpc-message"]) == (status, text)


def test_window_updates_on_a_stream(peer: Peer) -> None:
    peer.start()
    # One of 0 is a stream error; one on a stream already answered is ignored; one past 2^31-1 is a stream error.
    peer.send(frame(HEADERS, END_HEADERS, 1, peer.request_block("ServerLive")))
    peer.send(frame(WINDOW_UPDATE, 0, 1, (0).to_bytes(4, "big")))
    assert peer.frame_of(1) == (RST_STREAM, 0, PROTOCOL_ERROR.to_bytes(4, "big"))
    peer.send(
        frame(HEADERS, END_HEADERS, 3, peer.request_block("ServerLive")),
        frame(DATA, END_STREAM, 3, message(b"")),
        frame(WINDOW_UPDATE, 0, 3, (1).to_bytes(4, "big")),
    )
    assert [peer.frame_of(3)[0] for _ in range(3)] == [HEADERS, DATA, HEADERS]
    peer.send(
        frame(HEADERS, END_HEADERS, 5, peer.request_block("ServerLive")),
        frame(WINDOW_UPDATE, 0, 5, (2**31 - 1).to_bytes(4, "big")),
    )
    assert peer.frame_of(5) == (RST_STREAM, 0, FLOW_CONTROL_ERROR.to_bytes(4, "big"))
    peer.send(
        frame(HEADERS, END_HEADERS, 7, peer.request_block("ServerLive")),
        frame(DATA, END_STREAM, 7, message(b"")),
    )
    assert [peer.frame_of(7)[0] for _ in range(3)] == [HEADERS, DATA, HEADERS]


def test_a_header_block_in_continuation_frames_with_padding_and_priority(peer: Peer) -> None:
    peer.start()
    block = peer.request_block("ServerReady")
    padded = bytes((3,)) + b"\x00\x00\x00\x00\x10" + block[:10] + b"\x00" * 3  # pad length, priority, fragment, pad
    peer.send(
        frame(HEADERS, PADDED | PRIORITY_FLAG, 1, padded),
        frame(CONTINUATION, 0, 1, block[10:20]),
        frame(CONTINUATION, END_HEADERS, 1, block[20:]),
        frame(PRIORITY, 0, 1, b"\x00\x00\x00\x00\x10"),  # ignored
        frame(0xFA, 0, 0, b"an extension frame"),  # ignored
        frame(DATA, PADDED | END_STREAM, 1, bytes((10,)) + message(b"") + b"\x00" * 10),
    )
    assert peer.frame_of(1) == (HEADERS, END_HEADERS, HEAD_FIRST)
    assert peer.frame_of(1) == (DATA, 0, message(b"\x08\x01"))
    assert peer.frame_of(1) == (HEADERS, END_HEADERS | END_STREAM, OK_LITERAL)


@pytest.mark.parametrize("window", [7, 6])
def test_a_small_response_within_the_window_goes_at_once_and_one_past_it_waits(peer: Peer, window: int) -> None:
    peer.start(INITIAL_WINDOW_SIZE=window)
    peer.send(
        frame(HEADERS, END_HEADERS, 1, peer.request_block("ServerLive")),
        frame(DATA, END_STREAM, 1, message(b"")),
    )
    data = message(b"\x08\x01")  # 7 bytes
    assert peer.frame_of(1) == (HEADERS, END_HEADERS, HEAD_FIRST)
    assert peer.frame_of(1) == (DATA, 0, data[:window])
    if window < len(data):
        peer.send(frame(WINDOW_UPDATE, 0, 1, (len(data) - window).to_bytes(4, "big")))
        assert peer.frame_of(1) == (DATA, 0, data[window:])
    # The trailers of a response that waited follow its headers' write: they insert the status.
    trailers = OK_LITERAL if window == len(data) else OK_FIRST
    assert peer.frame_of(1) == (HEADERS, END_HEADERS | END_STREAM, trailers)
    # The stream is closed: a WINDOW_UPDATE on it is ignored, and the next call is answered as the first.
    peer.send(frame(WINDOW_UPDATE, 0, 1, (100).to_bytes(4, "big")))
    peer.send(
        frame(HEADERS, END_HEADERS, 3, peer.request_block("ServerLive")),
        frame(DATA, END_STREAM, 3, message(b"")),
    )
    assert peer.frame_of(3) == (HEADERS, END_HEADERS, HEAD_THEN if trailers is OK_LITERAL else HEAD_INDEXED)
    assert peer.frame_of(3) == (DATA, 0, data[:window])


def _infer_frames(peer: Peer, x: np.ndarray) -> None:
    peer.send(
        frame(HEADERS, END_HEADERS, 1, peer.request_block("ModelInfer")),
        frame(DATA, END_STREAM, 1, infer_request(x)),
    )


def test_a_large_response_is_sent_as_the_clients_windows_open(peer: Peer) -> None:
    peer.start(INITIAL_WINDOW_SIZE=1000)
    x = np.arange(40_000, dtype=np.float32).reshape(1, 40_000)  # a response over the connection's 65535 bytes
    _infer_frames(peer, x)
    assert peer.frame_of(1) == (HEADERS, END_HEADERS, HEAD_FIRST)
    received = b""
    granted = 1000
    while granted < 65535:
        while len(received) < granted:
            kind, _, payload = peer.frame_of(1)
            assert kind == DATA
            received += payload
        assert len(received) == granted  # never past the stream's window
        peer.send(frame(WINDOW_UPDATE, 0, 1, (7000).to_bytes(4, "big")))
        granted += 7000
    while len(received) < 65535:  # the connection's window: the client's default, never raised
        kind, _, payload = peer.frame_of(1)
        assert kind == DATA
        received += payload
    assert len(received) == 65535
    # A larger INITIAL_WINDOW_SIZE opens the stream's window, the connection's WINDOW_UPDATE the connection's; the
    # rest comes in frames of the client's (default) MAX_FRAME_SIZE.
    peer.send(settings(INITIAL_WINDOW_SIZE=1 << 20), frame(WINDOW_UPDATE, 0, 0, (1 << 20).to_bytes(4, "big")))
    sizes = []
    while (answer := peer.frame_of(1))[0] == DATA:
        sizes.append(len(answer[2]))
        received += answer[2]
    assert answer == (HEADERS, END_HEADERS | END_STREAM, OK_FIRST)
    assert max(sizes) == 16384
    assert int.from_bytes(received[1:5], "big") == len(received) - 5
    response = message_class("ModelInferResponse").FromString(received[5:])
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.float32), x.ravel() * 2)


def test_a_client_that_leaves_mid_response_leaves_nothing_behind(peer: Peer) -> None:
    peer.start(INITIAL_WINDOW_SIZE=1000)
    _infer_frames(peer, np.zeros((1, 20_000), dtype=np.float32))
    assert peer.frame_of(1) == (HEADERS, END_HEADERS, HEAD_FIRST)
    assert peer.frame_of(1)[0] == DATA
    peer.close()  # the send waiting for window is cancelled; the fixture checks the log and that it still serves


def test_a_stream_past_the_concurrency_limit_is_refused(peer: Peer) -> None:
    peer.start()
    for stream_id in range(1, 2001, 2):  # 1000 requests whose bodies never come
        peer.send(frame(HEADERS, END_HEADERS, stream_id, peer.request_block("ModelInfer")))
    peer.send(frame(HEADERS, END_HEADERS, 2001, peer.request_block("ModelInfer")))
    assert peer.frame_of(2001) == (RST_STREAM, 0, REFUSED_STREAM.to_bytes(4, "big"))
    peer.send(frame(RST_STREAM, 0, 1, (8).to_bytes(4, "big")))  # CANCEL: one stream fewer, so the next is taken
    peer.send(frame(HEADERS, END_HEADERS, 2003, peer.request_block("ServerLive")), frame(DATA, 1, 2003, message(b"")))
    assert peer.frame_of(2003) == (HEADERS, END_HEADERS, HEAD_FIRST)


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"GET / HTTP/1.1\r\n\r\n"], PROTOCOL_ERROR),  # shorter than the preface: answered without waiting
        ([PREFACE, frame(PING, 0, 0, b"12345678")], PROTOCOL_ERROR),  # the first frame must be SETTINGS
        ([PREFACE, settings(), frame(HEADERS, END_HEADERS, 2, b"\x82")], PROTOCOL_ERROR),  # an even stream id
        ([PREFACE, settings(), (1024 * 1024 + 1).to_bytes(3, "big") + b"\x00\x00\x00\x00\x00\x01"], FRAME_SIZE_ERROR),
        ([PREFACE, settings(), frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\x0f")], COMPRESSION_ERROR),
        ([PREFACE, settings(), frame(PING, 0, 0, b"1234")], FRAME_SIZE_ERROR),
        ([PREFACE, settings(), frame(HEADERS, 0, 1, b"\x82"), frame(PING, 0, 0, b"12345678")], PROTOCOL_ERROR),
        ([PREFACE, settings(), frame(CONTINUATION, END_HEADERS, 1, b"\x82")], PROTOCOL_ERROR),
        ([PREFACE, settings(), frame(DATA, 0, 1, b"x")], PROTOCOL_ERROR),  # DATA on a stream never opened
        ([PREFACE, settings(MAX_FRAME_SIZE=100)], PROTOCOL_ERROR),
        ([PREFACE, settings(), frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01")], FRAME_SIZE_ERROR),
        ([PREFACE, settings(), frame(WINDOW_UPDATE, 0, 0, (0).to_bytes(4, "big"))], PROTOCOL_ERROR),
        ([PREFACE, settings(), frame(WINDOW_UPDATE, 0, 0, (2**31 - 1).to_bytes(4, "big"))], FLOW_CONTROL_ERROR),
        ([PREFACE, settings(), frame(WINDOW_UPDATE, 0, 1, (1).to_bytes(4, "big"))], PROTOCOL_ERROR),
    ],
    ids=[
        "not-the-preface",
        "no-settings-first",
        "even-stream-id",
        "oversized-frame",
        "garbage-hpack",
        "short-ping",
        "frame-inside-a-header-block",
        "stray-continuation",
        "data-on-an-idle-stream",
        "max-frame-size-too-small",
        "short-window-update",
        "window-update-of-zero",
        "connection-window-over-the-limit",
        "window-update-on-an-idle-stream",
    ],
)
def test_a_connection_error_is_a_goaway_with_its_code(peer: Peer, frames: list[bytes], code: int) -> None:
    peer.send(*frames)
    assert peer.goaway()[1] == code


def test_stream_ids_must_increase(peer: Peer) -> None:
    peer.start()
    peer.send(
        frame(HEADERS, END_HEADERS, 5, peer.request_block("ServerLive")),
        frame(DATA, END_STREAM, 5, message(b"")),
        frame(HEADERS, END_HEADERS, 3, peer.request_block("ServerLive")),
    )
    assert peer.goaway() == (5, PROTOCOL_ERROR)


def test_a_repeated_header_block_is_read_against_the_current_dynamic_table(peer: Peer) -> None:
    peer.start()
    mirror = Decoder()  # what the server's decoder holds, block for block
    first = peer.request_block("ServerLive")
    repeated = peer.request_block("ServerLive")  # the same headers, now as indexed fields only
    more = peer.encoder.encode([(":method", "POST"), ("x-extra", "1")])  # a new entry: every index moves by one
    before = [mirror.decode(block, raw=True) for block in (first, repeated, more)][1]
    assert mirror.decode(repeated, raw=True) != before
    for stream_id, block in ((1, first), (3, repeated), (5, more), (7, repeated)):
        peer.send(frame(HEADERS, END_HEADERS, stream_id, block), frame(DATA, END_STREAM, stream_id, message(b"")))
        kind, flags, _ = peer.frame_of(stream_id)
        # The ServerLive calls are answered with response headers; the other two are refused in one HEADERS frame.
        assert (kind, bool(flags & END_STREAM)) == (HEADERS, stream_id in (5, 7))


def test_a_call_past_its_deadline_is_answered_deadline_exceeded(peer: Peer) -> None:
    peer.start()
    # A streamed call whose client never sends a request: only its `grpc-timeout` can end it.
    block = peer.request_block("ModelStreamInfer") + peer.encoder.encode([("grpc-timeout", "50m")])
    peer.send(frame(HEADERS, END_HEADERS, 1, block))
    kind, flags, payload = peer.frame_of(1)
    assert (kind, flags) == (HEADERS, END_HEADERS | END_STREAM)  # trailers only: nothing was sent before
    headers = dict(Decoder().decode(payload, raw=True))
    assert headers[b"grpc-status"] == b"4" and headers[b"grpc-message"] == b"deadline exceeded"
    # A unary call with a deadline it meets is answered as any other, and its deadline ends with it.
    unary = peer.request_block("ServerLive") + peer.encoder.encode([("grpc-timeout", "50m")])
    peer.send(frame(HEADERS, END_HEADERS, 3, unary), frame(DATA, END_STREAM, 3, message(b"")))
    assert peer.frame_of(3) == (HEADERS, END_HEADERS, HEAD_FIRST)  # the trailers-only block inserted nothing
    assert peer.frame_of(3) == (DATA, 0, message(b"\x08\x01"))
    assert peer.frame_of(3) == (HEADERS, END_HEADERS | END_STREAM, OK_LITERAL)


def test_a_call_reset_in_the_same_read_as_its_request_is_cancelled_and_released(server: Server, peer: Peer) -> None:
    # A call runs up to its first suspension (inside the model) as its request is read, so the RST_STREAM that came
    # with it cancels a call already under way: it answers nothing, and releases the version it holds.
    (served,) = server.repository.versions("identity")
    failed = served.stats.fail.count
    peer.start()
    deadline = time.monotonic() + 30
    # The second time on the same connection, the call's coroutine is driven from a known layout (`RequestForms`).
    for cancelled, live in ((1, 3), (5, 7)):
        peer.send(
            frame(HEADERS, END_HEADERS, cancelled, peer.request_block("ModelInfer")),
            frame(DATA, END_STREAM, cancelled, infer_request(np.ones((1, 4), dtype=np.float32))),
            frame(RST_STREAM, 0, cancelled, (8).to_bytes(4, "big")),  # CANCEL
            frame(HEADERS, END_HEADERS, live, peer.request_block("ServerLive")),
            frame(DATA, END_STREAM, live, message(b"")),
        )
        frames = []
        while not frames or frames[-1] != (HEADERS, END_HEADERS | END_STREAM, live):
            kind, flags, stream_id, _ = peer.frame()
            frames.append((kind, flags, stream_id))
        assert [stream_id for _, _, stream_id in frames if stream_id] == [live, live, live]
        while served.in_flight or served.stats.fail.count == failed:
            assert time.monotonic() < deadline, f"the cancelled call on stream {cancelled} released its version"
            time.sleep(0.01)
        failed += 1
        assert served.stats.fail.count == failed and served.stats.series.in_flight == 0
