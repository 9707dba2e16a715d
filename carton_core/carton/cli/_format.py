"""``carton info``, ``carton verify``, ``carton pack`` and ``carton shrink``."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

from carton_protocol import DType, OptValue, Shape, TensorSpec

from .._format import CartonInfo, get_model_info, shrink, verify
from .._format._info import MiscRef, TensorRef
from .._workflows import pack
from ..errors import PackError

__all__ = ["info_to_json", "register"]

_SHA256 = re.compile(r"[0-9a-f]{64}")


def register(subparsers: Any) -> None:
    """Add ``carton info``, ``verify``, ``pack`` and ``shrink`` to the ``carton`` parser's `subparsers` (called
    by `build_parser`)."""
    info = subparsers.add_parser(
        "info",
        help="show a carton's metadata (reads no model bytes)",
        description="Show everything carton.toml says about a carton, its model hash and its files. Works on a "
        ".carton file, an unpacked carton directory or an http(s) URL (read with range requests).",
    )
    info.add_argument("path", metavar="PATH|URL", help=".carton file, unpacked carton directory, or http(s) URL")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(func=_info)

    check = subparsers.add_parser(
        "verify",
        help="check every file of a carton against its MANIFEST",
        description="Read every file of a carton, check each against MANIFEST, parse carton.toml and "
        "tensor_data, and load every tensor. Exits 0 when the carton is valid, 1 naming the first bad file. Files "
        "listed in LINKS are checked only with --fetch-links; without it they are listed as 'linked' and said to be "
        "unchecked.",
    )
    check.add_argument("path", metavar="PATH|URL", help=".carton file, unpacked carton directory, or http(s) URL")
    check.add_argument("--fetch-links", action="store_true", help="also download and check files listed in LINKS")
    check.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    check.set_defaults(func=_verify)

    packer = subparsers.add_parser(
        "pack",
        help="pack a model folder into a .carton file",
        description="Pack MODEL_DIR (it becomes the carton's model/ folder) into a .carton file. Unless "
        "--no-validate is given, the runner checks the folder in a runner process and supplies the compat "
        "version and, when none are given, the inputs and outputs.",
    )
    packer.add_argument("model_dir", metavar="MODEL_DIR", type=Path, help="the model folder")
    packer.add_argument("-o", "--output", type=Path, help="output .carton path (default: MODEL_DIR.carton)")
    packer.add_argument("--runner", required=True, dest="runner_name", help="runner name, e.g. onnxruntime")
    packer.add_argument(
        "--framework-version", required=True, help="required framework version (Cargo semver requirement, e.g. =1.17)"
    )
    packer.add_argument("--compat-version", type=int, help="runner_compat_version (required with --no-validate)")
    packer.add_argument("--name", help="model name")
    packer.add_argument("--description", help="model description (markdown)")
    packer.add_argument("--platform", action="append", default=[], help="required target triple (repeatable)")
    packer.add_argument(
        "--input", action="append", default=[], metavar="NAME:DTYPE[:SHAPE]",
        help="declare an input; SHAPE is '*' (default), a symbol, or a list like '[batch,3]' ('[]' is a scalar)",
    )  # fmt: skip
    packer.add_argument("--output-spec", action="append", default=[], metavar="NAME:DTYPE[:SHAPE]",
                        help="declare an output, same syntax as --input")  # fmt: skip
    packer.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='runner option; VALUE is read as a TOML value (42, true, 1.5, "text") or as text',
    )
    packer.add_argument("--misc", action="append", default=[], metavar="NAME=FILE", help="add a misc file")
    packer.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="SHA256=URL",
        help="leave the file with this sha256 out of the zip and list URL for it in LINKS",
    )
    packer.add_argument("--compression", choices=("zstd", "deflate", "stored"), default="zstd",
                        help="zip compression of every entry but MANIFEST (default: zstd)")  # fmt: skip
    packer.add_argument("--no-validate", action="store_true", help="do not run the runner's packing step")
    packer.set_defaults(func=_pack)

    shrinker = subparsers.add_parser(
        "shrink",
        help="move files of a carton out to URLs (LINKS), keeping the model hash",
        description="Copy PATH to OUTPUT leaving out the files whose sha256 is given with --link; LINKS records "
        "where to fetch them. MANIFEST, and so the model hash, is unchanged.",
    )
    shrinker.add_argument("path", metavar="PATH", type=Path, help="the .carton file to shrink")
    shrinker.add_argument("output", metavar="OUTPUT", type=Path, help="where to write the shrunk carton")
    shrinker.add_argument("--link", action="append", default=[], required=True, metavar="SHA256=URL",
                          help="a file to move out and one URL it can be fetched from (repeatable)")  # fmt: skip
    shrinker.set_defaults(func=_shrink)


# --- info -----------------------------------------------------------------------------------------------------
def _shape_text(shape: Shape) -> str:
    return shape if isinstance(shape, str) else "[" + ", ".join(str(d) for d in shape) + "]"


def _ref_json(ref: TensorRef | MiscRef) -> str:
    return f"@misc/{ref.name}" if isinstance(ref, MiscRef) else f"@tensor_data/{ref.name}"


def info_to_json(info: CartonInfo) -> dict[str, Any]:
    """`info` as the JSON document ``carton info --json`` prints: carton.toml's fields, the model hash and the files."""

    def spec(s: TensorSpec) -> dict[str, Any]:
        return {"name": s.name, "dtype": str(s.dtype), "shape": s.shape if isinstance(s.shape, str) else
                list(s.shape), "description": s.description, "internal_name": s.internal_name}  # fmt: skip

    return {
        "spec_version": info.spec_version,
        "model_name": info.model_name,
        "model_description": info.model_description,
        "short_description": info.short_description,
        "license": info.license,
        "repository": info.repository,
        "homepage": info.homepage,
        "required_platforms": list(info.required_platforms),
        "inputs": [spec(s) for s in info.inputs],
        "outputs": [spec(s) for s in info.outputs],
        "self_tests": [
            {
                "name": t.name,
                "description": t.description,
                "inputs": {k: _ref_json(v) for k, v in t.inputs.items()},
                "expected_out": None
                if t.expected_out is None
                else {k: _ref_json(v) for k, v in t.expected_out.items()},
            }
            for t in info.self_tests
        ],
        "examples": [
            {
                "name": e.name,
                "description": e.description,
                "inputs": {k: _ref_json(v) for k, v in e.inputs.items()},
                "sample_out": {k: _ref_json(v) for k, v in e.sample_out.items()},
            }
            for e in info.examples
        ],
        "runner": {
            "runner_name": info.runner.runner_name,
            "required_framework_version": info.runner.required_framework_version,
            "runner_compat_version": info.runner.runner_compat_version,
            "opts": dict(info.runner.opts),
        },
        "manifest_sha256": info.manifest_sha256,
        "misc_files": list(info.misc_files),
        "files": dict(info.manifest),
    }


