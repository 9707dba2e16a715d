"""Writing decoded pieces of a file on a helper thread while the caller decodes the next ones.

Decompression holds the GIL; ``write`` and SHA-256 release it. With the write (and the hash, when there is one) on
a second thread, extracting a zstd entry runs at the speed of the slower of the two sides instead of their sum, the
way ``zstd -d`` overlaps its reads and writes (docs/performance.md, "Package format"). The queue is short so
pieces are written while they are still in cache, and it bounds memory at ``_DEPTH`` pieces.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

__all__ = ["INLINE_BELOW", "Hasher", "write_all", "write_pieces"]

#: Below this many bytes a file is written inline: starting a thread costs more than the overlap saves.
INLINE_BELOW = 4 << 20
#: Pieces the decoder may run ahead of the writer.
_DEPTH = 4


class Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_pieces(
    fd: int,
    pieces: Iterable[bytes],
    *,
    size: int,
    hasher: Hasher | None = None,
    advance: Callable[[int], object] | None = None,
) -> None:
    """Write ``pieces`` to ``fd`` in order, feeding each to ``hasher`` just before it is written.

    ``size`` is the expected total (it picks inline or threaded writing). An error while producing pieces stops
    the writer and propagates; an error while writing (a full disk) stops production and propagates.
    """
    if size < INLINE_BELOW:
        for piece in pieces:
            if hasher is not None:
                hasher.update(piece)
            write_all(fd, piece)
            if advance is not None:
                advance(len(piece))
        return
    writer = _Writer(fd, hasher)
    try:
        for piece in pieces:
            writer.put(piece)
            if advance is not None:
                advance(len(piece))
    except BaseException:
        writer.stop()
        raise
    writer.finish()


class _Writer:
    def __init__(self, fd: int, hasher: Hasher | None) -> None:
        self._fd = fd
        self._hasher = hasher
        self._queue: queue.Queue[bytes] = queue.Queue(_DEPTH)
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="carton-extract-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while piece := self._queue.get():  # b"" ends the file
            if self._error is not None:
                continue  # failed: drain, so the producer never blocks on a full queue
            try:
                if self._hasher is not None:
                    self._hasher.update(piece)
                write_all(self._fd, piece)
            except BaseException as exc:  # handed to the producer's thread, which raises it
                self._error = exc

    def put(self, piece: bytes) -> None:
        if self._error is not None:
            raise self._error  # write_pieces stops the writer on the way out
        if piece:
            self._queue.put(piece)

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._queue.put(b"")
            self._thread.join()

    def finish(self) -> None:
        self.stop()
        if self._error is not None:
            raise self._error
