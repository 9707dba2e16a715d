"""Atomic counters, a spinning barrier and a work counter for numba code run by several threads at once.

numba has no atomics in nopython mode; these are LLVM's (``atomicrmw add``, ``load atomic``, ``store atomic``,
sequentially consistent) through `numba.extending.intrinsic`, on the elements of an int64 ``control`` array that
every thread of a `_team.Team` shares. Ordinary stores made before an atomic add are visible to a thread whose
atomic load sees that add (the add releases, the load acquires), which is what lets one thread read the rows
another wrote before a barrier.

A waiting thread spins on an atomic load with the CPU's pause hint, yields its core after a while, then sleeps in
short naps, each way for a time read from the monotonic clock (`monotonic_ns`); it stops waiting when another thread
raised the abort flag (a thread failed or never started) or after `WAIT_LIMIT_S` in naps, so a wait can never
outlive the thread it waits for.

Work is handed out two ways: `take` gives units of one counter in turn to whichever thread asks; `take_share` cuts a
product's chunks into one contiguous share per thread, which its owner takes from the front, and a thread done
with its own share takes the others' chunks from their back, so a thread descheduled mid-phase holds up only the
chunk it is working on.

A team's caller posts each run on a ``board`` (`post`): the run's generation and the epoch of its arguments. A
helper that runs many runs on the same arguments stays in a compiled loop between them (`await_run`), so it starts
a run as soon as it is posted, without the GIL or a call through numba's dispatcher; it returns to Python when a run
comes on other arguments, or after `IDLE_NS` of polling in which no caller claimed it (`claim`), so that no core
spins between generations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Any

import numba
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._blocks import JIT
from ._simd import Codegen

__all__ = [
    "ABORT",
    "ARRIVALS",
    "CLAIMED",
    "COUNTERS",
    "DEPARTURES",
    "EPOCH",
    "GENERATION",
    "IDLE",
    "IDLE_NS",
    "SERVING",
    "SLOT",
    "WAIT_LIMIT_S",
    "atomic_add",
    "atomic_load",
    "atomic_store",
    "await_post",
    "await_run",
    "barrier",
    "board_size",
    "claim",
    "compare_exchange",
    "control_size",
    "depart",
    "leave",
    "monotonic_ns",
    "pointer_like",
    "post",
    "recall",
    "take",
    "take_share",
    "wait_departures",
]

_I64 = ir.IntType(64)
#: int64 elements between two fields of ``control``: one cache line each, so that threads polling one field do not
#: slow the writers of another.
SLOT = 8
#: Barrier arrivals of the current run (a monotonic count: barrier ``k`` is passed at ``k * team`` arrivals).
ARRIVALS = 0
#: Non-zero once a thread failed: every wait returns False.
ABORT = SLOT
#: Threads other than the caller that have finished the current run.
DEPARTURES = 2 * SLOT
#: First work counter (counter ``p`` is at ``COUNTERS + SLOT * p``).
COUNTERS = 3 * SLOT
#: Longest a wait sleeps in naps before it gives up (the other thread is gone or stopped).
WAIT_LIMIT_S = 30.0
# How long each way of waiting lasts is measured on the clock, not counted in polls: a pause hint and a
# sched_yield with no other thread to run take from a few to hundreds of nanoseconds depending on the CPU and the
# kernel, so a count tuned on one machine gives a far shorter window on another.
_SPIN_NS = 20_000  # pause-hinted polls before yielding the core
_YIELD_NS = 1_000_000  # then sched_yield polls before napping
_NAP_US = 50
#: How long a helper between runs polls (spinning, then yielding its core) before it sleeps: longer than the
#: caller's Python between two decode steps, sampling included.
IDLE_NS = 5_000_000
_POLLS = 16  # polls between two looks at the clock
#: ``board[GENERATION]``: the last run posted (runs are numbered from 1).
GENERATION = 0
#: ``board[EPOCH]``: the epoch of the arguments of the last run posted (same cache line: written just before it).
EPOCH = 1
#: A helper's state, ``board[SLOT * worker]``: not in its compiled loop, ...
IDLE = 0
#: ... waiting in its loop for the next run (it may still leave when idle), ...
SERVING = 1
#: ... or waiting in its loop, claimed by the caller for the next run (it will not leave before that run).
CLAIMED = 2


def control_size(counters: int) -> int:
    """Elements of a ``control`` array with ``counters`` work counters."""
    return COUNTERS + SLOT * counters


def board_size(team: int) -> int:
    """Elements of the ``board`` of a team of ``team`` threads (its fields, then one state per helper)."""
    return SLOT * max(team, 1)


def _element(context: Any, builder: ir.IRBuilder, array_type: Any, array: Any, index: Any) -> Any:
    data = context.make_array(array_type)(context, builder, array).data
    return builder.gep(builder.bitcast(data, _I64.as_pointer()), [index])


@intrinsic
def atomic_add(typingctx: Any, array: Any, index: Any, value: Any) -> tuple[Any, Codegen]:
    """Add ``value`` to element ``index`` of a C-contiguous int64 array atomically; returns the previous value."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        pointer = _element(context, builder, sig.args[0], args[0], args[1])
        amount = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", pointer, amount, "seq_cst")

    return types.int64(array, index, value), codegen