def _info(args: argparse.Namespace) -> int:
    info = get_model_info(args.path)
    if args.json:
        json.dump(info_to_json(info), sys.stdout, indent=2)
        print()
        return 0
    rows = [
        ("model", info.model_name or "(unnamed)"),
        ("model hash", info.manifest_sha256),
        ("runner", f"{info.runner.runner_name} {info.runner.required_framework_version} "
                   f"(compat {info.runner.runner_compat_version})"),
        ("platforms", ", ".join(info.required_platforms) or "any"),
        ("runner opts", ", ".join(f"{k}={v!r}" for k, v in info.runner.opts.items()) or "none"),
        ("self tests", str(len(info.self_tests))),
        ("examples", str(len(info.examples))),
        ("misc files", ", ".join(info.misc_files) or "none"),
        ("files", str(len(info.manifest))),
    ]  # fmt: skip
    for key, value in rows:
        print(f"{key:<12} {value}")
    for title, specs in (("inputs", info.inputs), ("outputs", info.outputs)):
        print(f"{title}:" if specs else f"{title}: (not declared)")
        for s in specs:
            extra = f"  # {s.description}" if s.description else ""
            print(f"  {s.name:<20} {s.dtype!s:<8} {_shape_text(s.shape)}{extra}")
    if info.model_description:
        print("\n" + info.model_description.strip())
    return 0


