"""The `carton` entry point itself: help, exit codes, broken pipes, warnings as messages."""

from __future__ import annotations

import subprocess
import sys
import warnings
from argparse import Namespace

import pytest

from carton.cli import build_parser, main


def test_help_lists_every_command() -> None:
    text = build_parser().format_help()
    for command in ("info", "verify", "pack", "shrink", "runners", "runner", "selftest", "infer", "mcf", "serve",
                    "doctor"):
        assert f"    {command}" in text


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: carton" in capsys.readouterr().out


def test_a_closed_pipe_is_not_a_traceback() -> None:
    # `carton --help`-sized output is too small to fill a pipe; write a lot through a command that streams JSON.
    code = (
        "import sys, carton.cli as c\n"
        "def flood(args):\n"
        "    for _ in range(100000):\n"
        "        print('x' * 100)\n"
        "    return 0\n"
        "p = c.build_parser\n"
        "def build():\n"
        "    parser = p()\n"
        "    parser.set_defaults(func=flood)\n"
        "    return parser\n"
        "c.build_parser = build\n"
        "sys.exit(c.main(['runners']))\n"
    )
    producer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert producer.stdout is not None
    producer.stdout.read(10)
    producer.stdout.close()
    _, stderr = producer.communicate(timeout=60)
    assert producer.returncode == 0, stderr.decode()
    assert b"Traceback" not in stderr


def test_warnings_print_as_messages(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from carton.errors import RunnerWarning

    def warn(args: Namespace) -> int:
        warnings.warn("ignoring unknown runner opts 'bogus'", RunnerWarning, stacklevel=1)
        return 0

    parser = build_parser()
    parser.set_defaults(func=warn)
    monkeypatch.setattr("carton.cli.build_parser", lambda: parser)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["runners"]) == 0
    err = capsys.readouterr().err
    assert "carton: warning: RunnerWarning: ignoring unknown runner opts 'bogus'" in err
    assert ".py:" not in err