@intrinsic
def atomic_load(typingctx: Any, array: Any, index: Any) -> tuple[Any, Codegen]:
    """Element ``index`` of a C-contiguous int64 array, read atomically (acquire)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        pointer = _element(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(pointer, "acquire", 8)

    return types.int64(array, index), codegen


@intrinsic
def atomic_store(typingctx: Any, array: Any, index: Any, value: Any) -> tuple[Any, Codegen]:
    """Set element ``index`` of a C-contiguous int64 array atomically (release)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        pointer = _element(context, builder, sig.args[0], args[0], args[1])
        builder.store_atomic(context.cast(builder, args[2], sig.args[2], types.int64), pointer, "release", 8)
        return context.get_dummy_value()

    return types.none(array, index, value), codegen


@intrinsic
def compare_exchange(typingctx: Any, array: Any, index: Any, expected: Any, value: Any) -> tuple[Any, Codegen]:
    """Set element ``index`` of a C-contiguous int64 array to ``value`` if it is ``expected``, atomically; returns
    whether it was."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        pointer = _element(context, builder, sig.args[0], args[0], args[1])
        old = context.cast(builder, args[2], sig.args[2], types.int64)
        new = context.cast(builder, args[3], sig.args[3], types.int64)
        outcome = builder.cmpxchg(pointer, old, new, "seq_cst", "seq_cst")
        return builder.extract_value(outcome, 1)

    return types.boolean(array, index, expected, value), codegen


@intrinsic
def pointer_like(typingctx: Any, address: Any, array: Any) -> tuple[Any, Codegen]:
    """``address`` (an int64) as a pointer to ``array``'s element type: how a helper's compiled loop reaches an
    array the caller made for one run (`numba.carray` over it), the caller keeping it alive until the run ends."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return types.CPointer(array.dtype)(address, array), codegen


_X86 = ("x86_64", "amd64", "i386", "i686")


@intrinsic
def _pause(typingctx: Any) -> tuple[Any, Codegen]:
    """The CPU's spin-wait hint (x86 ``pause``, arm64 ``yield``); nothing elsewhere."""
    machine = platform.machine().lower()

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        module = builder.module
        if machine in _X86:
            hint = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(hint, [])
        elif machine in ("aarch64", "arm64"):
            signature = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])
            hint = cgutils.get_or_insert_function(module, signature, "llvm.aarch64.hint")
            builder.call(hint, [ir.Constant(ir.IntType(32), 1)])
        return context.get_dummy_value()

    return types.none(), codegen


def _libc_symbol(name: str) -> None:
    """Make the C library's ``name`` resolvable by compiled code. The intrinsics below call it by symbol, resolved
    when the code is loaded, so the kernels stay cacheable (a ctypes function pointer would prevent that)."""
    library = ctypes.CDLL(ctypes.util.find_library("c") or None)
    llvm_binding.add_symbol(name, ctypes.cast(getattr(library, name), ctypes.c_void_p).value)


_libc_symbol("sched_yield")
_libc_symbol("usleep")
_libc_symbol("clock_gettime")
_I32 = ir.IntType(32)


@intrinsic
def _sched_yield(typingctx: Any) -> tuple[Any, Codegen]:
    """libc's ``sched_yield()``: give the core to another runnable thread."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, []), "sched_yield"), [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _usleep(typingctx: Any, microseconds: Any) -> tuple[Any, Codegen]:
    """libc's ``usleep(microseconds)``."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_I32]), "usleep")
        builder.call(function, [context.cast(builder, args[0], sig.args[0], types.uint32)])
        return context.get_dummy_value()

    return types.none(microseconds), codegen


_CLOCK_MONOTONIC = 6 if platform.system() == "Darwin" else 1
_TIMESPEC = ir.LiteralStructType([_I64, _I64])  # time_t seconds, long nanoseconds (64-bit platforms)


