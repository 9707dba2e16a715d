"""``carton doctor`` and ``carton serve``'s sandbox and limit flags."""

from __future__ import annotations

import dataclasses
import json

import pytest
from carton._sandbox import Backend, Layer, _wrap, machine_support
from carton.cli import build_parser, main


def test_doctor_json_lists_every_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["layers"]) == [layer.value for layer in Layer]
    assert set(report["backends"]) == {backend.value for backend in Backend}
    assert report["landlock_abi"] == machine_support().landlock_abi


def test_doctor_table_and_strict_exit(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake = dataclasses.replace(machine_support(), backends={b: "missing (test)" for b in Backend}, landlock_abi=0)
    monkeypatch.setattr("carton._sandbox.machine_support", lambda: fake)
    monkeypatch.setattr(_wrap, "machine_support", lambda: fake)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "NO  pid_namespace" in out and "NO  landlock" in out and "strict: refused here" in out
    assert main(["doctor", "--strict"]) == 1


def test_serve_limit_flags() -> None:
    args = build_parser().parse_args(["serve", "repo", "--sandbox", "strict", "--memory-limit", "2g",
                                      "--cpu-limit", "30", "--request-timeout", "2.5", "--process-limit", "64"])
    assert (args.sandbox, args.memory_limit, args.cpu_limit, args.request_timeout, args.process_limit) == (
        "strict", 2 << 30, 30.0, 2.5, 64)
    for bad in (["--cpu-limit", "-1"], ["--memory-limit", "lots"], ["--sandbox", "paranoid"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "repo", *bad])
