"""``python -m carton.server._proto``: generate ``kserve_v2_pb2.py`` in place (what the build backend does)."""

from pathlib import Path

from ._generate import generate

print(generate(Path(__file__).resolve().parents[3]))
