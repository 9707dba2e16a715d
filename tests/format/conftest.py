"""Fixtures for the package-format tests: a private cache, a small model folder, and a local HTTP file server.

The server (127.0.0.1 only) serves ``files`` (a dict path -> bytes) with:
- Range requests (``bytes=a-b`` and suffix ``bytes=-n``), unless the path is under ``/norange/``;
- content encoding chosen by the path prefix ``/gzip/``, ``/deflate/``, ``/br/``, ``/zstd/`` (full bodies only);
- ``/slow/...`` waiting longer than any test timeout before answering; unknown paths answer 404.
It counts the body bytes it sent, so tests can check how much of a file a reader fetched.
"""

from __future__ import annotations

import gzip
import http.server
import os
import re
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import brotli
import pytest
from backports import zstd

sys.path.insert(0, str(Path(__file__).parent))

_ENCODERS = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "br": brotli.compress,
    "zstd": zstd.compress,
}


class FileServer:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.bytes_sent = 0
        self.requests: list[tuple[str, str | None]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return None

            def do_GET(self) -> None:
                path = self.path
                server.requests.append((path, self.headers.get("Range")))
                parts = path.strip("/").split("/", 1)
                prefix = parts[0] if len(parts) == 2 else ""
                key = "/" + (parts[1] if prefix in (*_ENCODERS, "norange", "slow") else path.strip("/"))
                if prefix == "slow":
                    time.sleep(1.5)
                body = server.files.get(key)
                if body is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status, headers = 200, {}
                match = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range") or "")
                if match and prefix != "norange" and prefix not in _ENCODERS:
                    first, last = match.groups()
                    size = len(body)
                    if first == "":
                        start, end = max(size - int(last), 0), size - 1
                    else:
                        start, end = int(first), min(int(last) if last else size - 1, size - 1)
                    status = 206
                    headers["Content-Range"] = f"bytes {start}-{end}/{size}"
                    body = body[start : end + 1]
                elif prefix in _ENCODERS:
                    body = _ENCODERS[prefix](body)
                    headers["Content-Encoding"] = prefix
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                # Counted before the write: the client can read the whole body and go on before this thread
                # returns from write, and a test reading the count then must already see it.
                with server._lock:
                    server.bytes_sent += len(body)
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    return

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def server() -> Iterator[FileServer]:
    srv = FileServer()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("CARTON_CACHE_DIR", str(directory))
    return directory


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model_src"
    (directory / "sub").mkdir(parents=True)
    (directory / "weights.bin").write_bytes(os.urandom(50_000) + bytes(50_000))
    (directory / "sub" / "config.json").write_text('{"layers": 2}')
    return directory
