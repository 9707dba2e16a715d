"""Tensor-file speed: carton.safetensors against the reference `safetensors` package, and the MCF container/converter.

    python bench/bench_tensorfiles.py [--mb 256] [--repeat 5]

Every row times carton and the reference on the same data in the same run and prints the ratio (reference time /
carton time: above 1 means carton is faster). Files live in a temporary directory; the page cache is warm (each
measurement is the best of --repeat runs), so load numbers measure parsing and mapping, not the disk.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import carton.mcf as mcf
import carton.safetensors as st
import numpy as np
import safetensors.numpy as ref
from carton.mcf._convert import convert
from safetensors import safe_open as ref_safe_open


def best(fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def llama_like(total_mb: int) -> dict[str, np.ndarray]:
    """Tensors shaped like a small llama: per layer 4 attention + 3 MLP matrices and 2 norms."""
    rng = np.random.default_rng(0)
    hidden, inter = 1024, 2816
    per_layer = (4 * hidden * hidden + 3 * hidden * inter) * 4
    layers = max(1, total_mb * 2**20 // per_layer)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((4096, hidden), dtype=np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{p}.self_attn.{name}.weight"] = rng.standard_normal((hidden, hidden), dtype=np.float32)
        tensors[f"{p}.mlp.gate_proj.weight"] = rng.standard_normal((inter, hidden), dtype=np.float32)
        tensors[f"{p}.mlp.up_proj.weight"] = rng.standard_normal((inter, hidden), dtype=np.float32)
        tensors[f"{p}.mlp.down_proj.weight"] = rng.standard_normal((hidden, inter), dtype=np.float32)
        tensors[f"{p}.input_layernorm.weight"] = np.ones(hidden, np.float32)
        tensors[f"{p}.post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    return tensors


def touch(arrays: dict[str, np.ndarray]) -> float:
    return float(sum(float(a.reshape(-1)[::1024].sum()) for a in arrays.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="approximate model size in MiB")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (best is reported)")
    args = parser.parse_args()
    tensors = llama_like(args.mb)
    size = sum(a.nbytes for a in tensors.values())
    rows: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        ours_path, ref_path = Path(tmp, "ours.safetensors"), Path(tmp, "ref.safetensors")
        # Each save writes a new file (the old one is deleted untimed): freeing the pages of a replaced file
        # would otherwise dominate.
        rows.append(
            (
                "save_file (new file)",
                best(lambda: st.save_file(tensors, ours_path), args.repeat, lambda: ours_path.unlink(missing_ok=True)),
                best(lambda: ref.save_file(tensors, ref_path), args.repeat, lambda: ref_path.unlink(missing_ok=True)),
            )
        )
        assert ours_path.read_bytes() == ref_path.read_bytes()
        rows.append(
            (
                "load_file (open + map every tensor)",
                best(lambda: st.load_file(ours_path), args.repeat),
                best(lambda: ref.load_file(ref_path), args.repeat),
            )
        )
        rows.append(
            (
                "load_file + read every 1024th value",
                best(lambda: touch(st.load_file(ours_path)), args.repeat),
                best(lambda: touch(ref.load_file(ref_path)), args.repeat),
            )
        )
        name = "model.layers.0.mlp.up_proj.weight"

        def ours_one() -> object:
            with st.safe_open(ours_path) as f:
                return f.get_tensor(name)

        def ref_one() -> object:
            with ref_safe_open(ref_path, "np") as f:
                return f.get_tensor(name)

        rows.append(
            ("safe_open + get_tensor (one 11 MiB tensor)", best(ours_one, args.repeat), best(ref_one, args.repeat))
        )

        def ours_slice() -> object:
            with st.safe_open(ours_path) as f:
                return f.get_slice(name)[:16]

        def ref_slice() -> object:
            with ref_safe_open(ref_path, "np") as f:
                return f.get_slice(name)[:16]

        rows.append(("safe_open + get_slice[:16]", best(ours_slice, args.repeat), best(ref_slice, args.repeat)))

        mcf_path = Path(tmp, "m.mcf")
        mcf.write_mcf(mcf_path, tensors=tensors)

        def mcf_open_all() -> object:
            with mcf.open(mcf_path) as f:
                return [f.array(n) for n in f.tensors]

        mcf_time = best(mcf_open_all, args.repeat)
        rows.append(("MCF open + map every tensor (ref: safetensors load_file)", mcf_time, rows[1][2]))
        model = Path(tmp, "model")
        model.mkdir()
        ours_path.rename(model / "model.safetensors")
        start = time.perf_counter()
        convert(model, Path(tmp, "k4.mcf"), methods={"embeddings": "q8", "attention": "k4", "mlp": "k4"})
        convert_time = time.perf_counter() - start
    print(
        f"{len(tensors)} tensors, {size / 2**20:.0f} MiB float32; best of {args.repeat}; "
        f"python {sys.version.split()[0]}"
    )
    print(f"{'operation':<58} {'carton':>10} {'reference':>10} {'ratio':>7}")
    for label, ours, theirs in rows:
        print(f"{label:<58} {ours * 1e3:>8.2f}ms {theirs * 1e3:>8.2f}ms {theirs / ours:>6.2f}x")
    print(
        f"{'convert to MCF (q8 embeddings, k4 attention + mlp), once':<58} {convert_time:>9.2f}s "
        f"{'':>10} {size / 2**20 / convert_time:>5.0f} MiB/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
