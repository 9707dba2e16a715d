"""Exact bytes and rules of the server's small pieces: BYTES layout, name rules, uploads, scrubbing, config."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import carton
import numpy as np
import pytest
from carton.errors import (
    CartonError,
    InvalidInput,
    ModelClosed,
    RunnerCrashed,
    RunnerFailed,
    RunnerMemoryLimit,
    RunnerTimeout,
)
from carton.server._config import PolicyKind, parse_config
from carton.server._datatypes import decode_bytes_elements, encode_bytes_elements
from carton.server._inference import translate_error
from carton.server._layout import Scrubber, sweep_stale_upload_roots, validate_model_name, write_upload
from carton.server.errors import (
    STATUS,
    BadRequest,
    ModelNotFound,
    ModelUnavailable,
    RepositoryError,
    RequestTooLarge,
    ServerError,
    UploadDisabled,
)


def test_bytes_elements_exact_layout() -> None:
    encoded = encode_bytes_elements(np.array([["a", "é"], ["", "xyz"]]))
    assert encoded == b"\x01\x00\x00\x00a" + b"\x02\x00\x00\x00\xc3\xa9" + b"\x00\x00\x00\x00" + b"\x03\x00\x00\x00xyz"
    assert decode_bytes_elements(memoryview(encoded), 4, tensor="t") == [b"a", "é".encode(), b"", b"xyz"]


@pytest.mark.parametrize(
    ("data", "count", "message"),
    [
        (struct.pack("<I", 5) + b"abc", 1, "declares 5 bytes but only 3 remain"),
        (b"\x01\x00", 1, "length prefix runs past the end"),
        (struct.pack("<I", 1) + b"ab", 1, "1 byte left over after the 1 BYTES element its shape holds"),
        (struct.pack("<I", 1) + b"abc", 1, "2 bytes left over"),
    ],
)
def test_bytes_elements_refused(data: bytes, count: int, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        decode_bytes_elements(memoryview(data), count, tensor="t")


@pytest.mark.parametrize("name", ["", ".", "..", ".hidden", "a/b", "a\\b", "a\x00b", "a\nb", "x" * 256])
def test_model_names_refused(name: str) -> None:
    with pytest.raises(BadRequest):
        validate_model_name(name)


def test_upload_confinement(tmp_path: Path) -> None:
    folder = write_upload(tmp_path, "m", {"file:2/sub/model.carton": b"abc", "file:2/config.txt": b""})
    assert (folder / "2" / "sub" / "model.carton").read_bytes() == b"abc"
    for key in ("file:1/../x", "file:1/./x", "file:01/x", "file:1/a\\b", "file:x", "file:1/", "file:1/a//b"):
        with pytest.raises(RepositoryError, match="file:"):
            write_upload(tmp_path, "m", {key: b""})
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [folder.name]  # failed uploads leave nothing


def test_scrubber_removes_paths(tmp_path: Path) -> None:
    up = tmp_path / "up"
    scrub = Scrubber(tmp_path / "repo", up)
    assert scrub(f"bad {tmp_path}/repo/m/1/model.carton: zip") == "bad m/1/model.carton: zip"
    assert scrub(f"in '{up}/m/{'ab' * 16}/1/x'") == "in 'file:1/x'"  # the client's own parameter name
    assert scrub(f"in {up}/elsewhere") == "in <upload>/elsewhere"
    assert scrub("cannot open /home/user/.cache/carton/abc/model.onnx now") == "cannot open model.onnx now"
    # A root is replaced only where a path starts with it, never inside a longer path or a name.
    assert scrub(f"{tmp_path}/repository/x/y") == "y"
    assert scrub(f"{tmp_path}/repo") == "repo"


@pytest.mark.parametrize("root", ["models/", "repo", "models"])
def test_scrubber_relative_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / root).mkdir()
    scrub = Scrubber(Path(root), tmp_path / "up")
    for message in (
        "failed to load 'nomodels': no such model in the repository",
        "model 'repo' is both a folder and 'repo.carton' in the repository; keep one",
        "models/m/1 and repo/m/1 are relative: the server never hands them out",
    ):
        assert scrub(message) == message
    assert scrub(f"bad {tmp_path / root}/m/1/model.carton") == "bad m/1/model.carton"


def _exited_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_sweep_removes_only_folders_of_dead_servers(tmp_path: Path) -> None:
    dead = tmp_path / f"carton-serve-uploads-{_exited_pid()}-abc"
    (dead / "m" / "x" / "1").mkdir(parents=True)
    (dead / "m" / "x" / "1" / "model.carton").write_bytes(b"x")
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as sleeper:
        try:
            alive = tmp_path / f"carton-serve-uploads-{sleeper.pid}-abc"
            mine = tmp_path / f"carton-serve-uploads-{os.getpid()}-abc"
            legacy = tmp_path / "carton-serve-uploads-k2j4h5"  # no pid: nobody can tell whose it is
            other = tmp_path / f"unrelated-{_exited_pid()}-abc"
            for folder in (alive, mine, legacy, other):
                folder.mkdir()
            target = tmp_path / "target"
            target.mkdir()
            link = tmp_path / f"carton-serve-uploads-{_exited_pid()}-link"
            link.symlink_to(target)
            assert sweep_stale_upload_roots(tmp_path) == [dead]
            assert not dead.exists()
            assert all(folder.is_dir() for folder in (alive, mine, legacy, other, target)) and link.is_symlink()
        finally:
            sleeper.kill()


def test_config_parsing() -> None:
    config = parse_config(
        '{"name": "m", "max_batch_size": 4, "dynamic_batching": {"max_queue_delay_microseconds": "100"},'
        ' "instance_group": [{"count": 2}], "version_policy": {"specific": {"versions": [1, 3]}},'
        ' "parameters": {"k": {"string_value": "v"}}}',
        model="m", source="config.json",
    )  # fmt: skip
    assert config.max_batch_size == 4 and config.instance_count == 2 and config.parameters == {"k": "v"}
    assert config.dynamic_batching is not None and config.dynamic_batching.max_queue_delay_microseconds == 100
    assert config.version_policy.kind is PolicyKind.SPECIFIC and config.version_policy.select([1, 2, 3]) == [1, 3]
    for document, message in [
        ('{"name": "other"}', "does not match"),
        ('{"sequence_batching": {}}', "unsupported field"),
        ('{"dynamic_batching": {}}', "needs max_batch_size > 0"),
        ('{"max_batch_size": -1}', "integer >= 0"),
        ('{"instance_group": [{"kind": "KIND_GPU"}]}', "KIND_CPU"),
        ('{"version_policy": {"newest": {}}}', "unknown version_policy"),
        ("[]", "must be a JSON object"),
    ]:
        with pytest.raises(RepositoryError, match=message):
            parse_config(document, model="m", source="config.json")


@pytest.mark.parametrize(
    ("error", "status", "expected"),
    [
        (
            RunnerTimeout(
                "runner carton_runner_mcf.runner:MCFRunner did not answer infer within 2.5 s (timeout); it was killed",
                limit_seconds=2.5,
                limit_name="infer timeout",
            ),
            503,
            "model 'm' version 1 did not answer within the server's request timeout of 2.5 s; the request was "
            "abandoned and the model is restarted for the next one",
        ),
        (
            ModelClosed("runner a.b:C was closed during infer"),
            503,
            "model 'm' version 1 was unloaded while it ran; retry the request",
        ),
        (
            RunnerCrashed(
                "runner a.b:C (pid 4242) was killed by SIGSEGV during infer\nrunner log:\n/opt/x/y.py line 3"
            ),
            500,
            "model 'm' version 1 crashed while running the request; it is restarted for the next request",
        ),
        (
            RunnerMemoryLimit("runner a.b:C ran out of its memory limit (memory_bytes=1000) during infer: MemoryError"),
            500,
            "model 'm' version 1 went over the server's memory limit for a model while running the request",
        ),
        (
            RunnerFailed(
                "runner pkg.mod:Runner failed during infer: ValueError: Got invalid dimensions for input /srv/m/x.onnx",
                remote_kind="internal",
                remote_message="Got invalid dimensions for input /srv/m/x.onnx",
            ),
            500,
            "model 'm' version 1 failed: Got invalid dimensions for input x.onnx",
        ),
        (InvalidInput("input 'x': expected float32"), 400, "input 'x': expected float32"),
        (InvalidInput("token 600 of /srv/m/vocab.json is too large", tensor="ids"), 400, "token 600 of vocab.json"),
    ],
)
def test_runner_failures_answered_without_internals(error: Exception, status: int, expected: str) -> None:
    served = SimpleNamespace(model="m", version_str="1")
    answer = translate_error(error, Scrubber(Path("/srv/repo")), served)  # type: ignore[arg-type]
    assert answer.http_status == status and str(answer).startswith(expected), str(answer)
    for internal in ("runner", "pid", "a.b:C", "SIGSEGV", "/srv", "MCF"):
        assert internal not in str(answer)


def test_each_server_error_has_one_http_status_and_one_grpc_code() -> None:
    import grpc

    expected = {
        ServerError: (500, "INTERNAL"),
        BadRequest: (400, "INVALID_ARGUMENT"),
        RequestTooLarge: (413, "RESOURCE_EXHAUSTED"),
        ModelNotFound: (404, "NOT_FOUND"),
        ModelUnavailable: (503, "UNAVAILABLE"),
        RepositoryError: (400, "INVALID_ARGUMENT"),
        UploadDisabled: (403, "PERMISSION_DENIED"),
    }
    assert {kind: (status.http, status.grpc) for kind, status in STATUS.items()} == expected
    for kind, (http, code) in expected.items():
        error = kind("x")
        assert (error.http_status, error.grpc_status) == (http, code)
        assert isinstance(error, CartonError) and grpc.StatusCode[code]  # a real gRPC status code
        assert getattr(carton, kind.__name__) is kind  # importable from carton too


def test_a_server_error_subclass_is_answered_as_its_nearest_listed_base() -> None:
    class Teapot(BadRequest):
        pass

    assert (Teapot("x").http_status, Teapot("x").grpc_status) == (400, "INVALID_ARGUMENT")
