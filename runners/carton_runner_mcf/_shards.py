"""One model in several processes: how the weights are split, and how the processes add up their partial sums.

Decode is a long chain of small matrix-vector products; two threads of one interpreter take turns holding the GIL
between numpy calls and end up slower than one (bench/bench_mcf_split.py), while two processes each run at full
speed. So the runner option ``processes = N`` splits every layer across N processes the way tensor parallelism
does (Megatron-LM's split of a transformer layer):

- shard i holds the kv heads ``kv_heads`` with their query heads: those rows of q, k and v, the matching columns
  of o. Attention is local to the shard (its kv cache holds only its heads);
- MLP rows ``mlp_rows``: those rows of gate and up, the matching columns of down. A shard with more kv heads gets
  fewer MLP rows, so every shard holds about as many weights as the others;
- head rows ``vocab_rows``.

o and down give partial sums, added up across the shards twice a layer (`Exchange.allreduce`); the parent gathers
the head's logits (`Exchange.gather`). Every shard sums the parts in the same order, so all carry bit-identical
hidden states. The exchanges go through one shared memory block: each process writes its part in its own slot,
then publishes a counter; readers spin on the counters (a decode step has about 60 exchanges, so a sleep or a pipe
wake-up each time would cost more than the split saves). Slots alternate between two sets, so a process can write
exchange n + 1 while a slower one still reads exchange n.

The parent forks its helpers after reading config.json and before building any weight, so each holds only its
shard; commands (run a forward step, compute logits, forget a cache) go to them over pipes as a header and raw
little-endian arrays.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import signal
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from carton_protocol import InvalidOption
from numpy.typing import NDArray

from ._config import DecoderConfig

__all__ = [
    "F32",
    "Exchange",
    "ShardFailed",
    "ShardPlan",
    "become_helper",
    "check_processes_supported",
    "describe_exit",
    "exchange_floats",
    "plan_shards",
    "read_exact",
    "read_message",
    "shared_block",
    "write_message",
]

F32 = NDArray[np.float32]

#: MLP rows move between shards in whole quantization blocks (down's columns).
_ROW_STEP = 32
#: Floats each process may put in one exchange; larger transfers go in several (a prefill chunk of 256 tokens of
#: SmolLM2's 576-wide hidden state fits in one).
_SLOT_FLOATS = 1 << 18
#: Per-process control words, a cache line apart: the exchange counter, then the failure flag.
_CONTROL_WORDS = 8
_COUNTER, _FAILED = 0, 1
#: Spins between liveness checks, and spins after which a waiter starts yielding its core.
_CHECK_EVERY = 256
_YIELD_AFTER = 20_000


class ShardFailed(RuntimeError):
    """A shard process died or failed; the model cannot run until it is loaded again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPlan:
    """What shard ``index`` of ``count`` holds: half-open ranges of kv heads, MLP rows and head (vocabulary) rows."""

    index: int
    count: int
    kv_heads: tuple[int, int]
    mlp_rows: tuple[int, int]
    vocab_rows: tuple[int, int]


def check_processes_supported(processes: int) -> None:
    """Shards synchronise through plain loads and stores in shared memory, which x86-64 keeps in order (a store of
    data before its counter is seen in that order); other architectures would need fences numpy does not offer."""
    if processes == 1:
        return
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in ("x86_64", "amd64"):
        raise InvalidOption(
            f"runner option processes={processes} needs Linux on x86-64 (this is {sys.platform} on {machine})",
            option="processes",
        )


