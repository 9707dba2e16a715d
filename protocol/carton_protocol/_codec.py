"""One codec per connection end: messages to frames and frames to messages, hiding templates and shared memory.

`HostCodec` (the host's end: sends requests, reads replies) and `RunnerCodec` (the runner's end) share everything but
their direction. A caller hands a codec typed messages and tensors and gets back frames to send, or the reverse; it
never sees which of the two paths a message took:

* **header templates** (`carton_protocol._templates`): a plain infer whose layout was seen before is encoded as a
  cached tail after its id, and decoded by a cached plan when its header bytes match one accepted before;
* **the full path**: msgspec encodes and decodes the header (`carton_protocol._messages`), `_framing` the tensors.

Shared memory lives here too: the codec owns this side's segment pool (large tensors are written into its
segments) and the mappings of the peer's segments (large tensors are read from them). Every message may carry
``drop``, the ids of segments its sender no longer uses: the codec attaches them to what it encodes and unmaps
them from what it decodes, in `_Codec.encode` and `_Codec.decode` alone.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import msgspec
import numpy as np

from ._framing import decode_tensors, encode_tensors, shared_segments
from ._limits import DEFAULT_LIMITS, WireLimits
from ._messages import (
    PROTOCOL_VERSION,
    Hello,
    Infer,
    InferReply,
    Load,
    Pack,
    PackReply,
    Release,
    Reply,
    Request,
    check_opts,
    check_specs,
    decode_reply,
    decode_request,
    encode,
    peer_protocol,
)
from ._runner import Tensor
from ._shm import SHM_AVAILABLE, FdChannel, PeerSegments, Segment, SegmentPool
from ._templates import PACK_U32, REPLY_PREFIX, Layout, Plan, Templates, pack_id
from ._zmqio import COPY_BELOW
from .errors import FrameError, VersionMismatch

__all__ = ["HostCodec", "Outgoing", "Received", "RunnerCodec"]

# Larger than any tensor: what the threshold is when this connection has no shared memory.
_NEVER = 1 << 62


def _protocol_of(data: bytes, limits: WireLimits) -> int | None:
    try:
        remote = peer_protocol(data, limits)
    except FrameError:
        return None
    return remote if type(remote) is int else None


# Received and Outgoing are made on every call: msgspec structs are built in C, several times faster than a Python
# __init__ (docs/performance.md, "Wire protocol").
class Received(msgspec.Struct, gc=False):
    """A decoded message and its data frames. Read the tensors of an ``infer`` with the codec's `tensors`."""

    message: Any
    frames: list[Any]
    plan: Plan | None
    data: bytes


class Outgoing(msgspec.Struct, gc=False):
    """A message ready to send: its parts (header bytes, then data frames) and its request id. Call `done` once the
    peer has answered it (or will never read it): that frees the shared-memory segment it filled, if any."""

    id: int
    parts: list[Any]
    segment: Segment | None = None
    pool: SegmentPool | None = None
    #: Every part is under `COPY_BELOW` bytes: `send_copied` may send them, without `send_message`'s look at each.
    copied: bool = False

    def done(self) -> None:
        segment, self.segment = self.segment, None
        if segment is not None and self.pool is not None:
            self.pool.release(segment.id)


