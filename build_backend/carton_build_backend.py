"""carton's PEP 517 build backend: setuptools' own, after generating the gRPC stubs of the model server.

pyproject.toml names it with ``backend-path = ["build_backend"]``. Before a wheel or an editable install is built it
runs protoc (``grpcio-tools``, a build requirement) on ``carton_core/carton/server/_proto/kserve_v2.proto``, writing
``kserve_v2_pb2.py`` beside it (git-ignored), so an installed carton and ``pip install -e .`` both have the module and
nothing generated is committed. Every other hook is setuptools.build_meta's, unchanged.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (re-export every hook setuptools provides)

_ROOT = Path(__file__).resolve().parent.parent
_SOURCE_ROOT = _ROOT / "carton_core"
_GENERATOR = _SOURCE_ROOT / "carton" / "server" / "_proto" / "_generate.py"


def _generate_stubs() -> None:
    # Loaded by path: carton itself is not importable while it is being built.
    spec = importlib.util.spec_from_file_location("_carton_proto_generate", _GENERATOR)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {_GENERATOR}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(_SOURCE_ROOT)


def build_wheel(
    wheel_directory: str, config_settings: dict[str, Any] | None = None, metadata_directory: str | None = None
) -> str:
    _generate_stubs()
    return str(_setuptools.build_wheel(wheel_directory, config_settings, metadata_directory))


def build_editable(
    wheel_directory: str, config_settings: dict[str, Any] | None = None, metadata_directory: str | None = None
) -> str:
    _generate_stubs()
    return str(_setuptools.build_editable(wheel_directory, config_settings, metadata_directory))


def build_sdist(sdist_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    # The sdist carries the .proto and this backend, not the generated module: building a wheel from it generates.
    return str(_setuptools.build_sdist(sdist_directory, config_settings))
