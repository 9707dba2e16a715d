"""`ShardedModel`: the parent's view of a decoder split across processes (see `_shards` for the split).

The parent is shard 0. For every forward step and every logits call it sends the command to its helpers, runs its
own shard, and meets them at the exchanges; helpers run the same steps on their shards and keep mirror kv caches
(holding their own heads), named by a key the parent gives each cache.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import mmap
import os
import select
import signal
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np
from carton.mcf import MCFError, UnsupportedModel
from carton_protocol import InvalidOption
from numpy.typing import NDArray

from ._config import DecoderConfig
from ._decoder import KVCache, chunked_prefill, pick_rows
from ._llama import LlamaModel
from ._shards import (
    Exchange,
    ShardFailed,
    ShardPlan,
    become_helper,
    describe_exit,
    exchange_floats,
    read_message,
    shared_block,
    write_message,
)

__all__ = ["F32", "I64", "BuildShard", "ShardedModel", "start_sharded"]

F32 = NDArray[np.float32]
I64 = NDArray[np.int64]
BuildShard = Callable[[ShardPlan, Callable[[F32], F32]], LlamaModel]

_READY, _FAILED, _FORWARD, _LOGITS, _FORGET, _STOP = range(6)
_FORWARD_HEAD = struct.Struct("<qqqq")  # cache key, batch, seq, cache capacity
_LOGITS_HEAD = struct.Struct("<qq")  # rows, hidden size
_KEY = struct.Struct("<q")
#: Errors a helper's build may raise that the parent re-raises as the same type (a bad tensor in its rows).
_KNOWN_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (MCFError, UnsupportedModel, InvalidOption, MemoryError)
}
_STOP_GRACE_S = 5.0


class ShardedModel:
    """A `Decoder` whose weights are split across this process and ``len(plans) - 1`` forked helpers."""

    def __init__(self, local: LlamaModel, plans: Sequence[ShardPlan], group: _Group) -> None:
        self.config: DecoderConfig = local.config
        self.processes = len(plans)
        self._local = local
        self._group = group
        self._widths = [plan.vocab_rows[1] - plan.vocab_rows[0] for plan in plans]
        self._keys: weakref.WeakKeyDictionary[KVCache, int] = weakref.WeakKeyDictionary()
        self._next_key = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def helper_pids(self) -> tuple[int, ...]:
        return tuple(self._group.pids)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        cache = self._local.new_cache(batch, capacity)
        key = next(self._next_key)
        self._keys[cache] = key
        weakref.finalize(cache, self._group.forgotten.append, key)
        return cache

    def forward(self, input_ids: I64, positions: I64, token_mask: NDArray[np.bool_], cache: KVCache) -> F32:
        key = self._keys.get(cache)
        if key is None:
            raise ValueError("a ShardedModel runs only on caches made by its new_cache()")
        batch, seq = input_ids.shape
        payload = b"".join(
            (
                _FORWARD_HEAD.pack(key, batch, seq, cache.capacity),
                np.ascontiguousarray(input_ids, dtype="<i8").tobytes(),
                np.ascontiguousarray(positions, dtype="<i8").tobytes(),
                np.ascontiguousarray(token_mask, dtype=np.uint8).tobytes(),
            )
        )
        with self._lock:
            self._group.send(_FORWARD, payload)
            return self._group.guard(lambda: self._local.forward(input_ids, positions, token_mask, cache))

    def prefill(
        self,
        input_ids: I64,
        positions: I64,
        token_mask: NDArray[np.bool_],
        cache: KVCache,
        *,
        chunk: int = 256,
        outputs: I64 | None = None,
    ) -> F32:
        """`LlamaModel.prefill`; with ``outputs`` every position is still computed (the helpers run whole chunks)
        and those rows picked."""
        hidden = chunked_prefill(self, input_ids, positions, token_mask, cache, chunk=chunk)
        return hidden if outputs is None else pick_rows(hidden, outputs)

    def logits(self, hidden: F32) -> F32:
        lead = hidden.shape[:-1]
        rows = np.ascontiguousarray(hidden, dtype="<f4").reshape(-1, hidden.shape[-1])
        with self._lock:
            self._group.send(_LOGITS, _LOGITS_HEAD.pack(*rows.shape) + rows.tobytes())
            exchange = self._group.exchange

            def run() -> F32:
                whole = exchange.gather(self._local.lm_head(rows), self._widths)
                assert whole is not None
                return whole

            return self._group.guard(run).reshape(*lead, -1)

    def close(self) -> None:
        self._group.stop()


class _Group:
    """The parent's handles on its helpers: pids, command pipes, failure pipes, and the shared exchange."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.commands: list[int] = []
        self.reports: list[int] = []
        self.forgotten: collections.deque[int] = collections.deque()
        self.exchange: Exchange
        self.broken: str | None = None
        self.exits: dict[int, int] = {}

    def check_alive(self) -> None:
        """Raise `ShardFailed` when a helper has exited or reported a failure."""
        for number, pid in enumerate(self.pids, start=1):
            if pid in self.exits:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.exits[pid] = status
                self._fail(f"shard process {number} (pid {pid}) {describe_exit(status)}{self._report(number)}")
        failed = self.exchange.failed_peers()
        if failed:
            self._fail(f"shard process {failed[0]} failed{self._report(failed[0])}")

    def _report(self, number: int) -> str:
        message = _poll_message(self.reports[number - 1])
        return f": {message}" if message else ""

    def _fail(self, message: str) -> None:
        self.broken = message
        self.kill()
        raise ShardFailed(f"mcf runner: {message}; load the model again")

    def send(self, kind: int, payload: bytes) -> None:
        if self.broken is not None:
            raise ShardFailed(f"mcf runner: {self.broken}; load the model again")
        try:
            while self.forgotten:
                key = self.forgotten.popleft()
                for fd in self.commands:
                    write_message(fd, _FORGET, _KEY.pack(key))
            for fd in self.commands:
                write_message(fd, kind, payload)
        except OSError:  # a helper's end of the pipe is gone: it died
            self.check_alive()
            self._fail("a shard process stopped reading its commands")

    def guard(self, work: Callable[[], F32]) -> F32:
        """Run this shard's part; a failure here leaves the helpers waiting at an exchange, so stop them."""
        try:
            return work()
        except ShardFailed:
            raise
        except BaseException:
            self.broken = "this shard failed during a step"
            self.kill()
            raise

    def kill(self) -> None:
        for pid in self.pids:
            if pid not in self.exits:
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.exits[pid] = os.waitpid(pid, 0)[1]
                except (ProcessLookupError, ChildProcessError):
                    self.exits.setdefault(pid, 0)
        self._close_pipes()

    def stop(self) -> None:
        """Ask every helper to exit; kill the ones that do not within a few seconds."""
        if self.broken is None:
            for fd in self.commands:
                with contextlib.suppress(OSError):
                    write_message(fd, _STOP)
        self._close_pipes()
        deadline = time.monotonic() + _STOP_GRACE_S
        for pid in self.pids:
            while pid not in self.exits and time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.exits[pid] = status
                else:
                    time.sleep(0.005)
        self.kill()
        self.broken = self.broken or "the model was closed"

    def _close_pipes(self) -> None:
        for fd in (*self.commands, *self.reports):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.commands, self.reports = [], []