class _Codec:
    """What both ends share. `_infer` is the infer message this end sends, `_peer_infer` the one it reads."""

    _infer: type[Infer] | type[InferReply]
    _peer_infer: type[Infer] | type[InferReply]

    def __init__(self, limits: WireLimits, *, copy_shared: bool) -> None:
        self.limits = limits
        self._copy_shared = copy_shared
        self._templates = Templates(limits=limits, sends=self._infer)
        #: `match` of the header frame's bytes (``frame.bytes``), bound to the templates: one Python call fewer on the
        #: path every message takes.
        self.match_bytes: Callable[[bytes], tuple[int, Plan] | None] = self._templates.match
        self._channel: FdChannel | None = None
        self._pool: SegmentPool | None = None
        self._peer: PeerSegments | None = None
        self._threshold = _NEVER
        # A header template's tensors are all under the threshold: when it is no larger than `COPY_BELOW`, every part
        # of its message is copied on send (`Outgoing.copied`; a header is far smaller).
        self._inline_copied = False

    def _use_shared_memory(self, channel: FdChannel, threshold: int, *, prefix: str, writable: bool) -> None:
        self._channel = channel
        self._threshold = threshold
        self._inline_copied = threshold <= COPY_BELOW
        self._pool = SegmentPool(prefix, channel)
        self._peer = PeerSegments(channel, writable=writable, max_segments=self.limits.max_segments)

    # --- sending ---------------------------------------------------------------------------------------------
    def encode(self, message: Request | Reply) -> bytes:
        """The header bytes of `message`, telling the peer about segments this side dropped since the last one."""
        pool = self._pool
        if pool is not None and pool.dropped:
            dropped = pool.take_dropped()
            if dropped:
                message = msgspec.structs.replace(message, drop=(*message.drop, *dropped))
        return encode(message)

    def encode_tensors(
        self, request_id: int, tensors: Mapping[str, Tensor], layout_key: Hashable | None = None
    ) -> Outgoing:
        """An infer message carrying `tensors`; `FrameError` naming a tensor the wire cannot carry. `layout_key`
        (optional) stands for `tensors`' layout, as `encode_inline` says."""
        outgoing = self.encode_inline(request_id, tensors, layout_key)
        return outgoing if outgoing is not None else self.encode_full(request_id, tensors)

    def encode_full(self, request_id: int, tensors: Mapping[str, Tensor]) -> Outgoing:
        """`encode_tensors` without trying the template first: for a caller whose `encode_inline` just gave None."""
        pool = self._pool
        encoded = encode_tensors(tensors, pool=pool, threshold=self._threshold)
        try:
            data = self.encode(self._infer(id=request_id, tensors=encoded.entries))
        except BaseException:
            if encoded.segment is not None and pool is not None:
                pool.release(encoded.segment.id)
            raise
        return Outgoing(request_id, [data, *encoded.frames], encoded.segment, pool)

    def encode_inline(
        self, request_id: int, tensors: Mapping[str, Tensor], layout_key: Hashable | None = None
    ) -> Outgoing | None:
        """The infer message carrying `tensors` when it is quick to make and copies nothing into shared memory (every
        tensor a small plain array, in a layout sent before), else None (`encode_tensors` makes it then).

        `layout_key`, when given, is a hashable object that stands for the layout of `tensors`: the caller vouches
        that they are plain numpy arrays and that the same key always comes with the same names, dtypes and shapes,
        in the same order. It spares building and hashing that layout once more."""
        pool = self._pool
        if pool is None or not pool.dropped:
            parts = self._templates.encode(request_id, tensors, self._threshold, layout_key)
            if parts is not None:
                return Outgoing(request_id, parts, None, None, self._inline_copied)
        return None

    # --- receiving -------------------------------------------------------------------------------------------
    def match(self, header: Any) -> tuple[int, Plan] | None:
        """(id, plan) when the header frame `header` is a plain infer message in a layout accepted before, else None
        (`decode` reads it then). Its tensors are ``plan.decode(data frames)``: nothing else of the message is made,
        for the path every call takes."""
        return self._templates.match(header.bytes)

    def _decode_header(self, data: bytes) -> Any:
        raise NotImplementedError

    def decode(self, frames: list[Any], first: int = 0) -> Received:
        """The message in `frames` from index `first` (the header frame, then data frames); `FrameError` if it
        cannot be read."""
        data: bytes = frames[first].bytes
        matched = self._templates.match(data)
        if matched is not None:
            return Received(self._peer_infer(id=matched[0], tensors=()), frames[first + 1 :], matched[1], data)
        message = self._decode_header(data)
        if message.drop and self._peer is not None:
            self._peer.drop(message.drop)
        return Received(message, frames[first + 1 :], None, data)

    def tensors(self, received: Received, *, copy_shared: bool | None = None) -> dict[str, Tensor]:
        """The tensors of a received infer message; `FrameError` naming the tensor and the rule it breaks.
        `copy_shared` (default: this end's own rule, `HostCodec` copies) says whether arrays in the peer's shared
        memory are copied out or are views of it, valid until the peer reuses that memory."""
        plan = received.plan
        if plan is not None:
            return plan.decode(received.frames)
        message = received.message
        buffers = [frame.buffer for frame in received.frames]
        copy = self._copy_shared if copy_shared is None else copy_shared
        tensors, _ = decode_tensors(message.tensors, buffers, limits=self.limits, peer=self._peer, copy_shared=copy)
        self._templates.learn(received.data, message)
        return tensors

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._peer is not None:
            self._peer.close()
        if self._channel is not None:
            self._channel.close()