# --- verify ---------------------------------------------------------------------------------------------------
def _verify(args: argparse.Namespace) -> int:
    unchecked: list[str] = []

    def report(path: str, status: str) -> None:
        if status == "linked":
            unchecked.append(path)
        if not args.quiet:
            print(f"{status:<6} {path}")

    info = verify(args.path, fetch_links=args.fetch_links, on_file=report)
    if unchecked:
        # Not "valid": what LINKS points at was neither downloaded nor hashed.
        files = f"{len(unchecked)} linked file{'s' if len(unchecked) > 1 else ''} ({', '.join(unchecked[:3])}"
        files += ", ...)" if len(unchecked) > 3 else ")"
        verb = "were" if len(unchecked) > 1 else "was"
        print(
            f"carton: {files} {verb} not checked; give --fetch-links to download and check "
            f"{'them' if len(unchecked) > 1 else 'it'}",
            file=sys.stderr,
        )
        if not args.quiet:
            print(f"every file in the carton is valid, model hash {info.manifest_sha256}")
    elif not args.quiet:
        print(f"valid carton, model hash {info.manifest_sha256}")
    return 0


# --- pack / shrink --------------------------------------------------------------------------------------------
def _parse_spec(text: str, flag: str) -> TensorSpec:
    name, _, rest = text.partition(":")
    dtype, _, shape_text = rest.partition(":")
    if not name or not dtype:
        raise PackError(f"{flag} {text!r}: expected NAME:DTYPE[:SHAPE]")
    try:
        parsed_dtype = DType(dtype)
    except ValueError:
        raise PackError(f"{flag} {text!r}: {dtype!r} is not a carton dtype") from None
    shape: Shape = shape_text or "*"
    if shape_text.startswith("["):
        if not shape_text.endswith("]"):
            raise PackError(f"{flag} {text!r}: a list shape must end with ']'")
        inner = [d.strip() for d in shape_text[1:-1].split(",") if d.strip()]
        shape = tuple(int(d) if d.isdigit() else d for d in inner)
    return TensorSpec(name=name, dtype=parsed_dtype, shape=shape)


def _parse_pairs(values: list[str], flag: str) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key:
            raise PackError(f"{flag} {value!r}: expected KEY=VALUE")
        pairs.append((key, rest))
    return pairs


def _opt_value(text: str) -> OptValue:
    try:
        value: OptValue = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return value


def _links(values: list[str]) -> dict[str, list[str]]:
    links: dict[str, list[str]] = {}
    for digest, url in _parse_pairs(values, "--link"):
        if not _SHA256.fullmatch(digest):
            raise PackError(f"--link {digest}={url}: {digest!r} is not a lowercase sha256")
        links.setdefault(digest, []).append(url)
    return links


def _pack(args: argparse.Namespace) -> int:
    output = args.output or Path(f"{args.model_dir.resolve().name}.carton")
    path = pack(
        args.model_dir,
        output,
        runner_name=args.runner_name,
        required_framework_version=args.framework_version,
        runner_compat_version=args.compat_version,
        model_name=args.name,
        model_description=args.description,
        required_platforms=args.platform,
        inputs=[_parse_spec(s, "--input") for s in args.input] or None,
        outputs=[_parse_spec(s, "--output-spec") for s in args.output_spec] or None,
        misc_files={name: Path(file) for name, file in _parse_pairs(args.misc, "--misc")},
        linked_files=_links(args.link),
        runner_opts={key: _opt_value(value) for key, value in _parse_pairs(args.opt, "--opt")},
        compression=args.compression,
        validate=not args.no_validate,
    )
    print(f"{path}  model hash {get_model_info(path).manifest_sha256}")
    return 0


def _shrink(args: argparse.Namespace) -> int:
    path = shrink(args.path, _links(args.link), args.output)
    print(f"{path}  model hash {get_model_info(path).manifest_sha256}")
    return 0
