"""``python -m carton.server._proto``: regenerate the committed ``kserve_v2_pb2.py`` after editing the .proto."""

from pathlib import Path

from ._generate import generate

print(generate(Path(__file__).resolve().parents[3]))