class HostCodec(_Codec):
    """The host's end of one runner connection; thread-safe.

    With `shm_threshold` (and a kernel that has sealed memfds) tensors of at least that many bytes travel in shared
    memory: the codec makes the descriptor channel, whose runner end (`runner_fd`) the runner process inherits.
    """

    _infer = Infer
    _peer_infer = InferReply

    def __init__(self, *, limits: WireLimits = DEFAULT_LIMITS, shm_threshold: int | None) -> None:
        super().__init__(limits, copy_shared=True)
        self._runner_end: socket.socket | None = None
        self.shm_threshold: int | None = None
        if shm_threshold is not None and SHM_AVAILABLE:
            host_end, runner_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            runner_end.set_inheritable(True)
            self._runner_end = runner_end
            self.shm_threshold = shm_threshold
            self._use_shared_memory(FdChannel(host_end), shm_threshold, prefix="h", writable=False)

    @property
    def runner_fd(self) -> int | None:
        """The descriptor the runner process must inherit (``--fd``), or ``None`` without shared memory."""
        return self._runner_end.fileno() if self._runner_end is not None else None

    def started(self) -> None:
        """The runner process has inherited `runner_fd` (or failed to start): close this process's copy."""
        end, self._runner_end = self._runner_end, None
        if end is not None:
            end.close()

    def copied_bytes(self, tensors: Mapping[str, Tensor]) -> int:
        """How many bytes sending `tensors` copies into shared memory (outputs of their size are copied out too):
        0 when this connection has none. Large copies are worth running off an event loop."""
        if self._pool is None:
            return 0
        return sum(value.nbytes for value in tensors.values() if type(value) is np.ndarray)

    def hello(self, *, host_pid: int) -> Hello:
        """The first request: this side's protocol version, and whether (from what size) to use shared memory."""
        return Hello(id=1, protocol=PROTOCOL_VERSION, host_pid=host_pid, shm_threshold=self.shm_threshold)

    def _decode_header(self, data: bytes) -> Reply:
        try:
            reply = decode_reply(data, self.limits)
        except FrameError:
            # A runner of another protocol version may lay its replies out differently: say so, if it says so.
            remote = _protocol_of(data, self.limits)
            if remote is not None and remote != PROTOCOL_VERSION:
                raise VersionMismatch(
                    f"host speaks carton protocol {PROTOCOL_VERSION}, the runner speaks {remote}",
                    local=PROTOCOL_VERSION,
                    remote=remote,
                ) from None
            raise
        if isinstance(reply, PackReply):
            check_opts(reply.opts, "pack opts")
            check_specs(reply.inputs, "pack inputs", self.limits)
            check_specs(reply.outputs, "pack outputs", self.limits)
        return reply

    def release(self, received: Received, next_id: Callable[[], int]) -> bytes | None:
        """The ``release`` request (numbered by `next_id`) for the runner segments `received` read its tensors from,
        or ``None`` when there are none: the runner reuses them once it arrives. Also right for a reply nobody reads
        (a cancelled call's)."""
        message = received.message
        if received.plan is not None or not isinstance(message, InferReply):
            return None
        used = shared_segments(message.tensors)
        if not used:
            return None
        return self.encode(Release(id=next_id(), segments=tuple(used)))

    def close(self) -> None:
        self.started()
        super().close()


