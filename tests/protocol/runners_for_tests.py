"""Runner subclasses the protocol tests start in real runner processes (entry ``runners_for_tests:Name``).

Each misbehaves in one specific way on request; the inputs or load options say what to do.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from carton_protocol import DType, LoadContext, PackContext, PackResult, Runner, Tensor, TensorSpec


class Echo(Runner):
    """Returns its inputs (renamed with opts['prefix'] when given); warns about options it does not know."""

    def load(self, context: LoadContext) -> None:
        self.prefix = str(context.opts.get("prefix", ""))
        self.load_context = context
        for key in context.opts:
            if key not in ("prefix",):
                context.warn(f"unknown option {key!r}")

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        return {self.prefix + name: value for name, value in inputs.items()}

    @classmethod
    def pack(cls, context: PackContext) -> PackResult:
        (context.model_dir / "packed.txt").write_text("packed")
        if "fail" in context.opts:
            raise ValueError("the model folder has no model in it")
        context.warn("pack warning")
        return PackResult(
            inputs=(TensorSpec(name="x", dtype=DType.FLOAT32, shape=(1, "n")),),
            outputs=context.outputs,
            opts={**context.opts, "packed": True},
        )


class Negate(Runner):
    """Returns ``-x`` (a fresh array, as a real model would) for every input."""

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        return {name: np.negative(value) for name, value in inputs.items() if isinstance(value, np.ndarray)}


class ConcurrentEcho(Echo):
    """An echo that declares itself concurrent; ``sleep`` input (seconds) makes each call wait, GIL released."""

    concurrent = True

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        sleep = inputs.get("sleep")
        if isinstance(sleep, np.ndarray):
            time.sleep(float(sleep.reshape(-1)[0]))
        return {
            "thread": np.array([threading.get_ident() % 1_000_000], dtype=np.int64),
            # The runner's main thread is its socket thread: True when the call was not handed to the pool.
            "inline": np.array([threading.current_thread() is threading.main_thread()]),
            **{name: value for name, value in inputs.items() if name != "sleep"},
        }


class Sleep(Runner):
    """Sleeps ``seconds`` (input) before answering: a runner that stops answering."""

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        seconds = inputs["seconds"]
        assert isinstance(seconds, np.ndarray)
        time.sleep(float(seconds.reshape(-1)[0]))
        return {"done": np.array([1], dtype=np.int32)}


class Crash(Runner):
    """Dies mid-request: SIGSEGV (a real segfault through ctypes), or os._exit(code) when ``exit_code`` is given."""

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        code = inputs.get("exit_code")
        if isinstance(code, np.ndarray):
            sys.stdout.flush()
            os._exit(int(code.reshape(-1)[0]))
        print("about to segfault", flush=True)
        ctypes.string_at(0)
        return {}


class Fail(Runner):
    """Raises from its own code: in load when opts['fail_load'], else in every infer."""

    def load(self, context: LoadContext) -> None:
        if context.opts.get("fail_load"):
            raise FileNotFoundError(f"no model.bin in {context.model_dir}")

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        raise ValueError("the model cannot handle this input")


class BadOutput(Runner):
    """Returns something the wire cannot carry (a complex array, or not a mapping)."""

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        if "not_a_mapping" in inputs:
            return [1, 2]  # type: ignore[return-value]
        return {"z": np.zeros(3, dtype=np.complex64)}


class SlowImport(Runner):
    """Never answers the handshake: its module import blocks (see `never_answer`)."""

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        return dict(inputs)


class Spawner(Runner):
    """Starts descendants that would outlive it: a child, and a grandchild that calls setsid(); reports their pids."""

    def load(self, context: LoadContext) -> None:
        self.pid_file = Path(str(context.opts["pid_file"]))
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        grandchild_script = (
            "import os, sys, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    open(sys.argv[1], 'a').write(f'{os.getpid()}\\n')\n"
            "    time.sleep(600)\n"
            "else:\n"
            "    os._exit(0)\n"
        )
        subprocess.run([sys.executable, "-c", grandchild_script, str(self.pid_file)], check=True)
        deadline = time.monotonic() + 10
        while not (self.pid_file.exists() and self.pid_file.read_text().endswith("\n")):
            if time.monotonic() > deadline:
                raise TimeoutError("the setsid grandchild never reported its pid")
            time.sleep(0.01)
        with self.pid_file.open("a") as handle:
            handle.write(f"{child.pid}\n")

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        if "wedge" in inputs:
            # Stuck in a C call that holds the GIL: no Python signal handler or watch thread can run any more.
            ctypes.PyDLL(None).sleep(600)
        return {"pid": np.array([os.getpid()], dtype=np.int64)}


def _spawn_setsid_orphan(pid_file: Path) -> int:
    """Fork a child that calls setsid() and forks a sleeper, then exits: the sleeper is orphaned at once."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        sleeper = os.fork()
        if sleeper == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)"])
        os.write(write_end, f"{sleeper}\n".encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        sleeper_pid = int(reader.readline())
    os.waitpid(child, 0)
    with pid_file.open("a") as handle:
        handle.write(f"{sleeper_pid}\n")
    return sleeper_pid


class OrphanThenCrash(Runner):
    """Orphans a setsid() sleeper (pid appended to opts['pid_file']), then dies of SIGSEGV or SIGKILL (input)."""

    def load(self, context: LoadContext) -> None:
        self.pid_file = Path(str(context.opts["pid_file"]))

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        _spawn_setsid_orphan(self.pid_file)
        if "sigkill" in inputs:
            os.kill(os.getpid(), signal.SIGKILL)
        ctypes.string_at(0)
        return {}


class IgnoreClose(Runner):
    """Blocks SIGTERM and never returns from close: the host must kill it."""

    def load(self, context: LoadContext) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        return dict(inputs)

    def close(self) -> None:
        time.sleep(600)


class Environment(Runner):
    """Reports its environment and open descriptors."""

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        env = sorted(f"{key}={value}" for key, value in os.environ.items())
        fds = []
        for fd in sorted(os.listdir("/proc/self/fd")):
            try:
                fds.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
        return {
            "env": np.array(env, dtype=str),
            "fds": np.array(fds, dtype=str),
            "cwd": np.array([os.getcwd()], dtype=str),
            "sid": np.array([os.getsid(0), os.getpid()], dtype=np.int64),
        }


class Shifty(Runner):
    """Answers ``{"y": x}``, or misbehaves as ``x[0]`` says while its inputs keep one layout (the loop's learnt
    request path): 1 raises, 2 reshapes ``y``, 3 returns a list, 4 a complex ``y``, 5 a strided ``y``, 6 two outputs,
    7 a mapping that is not a dict, 8 ``y`` renamed, 9 ``y`` as float64; a negative ``x[0]`` sleeps that many seconds.
    Concurrent: the runner loop decides per call whether it runs inline (the ``inline`` output of case 6)."""

    concurrent = True

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        x = inputs["x"]
        assert isinstance(x, np.ndarray)
        how = float(x.reshape(-1)[0])
        if how < 0:
            time.sleep(-how)
        match how:
            case 1:
                raise ValueError("shifty refuses")
            case 2:
                return {"y": x.reshape(-1, 1)}
            case 3:
                return [x]  # type: ignore[return-value]
            case 4:
                return {"y": x.astype(np.complex64)}
            case 5:
                return {"y": np.repeat(x, 2)[::2]}
            case 6:
                return {"y": x, "inline": np.array([threading.current_thread() is threading.main_thread()])}
            case 7:
                return types.MappingProxyType({"y": x})
            case 8:
                return {"z": x}
            case 9:
                return {"y": x.astype(np.float64)}
        return {"y": x}