def _poll_message(fd: int) -> str:
    """A helper's failure report, if it wrote one before exiting (never blocks on a live helper)."""
    try:
        if not select.select([fd], [], [], 0)[0]:
            return ""
        message = read_message(fd)
    except OSError:
        return ""
    return message[1].decode("utf-8", "replace") if message else ""


def start_sharded(plans: Sequence[ShardPlan], config: DecoderConfig, build: BuildShard) -> ShardedModel:
    """Fork a helper per plan after the first, have each build its shard, build shard 0 here; wait until all are
    ready (a helper's build error is raised here, as the same type when it is one of the runner's own)."""
    count = len(plans)
    slot_floats = exchange_floats(config, plans)
    block = shared_block(count, slot_floats)
    group = _Group()
    parent = os.getpid()
    for plan in plans[1:]:
        command_read, command_write = os.pipe()
        report_read, report_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the helper, which leaves through os._exit
            widths = [p.vocab_rows[1] - p.vocab_rows[0] for p in plans]
            _helper_main(plan, widths, build, block, slot_floats, parent, command_read, report_write)
        os.close(command_read)
        os.close(report_write)
        group.pids.append(pid)
        group.commands.append(command_write)
        group.reports.append(report_read)
    group.exchange = Exchange(block, count=count, index=0, slot_floats=slot_floats, alive=group.check_alive)
    try:
        local = build(plans[0], group.exchange.allreduce)
        for number, fd in enumerate(group.reports, start=1):
            _wait_ready(group, number, fd)
    except BaseException:
        group.kill()
        raise
    return ShardedModel(local, plans, group)