class RunnerCodec(_Codec):
    """The runner's end: decodes requests, encodes replies. Shared memory starts with a `hello` that asks for it."""

    _infer = InferReply
    _peer_infer = Infer

    def __init__(self, *, limits: WireLimits = DEFAULT_LIMITS, channel: FdChannel | None) -> None:
        super().__init__(limits, copy_shared=False)
        self._offered = channel
        # The last reply layout `reply` encoded from a template (each tensor's name, dtype and shape, and the header
        # bytes after the id): a model answers in one layout again and again, and comparing with the last one costs
        # less than building and hashing the layout key for the templates' lookup.
        self._last_reply: tuple[Layout, bytes] | None = None
        #: Bound to `Templates.learnt`, for the runner loop's own match of the last request layout.
        self.learnt_request = self._templates.learnt

    def accept(self, hello: Hello) -> None:
        """Use shared memory from ``hello.shm_threshold`` bytes, when the host asks for it and gave a channel."""
        threshold = hello.shm_threshold
        if self._offered is not None and threshold is not None and threshold > 0 and self._pool is None:
            self._use_shared_memory(self._offered, threshold, prefix="r", writable=True)

    def _decode_header(self, data: bytes) -> Request:
        request = decode_request(data, self.limits)
        if isinstance(request, Load | Pack):
            what = "load" if isinstance(request, Load) else "pack"
            check_opts(request.opts, f"{what} opts")
            check_specs(request.inputs, f"{what} inputs", self.limits)
            check_specs(request.outputs, f"{what} outputs", self.limits)
        return request

    def reply(self, request_id: int, tensors: Mapping[str, Tensor]) -> list[Any]:
        """The parts of the infer reply carrying `tensors` (`encode_tensors`'s, without the `Outgoing`: the host
        releases a reply's segment, not this side)."""
        return self.encode_reply(request_id, tensors)[0]

    def encode_reply(self, request_id: int, tensors: Mapping[str, Tensor]) -> tuple[list[Any], bool]:
        """`reply`'s parts, and whether every part is to be copied on send (`send_copied`, as `Outgoing.copied`
        says): the runner loop's every reply. Pool threads call it concurrently: the last layout is one tuple, read
        and replaced whole."""
        pool = self._pool
        if pool is None or not pool.dropped:
            last = self._last_reply
            if last is not None and len(tensors) == len(last[0]):
                # The dtype by identity: numpy's built-in dtypes are single objects; another one takes the templates'
                # lookup. One output (most models) is compared without the loop's iterators.
                layout, tail = last
                if len(layout) == 1:
                    ((name, value),) = tensors.items()
                    known_name, known_dtype, known_shape = layout[0]
                    if (
                        type(value) is np.ndarray
                        and value.dtype is known_dtype
                        and value.shape == known_shape
                        and name == known_name
                        and value.flags.c_contiguous
                    ):
                        # `pack_id`'s usual case written out, as in `Templates.encode`.
                        packed = (
                            PACK_U32.pack(0xCE, request_id) if 1 << 16 <= request_id < 1 << 32 else pack_id(request_id)
                        )
                        return [REPLY_PREFIX + packed + tail, value], self._inline_copied
                else:
                    for (name, value), (known_name, known_dtype, known_shape) in zip(tensors.items(), layout):  # noqa: B905
                        if (
                            type(value) is not np.ndarray
                            or value.dtype is not known_dtype
                            or value.shape != known_shape
                            or name != known_name
                            or not value.flags.c_contiguous
                        ):
                            break
                    else:
                        return [REPLY_PREFIX + pack_id(request_id) + tail, *tensors.values()], self._inline_copied
            parts = self._templates.encode(request_id, tensors, self._threshold)
            if parts is not None:
                # The template took every tensor as an array: its parts after the header are those arrays.
                layout = tuple((name, array.dtype, array.shape) for name, array in zip(tensors, parts[1:]))  # noqa: B905
                self._last_reply = (layout, parts[0][len(REPLY_PREFIX) + len(pack_id(request_id)) :])
                return parts, self._inline_copied
        return self.encode_full(request_id, tensors).parts, False

    def release(self, segment_ids: tuple[str, ...]) -> None:
        """The host has read these reply segments: they may be reused (ids this side never lent are ignored)."""
        if self._pool is not None:
            for segment_id in segment_ids:
                self._pool.release(segment_id)

    def close(self) -> None:
        super().close()
        if self._offered is not None and self._channel is None:
            with contextlib.suppress(OSError):
                self._offered.close()
