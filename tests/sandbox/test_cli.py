"""``carton doctor`` and ``carton serve``'s sandbox and limit flags."""

from __future__ import annotations

import dataclasses
import json

import pytest
from carton._runtime import cgroup_support
from carton._sandbox import Backend, Layer, _wrap, machine_support
from carton.cli import build_parser, main


def test_doctor_json_lists_every_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["layers"]) == [layer.value for layer in Layer]
    assert set(report["backends"]) == {backend.value for backend in Backend}
    assert report["landlock_abi"] == machine_support().landlock_abi
    cgroups = cgroup_support()
    assert report["runner_cgroups"] == {"available": cgroups.available, "detail": cgroups.detail}


@pytest.mark.parametrize("backend", list(Backend))
def test_doctor_reports_the_forced_backend(
    backend: Backend, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CARTON_SANDBOX_BACKEND", backend.value)
    support = machine_support()
    usable = support.backends[backend] is None
    assert main(["doctor", "--json", "--strict"]) == (0 if usable else 1)
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == (backend.value if usable else None)
    assert report["backends"][backend.value]["usable"] is usable
    if usable:
        # A usable backend gives every layer on this machine (Landlock and seccomp permitting): the probe really
        # built the namespaces, the private root and the uid switch.
        namespace_layers = ("pid_namespace", "mount_namespace", "filesystem_view", "non_root_uid")
        assert all(report["layers"][name]["available"] for name in namespace_layers)
        expected = {s.layer.value: s.available for s in support.layers(backend)}
        assert {name: entry["available"] for name, entry in report["layers"].items()} == expected
        assert report["strict"] is all(expected.values())


def test_a_failing_unshare_probe_is_reported(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    why = "carton sandbox: filesystem_view: mount tmpfs on /tmp: EPERM (test)"
    fake = dataclasses.replace(machine_support(), backends={Backend.BWRAP: "missing (test)", Backend.UNSHARE: why})
    monkeypatch.setattr("carton._sandbox.machine_support", lambda: fake)
    monkeypatch.setattr(_wrap, "machine_support", lambda: fake)
    monkeypatch.setenv("CARTON_SANDBOX_BACKEND", "unshare")
    assert main(["doctor", "--strict"]) == 1
    out = capsys.readouterr().out
    assert f"unusable: {why}" in out
    assert "NO  filesystem_view" in out and "NO  non_root_uid" in out


def test_doctor_table_and_strict_exit(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake = dataclasses.replace(machine_support(), backends={b: "missing (test)" for b in Backend}, landlock_abi=0)
    monkeypatch.setattr("carton._sandbox.machine_support", lambda: fake)
    monkeypatch.setattr(_wrap, "machine_support", lambda: fake)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "NO  pid_namespace" in out and "NO  landlock" in out and "strict: refused here" in out
    assert main(["doctor", "--strict"]) == 1


def test_serve_limit_flags() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "repo",
            "--sandbox",
            "strict",
            "--memory-limit",
            "2g",
            "--cpu-limit",
            "30",
            "--request-timeout",
            "2.5",
            "--process-limit",
            "64",
        ]
    )
    assert (args.sandbox, args.memory_limit, args.cpu_limit, args.request_timeout, args.process_limit) == (
        "strict",
        2 << 30,
        30.0,
        2.5,
        64,
    )
    for bad in (["--cpu-limit", "-1"], ["--memory-limit", "lots"], ["--sandbox", "paranoid"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "repo", *bad])


def test_doctor_help_describes_the_backends_as_docs_sandbox_md_does(capsys: pytest.CaptureFixture[str]) -> None:
    """The unshare backend is the shim's own unshare(2) calls (docs/sandbox.md), not util-linux's command."""
    from carton.cli import main

    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "util-linux unshare" not in text and "no util-linux binary" in text, text
