"""Target triples and runner selection (name, Cargo requirement, compat version, platforms, preference order)."""

from __future__ import annotations

import platform
import sys

import pytest
from carton._runtime._platform import _triple, target_triple
from carton._runtime._plugins import PluginProblem
from carton._runtime._resolve import RunnerRequest, select_runner
from carton.errors import InvalidVersionReq, NoCompatibleRunner
from carton_protocol import RunnerSpec

HOST = "x86_64-unknown-linux-gnu"


@pytest.mark.parametrize(
    ("machine", "system", "bits", "libc", "expected"),
    [
        ("x86_64", "linux", 64, "glibc", "x86_64-unknown-linux-gnu"),
        ("AMD64", "win32", 64, "", "x86_64-pc-windows-msvc"),
        ("aarch64", "linux", 64, "glibc", "aarch64-unknown-linux-gnu"),
        ("aarch64", "linux", 64, "musl", "aarch64-unknown-linux-musl"),
        ("arm64", "darwin", 64, "", "aarch64-apple-darwin"),
        ("x86_64", "darwin", 64, "", "x86_64-apple-darwin"),
        ("armv7l", "linux", 32, "glibc", "armv7-unknown-linux-gnueabihf"),
        ("x86_64", "linux", 32, "glibc", "i686-unknown-linux-gnu"),
        ("ppc64le", "linux", 64, "glibc", "powerpc64le-unknown-linux-gnu"),
        ("riscv64", "linux", 64, "glibc", "riscv64gc-unknown-linux-gnu"),
        ("amd64", "freebsd14", 64, "", "x86_64-unknown-freebsd"),
    ],
)
def test_triples(machine: str, system: str, bits: int, libc: str, expected: str) -> None:
    assert _triple(machine, system, bits, libc) == expected


def test_this_host() -> None:
    triple = target_triple()
    if sys.platform.startswith("linux") and platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc":
        assert triple == "x86_64-unknown-linux-gnu"
    assert triple.count("-") >= 2


def spec(name: str = "onnxruntime", version: str = "1.17.0", compat: int = 1, **kw: object) -> RunnerSpec:
    return RunnerSpec(runner_name=name, framework_version=version, runner_compat_version=compat,
                      entry="mod:Runner", source=kw.pop("source", f"test {name} {version}"), **kw)  # type: ignore[arg-type]


def request(req: str = ">=1.16", name: str = "onnxruntime", compat: int | None = 1,
            platforms: tuple[str, ...] = ()) -> RunnerRequest:
    return RunnerRequest(runner_name=name, required_framework_version=req, runner_compat_version=compat,
                         required_platforms=platforms)


def test_highest_matching_version_wins() -> None:
    candidates = [spec(version="1.16.3"), spec(version="1.18.0"), spec(version="1.17.1"), spec(version="2.0.0"),
                  spec(name="xgboost", version="9.0.0")]
    assert select_runner(request("^1.16"), candidates, host=HOST).framework_version == "1.18.0"
    assert select_runner(request("=1.17.1"), candidates, host=HOST).framework_version == "1.17.1"
    assert select_runner(request("*"), candidates, host=HOST).framework_version == "2.0.0"


def test_pep440_versions_match_after_normalization() -> None:
    candidates = [spec(name="torch", version="2.13.0+cpu"), spec(name="torch", version="2.14.0rc1")]
    assert select_runner(request("=2.13.0", name="torch"), candidates, host=HOST).framework_version == "2.13.0+cpu"
    # a pre-release only matches a requirement naming a pre-release of the same version
    assert select_runner(request(">=2.13", name="torch"), candidates, host=HOST).framework_version == "2.13.0+cpu"
    chosen = select_runner(request(">=2.14.0-rc.1", name="torch"), candidates, host=HOST)
    assert chosen.framework_version == "2.14.0rc1"


