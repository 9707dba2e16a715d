"""`carton serve` as a user runs it: a subprocess on free ports, stopped with SIGINT."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from serving_process import start_serving, wait_answering


def test_serve_subprocess_stops_on_sigint(repository: Path) -> None:
    serving = start_serving(
        [sys.executable, "-m", "carton", "serve", str(repository), "--http-port", "0", "--no-grpc",
         "--model-control-mode", "explicit", "--load-model", "sum"],
    )  # fmt: skip
    process, port = serving.process, serving.http_port
    try:
        wait_answering(
            serving, lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/sum/ready").status == 200,
            timeout=60,
        )  # fmt: skip
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
        # Where it listens reaches the user as a plain line on stderr, not as a warning in the log.
        lines = serving.stderr_lines()
        assert f"carton server: HTTP on 127.0.0.1:{port}" in lines, lines
        assert not any("WARNING" in line for line in lines), lines
    finally:
        if process.poll() is None:
            process.kill()


def test_serve_refuses_bad_flags(repository: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "carton", "serve", str(repository), "--load-model", "sum"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0 and "--load-model needs --model-control-mode explicit" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "carton", "serve", str(repository), "--max-body-size", "lots"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "is not a size" in result.stderr


@pytest.mark.parametrize("missing", ["does-not-exist"])
def test_serve_missing_repository(tmp_path: Path, missing: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "carton", "serve", str(tmp_path / missing), "--http-port", "0", "--no-grpc"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1 and "is not a directory" in result.stderr


def _status(url: str) -> int:
    try:
        return int(urllib.request.urlopen(url).status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _states(port: int) -> dict[str, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/repository/index", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(request) as response:
            return {entry["name"]: entry.get("state", "") for entry in json.loads(response.read())}
    except OSError:
        return {}


@pytest.mark.parametrize("strict, ready", [(True, 400), (False, 200)])
def test_serve_strict_readiness(repository: Path, strict: bool, ready: int) -> None:
    """The repository's `broken` model fails to load at start: with --strict-readiness the server is not ready."""
    serving = start_serving(
        [sys.executable, "-m", "carton", "serve", str(repository), "--http-port", "0", "--no-grpc",
         *(["--strict-readiness"] if strict else [])],
    )  # fmt: skip
    process, port = serving.process, serving.http_port
    try:
        # Every model of the repository loads at start; `broken` fails.
        wait_answering(serving, lambda: set(_states(port).values()) == {"READY", "UNAVAILABLE"}, timeout=120)
        assert _status(f"http://127.0.0.1:{port}/v2/health/ready") == ready
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
