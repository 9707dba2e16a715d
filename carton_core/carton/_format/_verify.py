"""`carton verify`: read every file of a carton, check each against MANIFEST, parse every TOML, load every tensor."""

from __future__ import annotations

import os
from collections.abc import Callable

from .. import _paths
from ._info import CartonInfo
from ._limits import DEFAULT_LIMITS, ReadLimits
from ._reader import build_info, located, open_reader
from ._tensor_data import INDEX_PATH, load_tensor, parse_index

__all__ = ["verify"]


def verify(
    path_or_url: str | os.PathLike[str],
    *,
    fetch_links: bool = False,
    limits: ReadLimits | None = None,
    on_file: Callable[[str, str], None] | None = None,
) -> CartonInfo:
    """Check a whole carton; raises the `carton.FormatError` subclass naming the first bad file.

    Every file in the zip (or directory) is streamed and hashed. Files only reachable through LINKS are fetched
    and checked when ``fetch_links`` is true and skipped otherwise. ``on_file(path, status)`` reports progress
    (status ``"ok"``, or ``"linked"`` for a file that was not checked), once carton.toml has been read.
    """
    limits = limits or DEFAULT_LIMITS
    with open_reader(path_or_url, limits, _paths.cache_dir()) as reader:
        # carton.toml first: a folder that is not a carton is refused before any of its files is reported "ok".
        info = build_info(reader, read=lambda p: reader.read(p, limits.max_total_size))
        for path in sorted(reader.manifest):
            if path in reader.present or fetch_links:
                reader.verify_file(path)
                status = "ok"
            else:
                status = "linked"
            if on_file is not None:
                on_file(path, status)
        if INDEX_PATH in reader.manifest:
            with located(reader.location):
                index = parse_index(reader.read(INDEX_PATH), limits.max_toml_depth)
                for name, entry in index.items():
                    files = [entry.file] if entry.file else []
                    if fetch_links or all(f"tensor_data/{f}" in reader.present for f in files):
                        load_tensor(index, name, lambda p: reader.read(p, limits.max_total_size), limits.max_toml_depth)
    return info