def test_tie_breaks() -> None:
    # equal SemVer precedence: the higher PEP 440 version (a post release) wins
    chosen = select_runner(request("=2.0.0"), [spec(version="2.0.0.post1"), spec(version="2.0.0")], host=HOST)
    assert chosen.framework_version == "2.0.0.post1"
    # compat version unpinned: the highest compat version wins
    chosen = select_runner(request("=2.0.0", compat=None), [spec(version="2.0.0", compat=3),
                                                             spec(version="2.0.0", compat=4)], host=HOST)
    assert chosen.runner_compat_version == 4
    # same version in the host and in an environment: the host's own interpreter wins
    env = spec(version="2.0.0", python="/envs/x/bin/python", environment="/envs/x", source="/envs/x")
    host_spec = spec(version="2.0.0", source="plugin onnxruntime")
    assert select_runner(request("=2.0.0"), [env, host_spec], host=HOST) is host_spec
    # otherwise discovery order
    first, second = spec(version="2.0.0", source="a"), spec(version="2.0.0", source="b")
    assert select_runner(request("=2.0.0"), [first, second], host=HOST) is first


def test_platforms() -> None:
    linux_only = spec(version="1.17.0", supported_platforms=("x86_64-unknown-linux-gnu",))
    mac_only = spec(version="1.18.0", supported_platforms=("aarch64-apple-darwin",))
    assert select_runner(request(), [linux_only, mac_only], host=HOST) is linux_only
    assert select_runner(request(), [linux_only, mac_only], host="aarch64-apple-darwin") is mac_only
    with pytest.raises(NoCompatibleRunner, match=r"the model requires aarch64-apple-darwin; this host is x86_64"):
        select_runner(request(platforms=("aarch64-apple-darwin",)), [linux_only], host=HOST)
    with pytest.raises(NoCompatibleRunner, match=r"framework version 1\.16rc1 \(as SemVer 1\.16\.0-rc\.1\) does not"):
        select_runner(request(), [spec(version="1.16rc1")], host=HOST)
    with pytest.raises(NoCompatibleRunner):
        select_runner(request(platforms=("aarch64-apple-darwin",)), [linux_only], host=HOST)
    chosen = select_runner(request(platforms=(HOST, "aarch64-apple-darwin")), [linux_only], host=HOST)
    assert chosen is linux_only


def test_no_match_lists_every_candidate_and_reason() -> None:
    candidates = [
        spec(version="1.15.0", source="plugin a"),
        spec(version="1.17.0", compat=2, source="plugin b"),
        spec(name="xgboost", version="2.0.0", source="plugin c"),
        spec(version="not a version!", source="plugin d"),
        spec(version="1.17.0", supported_platforms=("aarch64-apple-darwin",), source="plugin e"),
    ]
    problems = [PluginProblem(plugin="broken", message="entry point 'broken.plugin' failed to load: ImportError: x")]
    with pytest.raises(NoCompatibleRunner) as info:
        select_runner(request(">=1.16"), candidates, host=HOST, problems=problems)
    message = str(info.value)
    assert message.splitlines()[0] == (
        "no installed runner can run this model: it needs runner 'onnxruntime' with framework version '>=1.16' "
        "and runner compat version 1 on x86_64-unknown-linux-gnu."
    )
    assert "onnxruntime 1.15.0 (compat 1, plugin a): framework version 1.15.0 does not satisfy '>=1.16'" in message
    assert "onnxruntime 1.17.0 (compat 2, plugin b): runner compat version is 2, the model needs 1" in message
    assert "xgboost 2.0.0 (compat 1, plugin c): runner name is 'xgboost', not 'onnxruntime'" in message
    assert "framework version 'not a version!' is neither SemVer nor PEP 440" in message
    assert "runner supports aarch64-apple-darwin, not this host (x86_64-unknown-linux-gnu)" in message
    assert "plugin 'broken': entry point 'broken.plugin' failed to load: ImportError: x" in message
    # several reasons for one candidate are all given
    with pytest.raises(NoCompatibleRunner, match=r"runner name is 'xgboost', not 'onnxruntime'; framework version"):
        select_runner(request("=9"), [spec(name="xgboost", version="2.0.0")], host=HOST)


def test_no_candidates_at_all() -> None:
    with pytest.raises(NoCompatibleRunner, match="Candidates: none"):
        select_runner(request(), [], host=HOST)


def test_bad_requirement() -> None:
    with pytest.raises(InvalidVersionReq, match=r"invalid version requirement '>= one': unexpected character 'o'"):
        select_runner(request(">= one"), [spec()], host=HOST)
