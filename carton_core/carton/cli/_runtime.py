"""``carton runners``, ``carton selftest PATH`` and ``carton infer PATH --input NAME=FILE ...``."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from carton_protocol import OptValue, Tensor

from .._runtime import Model, discover, target_triple
from .._workflows import load
from ..errors import InvalidInput, InvalidOutput

__all__ = ["register"]

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def register(subparsers: Any) -> None:
    """Add ``carton runners``, ``selftest`` and ``infer`` to the ``carton`` parser's `subparsers` (called by
    `build_parser`)."""
    runners = subparsers.add_parser(
        "runners",
        help="list the runners installed plugins and runner environments provide",
        description=(
            "List every runner that resolution can choose from: its name, framework version, runner compat "
            "version, supported platforms (empty = any), whether it serves requests concurrently, and where it "
            "comes from (a plugin's entry point and distribution, or a runner environment's folder). Plugins "
            "that failed to load are listed after the table."
        ),
    )
    runners.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    runners.set_defaults(func=_runners)

    selftest = subparsers.add_parser(
        "selftest",
        help="run a carton's [[self_test]] entries",
        description=(
            "Load the carton, run each [[self_test]] entry of its carton.toml and compare the outputs with the "
            "expected ones (numpy.allclose for floats, exact for everything else). Exit status 0 when every test "
            "passes (or there are none), 1 when one fails."
        ),
    )
    _add_load_arguments(selftest)
    selftest.add_argument("--json", action="store_true", help="print the results as JSON")
    selftest.set_defaults(func=_selftest)

    infer = subparsers.add_parser(
        "infer",
        help="run one inference from the shell",
        description=(
            "Load the carton and run one inference. Inputs are numpy files: NAME=FILE.npy for an array (string "
            "tensors as numpy str arrays), NAME=FILE.npz for a nested tensor (its arrays, in order 0, 1, ...). "
            "Give FILE alone (no NAME=) to pass inputs positionally, in the model's declared order. Outputs are "
            "printed; with --output-dir each is also saved as NAME.npy (nested: NAME.npz)."
        ),
    )
    _add_load_arguments(infer)
    infer.add_argument(
        "--input", "-i", action="append", default=[], metavar="NAME=FILE", help="an input tensor (repeatable)"
    )
    infer.add_argument("--output-dir", "-o", type=Path, metavar="DIR", help="save every output to DIR")
    infer.add_argument("--timeout", type=float, metavar="SECONDS", help="time limit for the inference")
    infer.set_defaults(func=_infer)


def _add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="a .carton file, an unpacked carton folder, or an http(s) URL")
    parser.add_argument(
        "--runner-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='override a runner option; VALUE is read as a TOML value (2, 1.5, true, "text", [1, 2], '
        "{a = 1}) and otherwise taken as a plain string (repeatable)",
    )
    parser.add_argument("--runner-name", metavar="NAME", help="use this runner instead of carton.toml's")
    parser.add_argument(
        "--framework-version", metavar="REQ", help="use this Cargo-style framework version requirement instead"
    )
    parser.add_argument(
        "--sandbox",
        choices=("none", "best_effort", "strict"),
        default=None,
        help="isolation policy of the runner process (default: none)",
    )


# --- carton runners ------------------------------------------------------------------------------------------------


def _runners(args: argparse.Namespace) -> int:
    discovery = discover()
    rows = [
        {
            "runner_name": spec.runner_name,
            "framework_version": spec.framework_version,
            "runner_compat_version": spec.runner_compat_version,
            "supported_platforms": list(spec.supported_platforms),
            "concurrent": spec.concurrent,
            "python": spec.python,
            "environment": spec.environment,
            "source": spec.source,
        }
        for spec in sorted(discovery.runners, key=lambda s: (s.runner_name, s.framework_version, s.source))
    ]
    problems = [{"plugin": p.plugin, "message": p.message} for p in discovery.problems]
    if args.json:
        print(json.dumps({"host": target_triple(), "runners": rows, "skipped_plugins": problems}, indent=2))
        return 0
    print(f"host platform: {target_triple()}")
    if not rows:
        print("no runners installed (no plugin in the 'carton' entry-point group declares one)")
    else:
        table = [("NAME", "FRAMEWORK", "COMPAT", "PLATFORMS", "CONCURRENT", "SOURCE")]
        table += [
            (
                str(row["runner_name"]),
                str(row["framework_version"]),
                str(row["runner_compat_version"]),
                ", ".join(row["supported_platforms"]) or "any",  # type: ignore[arg-type]
                "yes" if row["concurrent"] else "no",
                str(row["source"]),
            )
            for row in rows
        ]
        widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
        for line in table:
            print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False)) + "  " + line[-1])
    for problem in discovery.problems:
        print(f"skipped {problem}", file=sys.stderr)
    return 0


# --- shared: loading -------------------------------------------------------------------------------------------------


def _parse_opt(text: str) -> tuple[str, OptValue]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise InvalidInput(f"--runner-opt {text!r} is not KEY=VALUE")
    try:
        value: OptValue = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def _load(args: argparse.Namespace) -> Model:
    opts = dict(_parse_opt(text) for text in args.runner_opt)
    return load(
        args.path,
        runner_opts=opts or None,
        override_runner_name=args.runner_name,
        override_required_framework_version=args.framework_version,
        sandbox=args.sandbox,
    )


# --- carton selftest -------------------------------------------------------------------------------------------------


def _selftest(args: argparse.Namespace) -> int:
    with _load(args) as model:
        results = model.run_self_tests()
    if args.json:
        print(json.dumps([
            {"index": r.index, "name": r.name, "passed": r.passed, "checked": list(r.checked),
             "failures": list(r.failures)}
            for r in results
        ], indent=2))  # fmt: skip
    elif not results:
        print(f"{args.path}: no [[self_test]] entries")
    else:
        for result in results:
            print(result)
        passed = sum(r.passed for r in results)
        print(f"{passed} of {len(results)} self test(s) passed")
    return 0 if all(r.passed for r in results) else 1


# --- carton infer ----------------------------------------------------------------------------------------------------


_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"


def _read_tensor(argument: str, path: Path) -> Tensor:
    # numpy takes a file that is neither .npy nor .npz for a pickle and suggests allow_pickle=True: the format is
    # checked here first, and pickles are never read.
    try:
        with path.open("rb") as stream:
            magic = stream.read(len(_NPY_MAGIC))
    except FileNotFoundError:
        raise InvalidInput(f"--input {argument}: {path} does not exist") from None
    except OSError as exc:
        raise InvalidInput(f"--input {argument}: {path} cannot be read: {exc.strerror}") from exc
    kind = ".npz" if path.suffix == ".npz" or magic.startswith(_ZIP_MAGIC) else ".npy"
    if not magic.startswith(_ZIP_MAGIC if kind == ".npz" else _NPY_MAGIC):
        expected = "a zip archive of .npy files" if kind == ".npz" else "it does not start with the .npy header"
        raise InvalidInput(f"--input {argument}: {path} is not a valid {kind} file ({expected})")
    try:
        if kind == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                keys = sorted(archive.files, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
                return [np.asarray(archive[key]) for key in keys]
        value = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        if "allow_pickle" in str(exc):
            raise InvalidInput(
                f"--input {argument}: {path} holds Python objects (dtype object); carton reads numeric, bool and "
                "string arrays only"
            ) from None
        raise InvalidInput(f"--input {argument}: {path} is not a valid {kind} file: {exc}") from exc
    if not isinstance(value, np.ndarray):
        raise InvalidInput(f"--input {argument}: {path} holds several arrays; use .npz for a nested tensor")
    return value


def _read_inputs(arguments: list[str]) -> dict[str, Tensor] | list[Tensor]:
    named: dict[str, Tensor] = {}
    positional: list[Tensor] = []
    for argument in arguments:
        name, sep, file = argument.partition("=")
        if sep and name:
            if name in named:
                raise InvalidInput(f"--input {name} is given twice")
            named[name] = _read_tensor(argument, Path(file))
        else:
            positional.append(_read_tensor(argument, Path(argument)))
    if named and positional:
        raise InvalidInput("give every --input as NAME=FILE, or every one as FILE (positional), not a mix")
    return positional if positional else named


def _describe(value: Tensor) -> str:
    if isinstance(value, list):
        inner = ", ".join(f"{a.dtype}{list(a.shape)}" for a in value)
        return f"nested tensor of {len(value)}: [{inner}]"
    text = np.array2string(value, threshold=64, edgeitems=3, max_line_width=110)
    dtype = "str" if value.dtype.kind == "U" else str(value.dtype)
    return f"{dtype} {list(value.shape)}\n{text}"


def _save(directory: Path, name: str, value: Tensor) -> Path:
    # Output names come from the model: never let one pick a path outside the directory.
    if not _SAFE_NAME.match(name) or name in (".", ".."):
        raise InvalidOutput(f"output {name!r} cannot be saved under that name (letters, digits, _ . - only)")
    if isinstance(value, list):
        target = directory / f"{name}.npz"
        arrays: dict[str, Any] = {str(i): array for i, array in enumerate(value)}
        np.savez(target, allow_pickle=False, **arrays)
    else:
        target = directory / f"{name}.npy"
        np.save(target, value, allow_pickle=False)
    return target


def _infer(args: argparse.Namespace) -> int:
    inputs = _read_inputs(args.input)
    with _load(args) as model:
        outputs = model.infer(inputs, timeout=args.timeout)
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, value in outputs.items():
        print(f"{name}: {_describe(value)}")
        if args.output_dir is not None:
            print(f"  saved to {_save(args.output_dir, name, value)}")
    return 0
