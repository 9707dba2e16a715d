"""``carton mcf convert`` and ``carton mcf info``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..mcf import MCFFile, QuantMethod, SectionType
from ..mcf._container import RESOURCE_FILES
from ..mcf._convert import TensorClass, convert

__all__ = ["register"]

_METHOD_CHOICES = ["none", *(m.value for m in QuantMethod)]


def register(subparsers: Any) -> None:
    """Add ``carton mcf convert|info`` to the ``carton`` parser's `subparsers` (called by `build_parser`)."""
    parser = subparsers.add_parser(
        "mcf",
        help="convert Hugging Face safetensors models to MCF and inspect MCF files",
        description="Work with MCF (Model Container Format) files.",
    )
    commands = parser.add_subparsers(dest="mcf_command", metavar="SUBCOMMAND", required=True)

    conv = commands.add_parser(
        "convert",
        help="convert a safetensors model folder (+ config.json, tokenizer files) to one MCF file",
        description=(
            "Convert SRC_DIR (model.safetensors or sharded model-*.safetensors with their index, plus config.json and "
            "tokenizer files when present) into OUT.mcf. Each weight is classified by name as embeddings, attention, "
            "mlp, head, norms or other, and stored with the method chosen for its class; norms, biases and tensors "
            "that are not 2-D stay float. Methods: none (keep float), int8, int4, q8, q4 (blocks of 32), k6, k4, k3, "
            "k2 (super-blocks of 256)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    conv.add_argument("src", metavar="SRC_DIR", help="model folder, or a single .safetensors file")
    conv.add_argument("out", metavar="OUT.mcf", help="MCF file to write (replaced only once complete)")
    defaults = {
        TensorClass.EMBEDDINGS: "q8",
        TensorClass.ATTENTION: "k4",
        TensorClass.MLP: "k4",
        TensorClass.HEAD: "q8",
        TensorClass.OTHER: "none",
    }
    for tensor_class, default in defaults.items():
        conv.add_argument(
            f"--{tensor_class.value}",
            choices=_METHOD_CHOICES,
            default=default,
            help=f"method for {tensor_class.value} weights",
        )
    conv.add_argument(
        "--float-dtype",
        choices=["keep", "f32", "f16", "bf16"],
        default="keep",
        help="storage type of float tensors that are not quantized (norms, biases, classes set to none)",
    )
    conv.add_argument(
        "--mode",
        choices=["best", "reference"],
        default="best",
        help="best: minimise quantization error; reference: byte-identical to the reference Go writer",
    )
    conv.add_argument("--no-dedup", action="store_true", help="store identical tensors twice instead of sharing bytes")
    conv.add_argument("-v", "--verbose", action="store_true", help="print one line per tensor")
    conv.set_defaults(func=_convert)

    info = commands.add_parser(
        "info",
        help="show an MCF file's header, model info, sections and tensors",
        description="Validate FILE and print its structure: header, sections, ModelInfo, resources and tensors.",
    )
    info.add_argument("file", metavar="FILE", help="MCF file to inspect")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    info.add_argument("--tensors", action="store_true", help="list every tensor (text output lists a summary)")
    info.set_defaults(func=_info)


def _convert(args: argparse.Namespace) -> int:
    methods: dict[TensorClass | str, QuantMethod | str | None] = {
        tensor_class: getattr(args, tensor_class.value) for tensor_class in TensorClass if hasattr(args, tensor_class)
    }
    report = convert(
        args.src,
        args.out,
        methods=methods,
        float_dtype=args.float_dtype,
        mode=args.mode,
        dedup=not args.no_dedup,
        progress=(lambda line: print(line, file=sys.stderr)) if args.verbose else None,
    )
    ratio = report.output_bytes / report.source_bytes if report.source_bytes else 0.0
    summary = ", ".join(f"{count} {method}" for method, count in sorted(report.methods.items()))
    print(
        f"wrote {report.path}: {report.tensors} tensors ({summary}), {_size(report.output_bytes)} "
        f"({ratio:.1%} of {_size(report.source_bytes)}), resources: {', '.join(report.resources) or 'none'}, "
        f"{report.seconds:.1f} s"
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    with MCFFile.open(args.file) as f:
        doc = _describe(f)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
        return 0
    header = doc["header"]
    version = f"{header['major']}.{header['minor']}"
    print(f"{args.file}: MCF {version}, {_size(header['file_size'])}, flags {header['flags']}")
    print("sections:")
    for s in doc["sections"]:
        print(f"  {s['type']:<22} v{s['version']}  offset {s['offset']:>12}  size {s['size']:>12}")
    if doc["model_info"] is not None:
        print("model info:")
        for key, value in doc["model_info"].items():
            if key != "kv":
                print(f"  {key}: {value}")
        for key, value in doc["model_info"]["kv"].items():
            print(f"  kv {key}: {value}")
    print(f"tensors: {len(doc['tensors'])} ({_size(doc['tensor_bytes'])} of data)")
    for method, count in sorted(doc["dtype_counts"].items()):
        print(f"  {method}: {count}")
    if args.tensors:
        for t in doc["tensors"]:
            print(f"  {t['name']}  {t['dtype']}  {t['shape']}  offset {t['data_offset']}  size {t['data_size']}")
    return 0


def _describe(f: MCFFile) -> dict[str, Any]:
    info = f.model_info
    tensors = [
        {
            "name": t.name,
            "dtype": t.method.value if t.method is not None else t.dtype.name.lower(),
            "shape": list(t.shape),
            "data_offset": t.data_offset,
            "data_size": t.data_size,
            **(
                {"domain": t.quant.domain.name.lower(), "min_clip": t.quant.min_clip, "max_clip": t.quant.max_clip}
                if t.quant is not None
                else {}
            ),
        }
        for t in f.tensors.values()
    ]
    counts: dict[str, int] = {}
    for entry in f.tensors.values():
        label = entry.method.value if entry.method is not None else entry.dtype.name.lower()
        counts[label] = counts.get(label, 0) + 1
    unique = {(t.data_offset, t.data_size) for t in f.tensors.values()}
    return {
        "header": {
            "major": f.header.major,
            "minor": f.header.minor,
            "file_size": f.header.file_size,
            "flags": f.header.flags,
        },
        "sections": [
            {
                "type": s.known_type.name if s.known_type is not None else f"0x{s.type:04x}",
                "version": s.version,
                "offset": s.offset,
                "size": s.size,
            }
            for s in f.sections
        ],
        "model_info": None
        if info is None
        else {
            "arch": getattr(info.arch, "name", str(info.arch)).lower(),
            "vocab_size": info.vocab_size,
            "hidden_size": info.hidden_size,
            "layer_count": info.layer_count,
            "head_count": info.head_count,
            "kv_head_count": info.kv_head_count,
            "context_length": info.context_length,
            "train_context": info.train_context,
            "rope_type": getattr(info.rope_type, "name", str(info.rope_type)).lower(),
            "rope_freq_base": info.rope_freq_base,
            "rope_scale": info.rope_scale,
            "model_name": info.model_name,
            "base_model": info.base_model,
            "kv": {k: v if not isinstance(v, bytes) else v.hex() for k, v in info.kv.items()},
        },
        "resources": [name for stype, name in RESOURCE_FILES.items() if f.section(SectionType(stype)) is not None],
        "tensor_bytes": sum(size for _, size in unique),
        "dtype_counts": counts,
        "tensors": tensors,
    }


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
