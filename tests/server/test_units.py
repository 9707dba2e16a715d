"""Exact bytes and rules of the server's small pieces: BYTES layout, name rules, uploads, scrubbing, config."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from carton.errors import BadRequest, RepositoryError
from carton.server._config import PolicyKind, parse_config
from carton.server._datatypes import decode_bytes_elements, encode_bytes_elements
from carton.server._layout import Scrubber, validate_model_name, write_upload


def test_bytes_elements_exact_layout() -> None:
    encoded = encode_bytes_elements(np.array([["a", "é"], ["", "xyz"]]))
    assert encoded == b"\x01\x00\x00\x00a" + b"\x02\x00\x00\x00\xc3\xa9" + b"\x00\x00\x00\x00" + b"\x03\x00\x00\x00xyz"
    assert decode_bytes_elements(memoryview(encoded), 4, tensor="t") == [b"a", "é".encode(), b"", b"xyz"]


@pytest.mark.parametrize(
    ("data", "count", "message"),
    [
        (struct.pack("<I", 5) + b"abc", 1, "declares 5 bytes but only 3 remain"),
        (b"\x01\x00", 1, "length prefix runs past the end"),
        (struct.pack("<I", 1) + b"ab", 1, "1 bytes left over"),
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
    scrub = Scrubber([(tmp_path / "repo", ""), (tmp_path / "up", "<upload>/")])
    assert scrub(f"bad {tmp_path}/repo/m/1/model.carton: zip") == "bad m/1/model.carton: zip"
    assert scrub(f"in {tmp_path}/up/m/abc/1/x") == "in <upload>/m/abc/1/x"
    assert scrub("cannot open /home/user/.cache/carton/abc/model.onnx now") == "cannot open model.onnx now"


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