@intrinsic
def monotonic_ns(typingctx: Any) -> tuple[Any, Codegen]:
    """libc's ``clock_gettime(CLOCK_MONOTONIC)`` in nanoseconds."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        spec = cgutils.alloca_once(builder, _TIMESPEC)
        signature = ir.FunctionType(_I32, [_I32, spec.type])
        function = cgutils.get_or_insert_function(builder.module, signature, "clock_gettime")
        builder.call(function, [ir.Constant(_I32, _CLOCK_MONOTONIC), spec])
        seconds = builder.load(cgutils.gep_inbounds(builder, spec, 0, 0))
        nanoseconds = builder.load(cgutils.gep_inbounds(builder, spec, 0, 1))
        return builder.add(builder.mul(seconds, ir.Constant(_I64, 1_000_000_000)), nanoseconds)

    return types.int64(), codegen


_NAPS = int(WAIT_LIMIT_S * 1e6 / _NAP_US)


@numba.njit(**JIT)
def _reached(control, index, target):  # type: ignore[no-untyped-def]
    """Whether ``control[index] >= target``, or -1 when the run was aborted."""
    if atomic_load(control, index) >= target:
        return 1
    return -1 if atomic_load(control, ABORT) != 0 else 0


@numba.njit(**JIT)
def _wait(control, index, target):  # type: ignore[no-untyped-def]
    """Wait until ``control[index] >= target``: True, or False when the run was aborted or the wait timed out
    (which aborts it)."""
    if atomic_load(control, index) >= target:
        return True
    start = monotonic_ns()
    while True:
        for _ in range(_POLLS):
            if atomic_load(control, index) >= target:
                return True
            _pause()
        if monotonic_ns() - start >= _SPIN_NS:
            break
    while True:
        for _ in range(_POLLS):
            found = _reached(control, index, target)
            if found != 0:
                return found > 0
            _sched_yield()
        if monotonic_ns() - start >= _YIELD_NS:
            break
    for _ in range(_NAPS):
        if atomic_load(control, index) >= target:
            return True
        if atomic_load(control, ABORT) != 0:
            return False
        _usleep(_NAP_US)
    atomic_store(control, ABORT, 1)
    return False


@numba.njit(**JIT)
def barrier(control, passed, team):  # type: ignore[no-untyped-def]
    """Barrier number ``passed + 1`` of the run, for ``team`` threads: returns the new count of barriers passed, or
    -1 when the run was aborted."""
    if team == 1:
        return passed + 1
    atomic_add(control, ARRIVALS, 1)
    if not _wait(control, ARRIVALS, (passed + 1) * team):
        return -1
    return passed + 1


@numba.njit(**JIT)
def take(control, counter):  # type: ignore[no-untyped-def]
    """The next unit of work of counter ``counter`` (0, 1, 2, ... across all threads, each handed out once)."""
    return atomic_add(control, COUNTERS + SLOT * counter, 1)


# A share's counter holds two counts in one word: the chunks its owner took from the front (the low half) and those
# other threads took from the back (the high half), so one atomic add decides who gets a chunk and no chunk is
# taken twice or left.
_BACK = 1 << 32
_FRONT = _BACK - 1


@numba.njit(**JIT)
def take_share(control, counter, units, most, team, worker, share):  # type: ignore[no-untyped-def]
    """The next chunk of a phase's ``units`` units of work (0 .. ``units - 1``), cut into ``team`` contiguous shares
    of as equal sizes as can be, each cut into at most ``most`` chunks of as equal sizes as can be, none smaller
    than ``most`` allows (a share of fewer units than ``most`` is one unit a chunk). Share ``s`` is counted by
    counter ``counter + s``: ``worker`` takes its own share (``share`` 0) from the front, then those of the
    following workers (``share`` 1, 2, ...) from their back. Returns ``(first, last, share)``, the chunk's units
    ``first .. last - 1``: pass ``share`` back in the next call (start at 0); first is -1 when every share is
    spent."""
    while share < team:
        owner = (worker + share) % team
        begin = units * owner // team
        size = units * (owner + 1) // team - begin
        chunks = min(most, size)
        taken = atomic_add(control, COUNTERS + SLOT * (counter + owner), 1 if share == 0 else _BACK)
        front, back = taken & _FRONT, taken >> 32
        if front + back < chunks:
            chunk = front if share == 0 else chunks - 1 - back
            return begin + size * chunk // chunks, begin + size * (chunk + 1) // chunks, share
        share += 1
    return -1, -1, share


@numba.njit(**JIT)
def depart(control):  # type: ignore[no-untyped-def]
    """A helper thread is done with the run (it touches no shared array after this)."""
    atomic_add(control, DEPARTURES, 1)


@numba.njit(**JIT)
def wait_departures(control, team):  # type: ignore[no-untyped-def]
    """The calling thread waits for the ``team - 1`` helpers to finish the run: True, or False when aborted."""
    if team == 1:
        return True
    return _wait(control, DEPARTURES, team - 1)


@numba.njit(**JIT)
def await_post(posted, seen):  # type: ignore[no-untyped-def]
    """A helper between runs: True as soon as ``posted[0]`` (the run count the caller posted) exceeds ``seen``, or
    False after spinning then yielding its core for `IDLE_NS` (the helper then sleeps until woken)."""
    start = monotonic_ns()
    while True:
        for _ in range(_POLLS):
            if atomic_load(posted, 0) > seen:
                return True
            _pause()
        if monotonic_ns() - start >= _SPIN_NS:
            break
    while monotonic_ns() - start < IDLE_NS:
        for _ in range(_POLLS):
            if atomic_load(posted, 0) > seen:
                return True
            _sched_yield()
    return False


@numba.njit(**JIT)
def post(control, board, epoch):  # type: ignore[no-untyped-def]
    """The caller posts the next run, on the arguments of ``epoch``: the run's fields of ``control`` are cleared and
    its generation published (after the clearing, and after any store the caller made before this call)."""
    for i in range(control.size):
        control[i] = 0
    atomic_store(board, EPOCH, epoch)
    atomic_add(board, GENERATION, 1)


@numba.njit(**JIT)
def recall(board):  # type: ignore[no-untyped-def]
    """Every helper waiting in its compiled loop returns to Python: a run posted on no epoch's arguments (the team
    is closing; no run's fields are touched)."""
    atomic_store(board, EPOCH, -1)
    atomic_add(board, GENERATION, 1)


