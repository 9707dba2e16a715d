"""`carton.pack`: serialize a model object if needed, validate the folder in a runner process, write the carton.

A workflow over the package format (`carton._format`, which writes the file) and the runtime (`carton._runtime`,
which serializes model objects through the plugins and runs the runner's own ``pack`` step in a runner process).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from carton_protocol import OptValue, TensorSpec

from .._format import (
    CartonContents,
    RunnerInfo,
    SelfTest,
    check_links,
    check_specs,
    compression_method,
    default_output,
    write_carton,
)
from .._runtime import pack_in_runner, serialize_model, target_triple
from .._warnings import warn_user
from ..errors import PackError, PlatformWarning

__all__ = ["pack"]


def pack(
    model_dir_or_object: str | os.PathLike[str] | object,
    output: str | os.PathLike[str] | None = None,
    *,
    runner_name: str,
    required_framework_version: str,
    runner_compat_version: int | None = None,
    model_name: str | None = None,
    model_description: str | None = None,
    short_description: str | None = None,
    license: str | None = None,
    repository: str | None = None,
    homepage: str | None = None,
    required_platforms: Sequence[str] = (),
    inputs: Sequence[TensorSpec] | None = None,
    outputs: Sequence[TensorSpec] | None = None,
    self_tests: Sequence[SelfTest | Mapping[str, Any]] = (),
    examples: Sequence[Any] = (),
    misc_files: Mapping[str, bytes | os.PathLike[str]] | None = None,
    linked_files: Mapping[str, Sequence[str]] | None = None,
    runner_opts: Mapping[str, OptValue] | None = None,
    compression: str = "zstd",
    validate: bool = True,
) -> Path:
    """Pack a model folder (or an in-memory model object) into a .carton file and return its path.

    ``validate=True`` runs the runner's own packing step in a runner process (it checks the folder, may fill in
    ``inputs``/``outputs`` and options, and supplies ``runner_compat_version``); with ``validate=False`` nothing
    runs and ``runner_compat_version`` must be given. Self tests are ``{"name", "description", "inputs",
    "expected_out"}`` mappings, examples ``{"name", "description", "inputs", "sample_out"}``; tensors are numpy
    arrays, strings, (nested) lists, or lists of arrays for nested tensors; example values may also be misc files
    (bytes or a path). ``linked_files`` maps sha256 to URLs: files with those hashes are left out of the zip and
    listed in LINKS. ``output=None`` writes ``<model_dir>.carton`` beside a model folder (a model object needs an
    explicit ``output``). Raises `carton.PackError`.
    """
    method = compression_method(compression)
    _warn_if_foreign(required_platforms)
    inputs_t, outputs_t = check_specs("inputs", inputs), check_specs("outputs", outputs)
    is_folder = isinstance(model_dir_or_object, str | os.PathLike)
    if output is None and not is_folder:
        raise PackError("pack(model_object): output= is required (there is no model folder to write beside)")
    check_links(linked_files)
    destination = Path(output) if output is not None else default_output(Path(model_dir_or_object))  # type: ignore[arg-type]
    opts: dict[str, OptValue] = dict(runner_opts or {})
    with tempfile.TemporaryDirectory(prefix="carton-pack-") as staging_name:
        staging = Path(staging_name) / "model"
        if is_folder:
            model_dir = Path(model_dir_or_object)  # type: ignore[arg-type]
            if not model_dir.is_dir():
                raise PackError(f"{model_dir}: not a directory (pack takes a model folder or a model object)")
        else:
            staging.mkdir()
            recorded = serialize_model(model_dir_or_object, runner_name=runner_name, model_dir=staging)
            opts = {**dict(recorded or {}), **opts}
            model_dir = staging
        if validate:
            if model_dir != staging:
                # The runner's pack step may rewrite files: give it a copy, never the caller's folder.
                shutil.copytree(model_dir, staging, symlinks=False)
                model_dir = staging
            try:
                packed = pack_in_runner(
                    runner_name=runner_name,
                    required_framework_version=required_framework_version,
                    model_dir=model_dir,
                    opts=opts,
                    inputs=inputs_t,
                    outputs=outputs_t,
                )
            except PackError as exc:
                # The runner saw our private copy; name the caller's folder (or object) instead.
                shown = str(Path(model_dir_or_object)) if is_folder else "the serialized model object"  # type: ignore[arg-type]
                message = str(exc).replace(str(staging.resolve()), shown).replace(str(staging), shown)
                raise PackError(message) from exc
            inputs_t = inputs_t or tuple(packed.result.inputs)
            outputs_t = outputs_t or tuple(packed.result.outputs)
            opts = dict(packed.result.opts)
            if runner_compat_version is None:
                runner_compat_version = packed.runner.runner_compat_version
        if runner_compat_version is None:
            raise PackError("runner_compat_version is required when validate=False (no runner is asked for it)")
        if isinstance(runner_compat_version, bool) or not isinstance(runner_compat_version, int):
            raise PackError(f"runner_compat_version must be an int, not {type(runner_compat_version).__name__}")
        contents = CartonContents(
            runner=RunnerInfo(runner_name=runner_name, required_framework_version=required_framework_version,
                              runner_compat_version=runner_compat_version, opts=opts),
            metadata={"model_name": model_name, "short_description": short_description,
                      "model_description": model_description, "license": license, "repository": repository,
                      "homepage": homepage},
            required_platforms=tuple(required_platforms),
            inputs=inputs_t,
            outputs=outputs_t,
            self_tests=self_tests,
            examples=examples,
            misc_files=misc_files or {},
            linked_files=linked_files or {},
        )  # fmt: skip
        write_carton(destination, model_dir, contents, method=method)
    return destination


def _warn_if_foreign(required_platforms: Sequence[str]) -> None:
    """Packing for other machines is legitimate, but a carton this machine cannot load is worth saying at once."""
    if not required_platforms:
        return
    host = target_triple()
    if host not in required_platforms:
        warn_user(
            f"required_platforms allows only {', '.join(required_platforms)} and this machine is {host}: the carton "
            f"will not load here (add {host} to required_platforms to load it on this machine too)",
            PlatformWarning,
        )
