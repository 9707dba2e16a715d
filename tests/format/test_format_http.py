"""URLs and LINKS against a local HTTP server on 127.0.0.1 (see conftest.FileServer)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import carton
import numpy as np
import pytest
from carton import DType, TensorSpec
from carton._format import open_carton
from carton._format._links import blob_path
from carton.errors import FetchError, LinkError

from .conftest import FileServer

X = TensorSpec(name="x", dtype=DType.FLOAT32, shape=(3,))


@pytest.fixture
def big_carton(tmp_path: Path) -> Path:
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(os.urandom(4 << 20))
    return carton.pack(folder, tmp_path / "big.carton", runner_name="onnxruntime", required_framework_version="=1",
                       runner_compat_version=1, validate=False, inputs=[X],
                       self_tests=[{"inputs": {"x": np.arange(3, dtype=np.float32)}}])  # fmt: skip


def test_info_over_http_reads_only_the_tail(server: FileServer, big_carton: Path, cache: Path) -> None:
    server.files["/m.carton"] = big_carton.read_bytes()
    info = carton.get_model_info(server.url("/m.carton"))
    assert info == carton.get_model_info(big_carton)
    assert server.bytes_sent <= 256 << 10  # one tail request, no model bytes
    assert server.requests == [("/m.carton", "bytes=-262144")]
    np.testing.assert_array_equal(info.self_tests[0].inputs["x"].load(), np.arange(3, dtype=np.float32))


def test_open_over_http_extracts_with_ranges(server: FileServer, big_carton: Path, cache: Path) -> None:
    server.files["/m.carton"] = big_carton.read_bytes()
    opened = open_carton(server.url("/m.carton"))
    assert (opened.model_dir / "weights.bin").read_bytes() == (big_carton.parent / "big" / "weights.bin").read_bytes()
    assert any(r and not r.startswith("bytes=-") for _p, r in server.requests)


def test_server_without_ranges_falls_back_to_a_download(server: FileServer, big_carton: Path, cache: Path) -> None:
    server.files["/m.carton"] = big_carton.read_bytes()
    info = carton.get_model_info(server.url("/norange/m.carton"))
    assert info.manifest_sha256 == carton.get_model_info(big_carton).manifest_sha256
    assert list((cache / "downloads").iterdir()) == []  # the temporary download is gone


def test_compressed_full_download(server: FileServer, big_carton: Path, cache: Path) -> None:
    server.files["/m.carton"] = big_carton.read_bytes()
    info = carton.get_model_info(server.url("/gzip/m.carton"))  # gzip-encoded 200 answer to a range request
    assert info.manifest_sha256 == carton.get_model_info(big_carton).manifest_sha256


def test_http_errors(server: FileServer, cache: Path) -> None:
    with pytest.raises(FetchError, match="HTTP 404"):
        carton.get_model_info(server.url("/missing.carton"))
    with pytest.raises(FetchError, match="timed out"):
        carton.get_model_info(server.url("/slow/x.carton"), limits=carton.ReadLimits(http_timeout=0.5))


def _linked_carton(tmp_path: Path, urls: list[str], data: bytes) -> Path:
    folder = tmp_path / "linked"
    folder.mkdir(exist_ok=True)
    (folder / "weights.bin").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    return carton.pack(folder, tmp_path / "linked.carton", runner_name="onnxruntime", required_framework_version="=1",
                       runner_compat_version=1, validate=False, linked_files={digest: urls})  # fmt: skip


@pytest.mark.parametrize("encoding", ["", "gzip/", "deflate/", "br/", "zstd/"])
def test_links_are_fetched_verified_and_cached(server: FileServer, tmp_path: Path, cache: Path, encoding: str) -> None:
    data = os.urandom(100_000) + bytes(100_000)
    server.files["/w.bin"] = data
    path = _linked_carton(tmp_path, [server.url(f"/{encoding}w.bin")], data)
    opened = open_carton(path)
    assert (opened.model_dir / "weights.bin").read_bytes() == data
    assert blob_path(cache, hashlib.sha256(data).hexdigest()).read_bytes() == data
    sent = server.bytes_sent
    carton.verify(path, fetch_links=True)
    assert server.bytes_sent == sent  # served from the cache


def test_links_try_every_url_and_keep_nothing_bad(server: FileServer, tmp_path: Path, cache: Path) -> None:
    data = b"the real weights" * 1000
    server.files["/wrong.bin"] = b"something else"
    path = _linked_carton(tmp_path, [server.url("/404.bin"), server.url("/wrong.bin"), server.url("/slow/w.bin")],
                          data)  # fmt: skip
    limits = carton.ReadLimits(http_timeout=0.5)
    with pytest.raises(LinkError) as caught:
        open_carton(path, limits=limits)
    message = str(caught.value)
    assert "model/weights.bin" in message and "HTTP 404" in message and "timed out" in message
    assert f"served bytes with sha256 {hashlib.sha256(b'something else').hexdigest()}" in message
    blobs = cache / "blobs" / "sha256"
    assert not blobs.exists() or list(blobs.iterdir()) == []
    assert list((cache / "models").iterdir()) == []


def test_links_info_needs_no_download(server: FileServer, tmp_path: Path, cache: Path) -> None:
    path = _linked_carton(tmp_path, [server.url("/never.bin")], b"abc")
    assert carton.get_model_info(path).manifest["model/weights.bin"] == hashlib.sha256(b"abc").hexdigest()
    assert server.requests == []