def plan_shards(config: DecoderConfig, count: int) -> tuple[ShardPlan, ...]:
    """Split a decoder across ``count`` processes (an `InvalidOption` naming the limit when it cannot be)."""
    kv, groups = config.num_kv_heads, config.num_heads // config.num_kv_heads
    if count > kv:
        raise InvalidOption(
            f"runner option processes={count}: the model has {kv} kv head(s) and every process needs at least one",
            option="processes",
        )
    if count > 1 and groups * config.head_dim % _ROW_STEP:
        raise InvalidOption(
            f"runner option processes={count}: a kv head's query heads span {groups * config.head_dim} values of "
            f"the attention output, not a multiple of {_ROW_STEP}, so o_proj cannot be split between processes",
            option="processes",
        )
    inter = config.intermediate_size
    if inter < _ROW_STEP * count:
        raise InvalidOption(
            f"runner option processes={count}: intermediate_size {inter} is too small to give every process "
            f"{_ROW_STEP} MLP rows",
            option="processes",
        )
    kv_bounds = [kv * i // count for i in range(count + 1)]
    attention_per_kv_head = config.head_dim * config.hidden_size * (2 * groups + 2)
    mlp_per_row = 3 * config.hidden_size
    total = kv * attention_per_kv_head + inter * mlp_per_row
    mlp_bounds = [0]
    for i in range(1, count):
        # Rows before shard i's end such that shards 0..i-1 hold i/count of all weights, in whole blocks.
        wanted = (total * i / count - kv_bounds[i] * attention_per_kv_head) / mlp_per_row
        rows = round(wanted / _ROW_STEP) * _ROW_STEP
        rows = min(max(rows, mlp_bounds[-1] + _ROW_STEP), inter - _ROW_STEP * (count - i))
        mlp_bounds.append(rows)
    mlp_bounds.append(inter)
    vocab = config.vocab_size
    return tuple(
        ShardPlan(
            index=i,
            count=count,
            kv_heads=(kv_bounds[i], kv_bounds[i + 1]),
            mlp_rows=(mlp_bounds[i], mlp_bounds[i + 1]),
            vocab_rows=(vocab * i // count, vocab * (i + 1) // count),
        )
        for i in range(count)
    )


def exchange_floats(config: DecoderConfig, plans: Sequence[ShardPlan]) -> int:
    """Slot size: room for a prefill chunk's hidden states and at least one row of every shard's logits."""
    widest = max(plan.vocab_rows[1] - plan.vocab_rows[0] for plan in plans)
    return max(_SLOT_FLOATS, config.hidden_size, widest)


def shared_block(count: int, slot_floats: int) -> mmap.mmap:
    """Anonymous shared memory (inherited across fork): control words, then two sets of ``count`` slots."""
    control = mmap.PAGESIZE
    return mmap.mmap(-1, control + 2 * count * slot_floats * 4)


class Exchange:
    """Shard ``index``'s side of the shared block.

    ``alive()`` is called every few hundred spins of a wait and raises `ShardFailed` when a peer is gone.
    """

    def __init__(
        self, block: mmap.mmap, *, count: int, index: int, slot_floats: int, alive: Callable[[], None]
    ) -> None:
        self.count, self.index, self.slot_floats = count, index, slot_floats
        self._alive = alive
        self._control = np.frombuffer(block, dtype=np.int64, count=count * _CONTROL_WORDS)
        # A memoryview reads one counter in ~40 ns, a numpy scalar read costs several times that.
        self._words = memoryview(block).cast("q")
        self._slots = np.frombuffer(block, dtype=np.float32, offset=mmap.PAGESIZE).reshape(2, count, slot_floats)
        self._others = [j * _CONTROL_WORDS + _COUNTER for j in range(count) if j != index]
        self._posted = 0

    def failed_peers(self) -> list[int]:
        return [j for j in range(self.count) if j != self.index and self._words[j * _CONTROL_WORDS + _FAILED]]

    def mark_failed(self) -> None:
        self._words[self.index * _CONTROL_WORDS + _FAILED] = 1

    def _wait(self, n: int) -> None:
        """Until every other shard has posted exchange ``n``."""
        words, others = self._words, self._others
        spins = 0
        while True:
            for word in others:
                if words[word] < n:
                    break
            else:
                return
            spins += 1
            if spins % _CHECK_EVERY == 0:
                self._alive()
                if spins > _YIELD_AFTER:
                    time.sleep(0)

    def _post(self, data: F32 | None) -> int:
        """Write ``data`` (flat, at most a slot) to this shard's next slot and publish it; returns its number."""
        n = self._posted + 1
        # The slot was last used by exchange n - 2; every peer has read it once it has posted n - 1.
        self._wait(n - 1)
        if data is not None:
            self._slots[n % 2, self.index, : data.size] = data
        self._posted = n
        self._words[self.index * _CONTROL_WORDS + _COUNTER] = n
        return n

    def allreduce(self, part: F32) -> F32:
        """The sum of every shard's ``part`` (same shape everywhere), added in shard order on every shard."""
        flat = np.ascontiguousarray(part, dtype=np.float32).reshape(-1)
        total = np.empty_like(flat)
        for start in range(0, flat.size, self.slot_floats):
            chunk = flat[start : start + self.slot_floats]
            n = self._post(chunk)
            self._wait(n)
            slots = self._slots[n % 2, :, : chunk.size]
            out = total[start : start + chunk.size]
            np.copyto(out, slots[0])
            for j in range(1, self.count):
                out += slots[j]
        return total.reshape(part.shape)

    def gather(self, part: F32, widths: Sequence[int]) -> F32 | None:
        """Shard 0 gets ``[rows, sum(widths)]``: every shard's ``[rows, widths[j]]`` side by side; others get None."""
        rows = part.shape[0]
        step = max(1, self.slot_floats // max(widths))
        whole = np.empty((rows, sum(widths)), dtype=np.float32) if self.index == 0 else None
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            if whole is None:
                self._post(np.ascontiguousarray(part[r0:r1]).reshape(-1))
                continue
            n = self._post(None)
            self._wait(n)
            column = 0
            for j, width in enumerate(widths):
                source = part[r0:r1] if j == 0 else self._slots[n % 2, j, : (r1 - r0) * width].reshape(-1, width)
                whole[r0:r1, column : column + width] = source
                column += width
        return whole


# --- commands over pipes ----------------------------------------------------------------------------------------
_HEADER = struct.Struct("<II")


def write_message(fd: int, kind: int, payload: bytes | memoryview = b"") -> None:
    data = memoryview(_HEADER.pack(kind, len(payload)) + bytes(payload))
    while data:
        written = os.write(fd, data)
        data = data[written:]


def read_exact(fd: int, size: int) -> bytes | None:
    """``size`` bytes, or None at end of file."""
    parts = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


def read_message(fd: int) -> tuple[int, bytes] | None:
    header = read_exact(fd, _HEADER.size)
    if header is None:
        return None
    kind, size = _HEADER.unpack(header)
    payload = read_exact(fd, size) if size else b""
    return None if payload is None else (kind, payload)


# --- process life ------------------------------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1


def become_helper(parent: int, keep: Sequence[int]) -> None:
    """In a freshly forked helper: die with the parent, leave its sockets and signals alone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # The runner's sockets (and every other descriptor) stay the parent's: a helper holding a copy would keep a
    # connection open after the parent closed it.
    previous = 2
    for fd in sorted(keep):
        os.closerange(previous + 1, fd)
        previous = fd
    os.closerange(previous + 1, os.sysconf("SC_OPEN_MAX"))


def describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"was killed by {signal.Signals(number).name}"
        except ValueError:
            return f"was killed by signal {number}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"