def _wait_ready(group: _Group, number: int, fd: int) -> None:
    message = read_message(fd)
    if message is not None and message[0] == _READY:
        return
    pid = group.pids[number - 1]
    status = os.waitpid(pid, 0)[1]
    group.exits[pid] = status
    if message is None:
        raise ShardFailed(f"mcf runner: shard process {number} (pid {pid}) {describe_exit(status)} while loading")
    kind_name, _, text = message[1].decode("utf-8", "replace").partition("\n")
    error_type = _KNOWN_ERRORS.get(kind_name)
    if error_type is not None:
        raise error_type(text)
    raise ShardFailed(f"mcf runner: shard process {number} failed while loading: {kind_name}: {text}")


def _helper_main(
    plan: ShardPlan,
    widths: list[int],
    build: BuildShard,
    block: mmap.mmap,
    slot_floats: int,
    parent: int,
    commands: int,
    reports: int,
) -> None:  # pragma: no cover - runs in the helper
    status = 1
    try:
        become_helper(parent, keep=(commands, reports))

        def parent_alive() -> None:
            if os.getppid() != parent or exchange.failed_peers():
                os._exit(1)

        exchange = Exchange(block, count=plan.count, index=plan.index, slot_floats=slot_floats, alive=parent_alive)
        try:
            model = build(plan, exchange.allreduce)
        except BaseException as exc:
            write_message(reports, _FAILED, f"{type(exc).__name__}\n{exc}".encode())
            os._exit(1)
        write_message(reports, _READY)
        status = _serve(model, exchange, widths, commands, reports)
    finally:
        os._exit(status)


def _serve(
    model: LlamaModel, exchange: Exchange, widths: list[int], commands: int, reports: int
) -> int:  # pragma: no cover - runs in the helper
    caches: dict[int, KVCache] = {}
    try:
        while True:
            message = read_message(commands)
            if message is None or message[0] == _STOP:
                return 0
            kind, payload = message
            if kind == _FORGET:
                caches.pop(_KEY.unpack(payload)[0], None)
            elif kind == _FORWARD:
                key, batch, seq, capacity = _FORWARD_HEAD.unpack_from(payload)
                count = batch * seq
                arrays = np.frombuffer(payload, dtype="<i8", count=2 * count, offset=_FORWARD_HEAD.size)
                ids, positions = arrays[:count].reshape(batch, seq), arrays[count:].reshape(batch, seq)
                mask = np.frombuffer(payload, dtype=np.uint8, offset=_FORWARD_HEAD.size + 16 * count).astype(bool)
                cache = caches.get(key)
                if cache is None:
                    cache = caches[key] = model.new_cache(batch, capacity)
                model.forward(ids, positions, mask.reshape(batch, seq), cache)
            elif kind == _LOGITS:
                rows, width = _LOGITS_HEAD.unpack_from(payload)
                hidden = np.frombuffer(payload, dtype="<f4", offset=_LOGITS_HEAD.size).reshape(rows, width)
                exchange.gather(model.lm_head(hidden), widths)
    except BaseException as exc:
        exchange.mark_failed()
        with contextlib.suppress(OSError):
            write_message(reports, _FAILED, f"{type(exc).__name__}: {exc}".encode())
        return 1