@numba.njit(**JIT)
def claim(board, team):  # type: ignore[no-untyped-def]
    """The caller before a run on the last run's arguments: True when every helper waits in its compiled loop and
    will not leave it before the next run is posted (it may then be posted without waking anyone), False when one
    is not in it or is leaving (wake the helpers through Python)."""
    claimed = True
    for worker in range(1, team):  # every helper, even after one that left: a claimed one takes the next run anyway
        claimed &= compare_exchange(board, SLOT * worker, SERVING, CLAIMED)
    return claimed


@numba.njit(**JIT)
def _next_run(board, epoch, seen, state):  # type: ignore[no-untyped-def]
    """`await_run`'s check: 0 while no run after ``seen`` is posted, the run's generation when it is on ``epoch``'s
    arguments, -1 when it is not (the helper leaves its loop)."""
    generation = atomic_load(board, GENERATION)
    if generation <= seen:
        return 0
    if atomic_load(board, EPOCH) == epoch:
        atomic_store(board, state, SERVING)
        return generation
    atomic_store(board, state, IDLE)
    return -1


@numba.njit(**JIT)
def await_run(board, epoch, seen, worker):  # type: ignore[no-untyped-def]
    """A helper in its compiled loop, after run ``seen`` on the arguments of ``epoch``: the generation of the next
    run, or ``seen`` when the helper must return to Python: the next run is on other arguments (or the team is
    closing), or no run came for a few milliseconds of spinning then yielding its core and no caller has claimed
    it (`claim`). A helper entering its loop calls this with the generation before the one it was posted for."""
    # The state is set to SERVING only when a run is taken: between runs it may be CLAIMED by the caller already.
    state = SLOT * worker
    while True:
        start = monotonic_ns()
        while True:
            for _ in range(_POLLS):
                found = _next_run(board, epoch, seen, state)
                if found != 0:
                    return found if found > 0 else seen
                _pause()
            if monotonic_ns() - start >= _SPIN_NS:
                break
        while monotonic_ns() - start < IDLE_NS:
            for _ in range(_POLLS):
                found = _next_run(board, epoch, seen, state)
                if found != 0:
                    return found if found > 0 else seen
                _sched_yield()
        if compare_exchange(board, state, SERVING, IDLE):
            return seen


@numba.njit(**JIT)
def leave(board, worker):  # type: ignore[no-untyped-def]
    """A helper leaves its compiled loop other than through `await_run` (its run failed)."""
    atomic_store(board, SLOT * worker, IDLE)
