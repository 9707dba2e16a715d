"""Package-format benchmark: get_model_info latency vs model size, and model extraction vs cp / zstd -d.

    python bench/bench_format.py              # 1 MiB and 1 GiB models (needs ~6 GiB free in $TMPDIR)
    python bench/bench_format.py --big-mib 256

Everything is built in a temporary directory (removed at the end) and measured in the same run as its reference;
read the ratios, not the absolute times. Page caches are warm for both sides (the files were just written).
Requires the `zstd` command-line tool for the zstd reference (``apt-get install zstd``).
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import carton
from carton._format import open_carton
from carton._format._limits import ReadLimits
from carton._format._open import extract_stored, extract_stored_kernel_copy
from carton._format._reader import ZipStore, open_reader

_CHUNK = 8 << 20


def timed(fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs (``setup`` runs untimed before each)."""
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        settle()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def settle() -> None:
    """Flush dirty pages before a timed run: otherwise the previous run's 1 GiB of writeback competes with this one
    (the kernel writes it out in the background), and whichever side runs second pays for the other."""
    os.sync()


def make_model(folder: Path, size: int) -> None:
    folder.mkdir(parents=True)
    with (folder / "weights.bin").open("wb") as out:
        remaining = size
        while remaining:
            block = os.urandom(min(remaining, 64 << 20))
            out.write(block)
            remaining -= len(block)
    (folder / "config.json").write_text('{"hidden": 1024}')


def pack(folder: Path, output: Path, compression: str) -> Path:
    return carton.pack(folder, output, runner_name="onnxruntime", required_framework_version="=1.17",
                       runner_compat_version=1, validate=False, compression=compression)  # fmt: skip


def copy_loop(src: Path, dst: Path, offset: int, length: int) -> str:
    """The generic extraction path: read, hash, write in Python."""
    hasher = hashlib.sha256()
    with src.open("rb") as f, dst.open("wb") as out:
        f.seek(offset)
        remaining = length
        while remaining:
            chunk = f.read(min(_CHUNK, remaining))
            hasher.update(chunk)
            out.write(chunk)
            remaining -= len(chunk)
    return hasher.hexdigest()


def copy_sendfile(src: Path, dst: Path, offset: int, length: int) -> str:
    with src.open("rb") as f, dst.open("w+b") as out:
        done = 0
        while done < length:
            done += os.sendfile(out.fileno(), f.fileno(), offset + done, length - done)
        with mmap.mmap(out.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return hashlib.sha256(view).hexdigest()


def hash_in_place(src: Path, offset: int, length: int) -> str:
    """No copy at all: verify the stored entry where it lies in the .carton (what reading in place would cost)."""
    with src.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        return hashlib.sha256(memoryview(view)[offset : offset + length]).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-mib", type=int, default=1024, help="size of the large model (MiB)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (median; goal rows add the best)")
    parser.add_argument("--only", choices=("info", "stored", "zstd"), help="run one section")
    args = parser.parse_args()
    if shutil.which("zstd") is None:
        sys.exit("the zstd command-line tool is needed for the reference (apt-get install zstd)")
    root = Path(tempfile.mkdtemp(prefix="carton-bench-format-"))
    os.environ["CARTON_CACHE_DIR"] = str(root / "cache")
    try:
        run(root, args.big_mib << 20, args.repeat, args.only)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(root: Path, big: int, repeat: int, only: str | None) -> None:
    rows: list[tuple[str, float, float, str]] = []
    cartons: dict[tuple[int, str], Path] = {}
    compressions = ("stored", "zstd") if only in (None, "info") else (only,)
    for size in (1 << 20, big):
        make_model(root / f"model-{size}", size)
        for compression in compressions:
            start = time.perf_counter()
            cartons[size, compression] = pack(root / f"model-{size}", root / f"{size}-{compression}.carton",
                                              compression)  # fmt: skip
            print(f"packed {size >> 20} MiB ({compression}) in {time.perf_counter() - start:.2f} s", file=sys.stderr)

    # get_model_info: must not depend on the model size.
    for compression in compressions if only in (None, "info") else ():
        small = timed(lambda c=compression: carton.get_model_info(cartons[1 << 20, c]), 20)  # type: ignore[misc]
        large = timed(lambda c=compression: carton.get_model_info(cartons[big, c]), 20)  # type: ignore[misc]
        rows.append((f"get_model_info {compression}: {big >> 20} MiB vs 1 MiB model", large, small,
                     f"goal < 50 ms; {large * 1000:.2f} ms"))  # fmt: skip

    cache = root / "cache"
    clear = lambda: shutil.rmtree(cache / "models", ignore_errors=True)  # noqa: E731
    model_bytes = root / f"model-{big}" / "weights.bin"
    out = root / "copy.bin"

    def rm_out() -> None:
        out.unlink(missing_ok=True)

    summary: list[str] = []
    if only in (None, "stored"):
        stored = cartons[big, "stored"]
        with open_reader(stored, ReadLimits(), cache) as reader:
            assert isinstance(reader.store, ZipStore)
            offset, length = reader.store.zip.data_span(reader.store.entry("model/weights.bin"))
        pair = timed_deferred(stored, repeat, clear, lambda: subprocess.run(["cp", str(model_bytes), str(out)],
                                                                            check=True), rm_out)  # fmt: skip
        cp, deferred = pair.reference, pair.opened
        rows += pair.rows("carton.load's open, stored: kernel copy, then the runner may read", "cp", "copy", repeat)
        ours = timed(lambda: open_carton(stored), repeat, clear)
        rows.append(("open_carton stored, verified on return (one pass: preadv, hash, write) vs cp", ours, cp, ""))
        with open_reader(stored, ReadLimits(), cache) as reader:
            assert isinstance(reader.store, ZipStore)
            store, entry = reader.store, reader.store.entry("model/weights.bin")
            one = timed(lambda: extract_stored(store, entry, out), repeat, rm_out)
            rows.append(("  extract_stored alone (the chosen one-pass copy) vs cp", one, cp, ""))
            kernel = timed(lambda: extract_stored_kernel_copy(store, entry, out), repeat, rm_out)
            rows.append(("  alternative: copy_file_range + mmap hash vs cp", kernel, cp, "previous design"))
        sha = timed(lambda: hashlib.sha256(model_bytes.read_bytes()).hexdigest(), repeat)
        rows.append(("  bound: read + SHA-256 of the bytes, no write, vs cp", sha, cp, "no verifying copy beats this"))
        loop = timed(lambda: copy_loop(stored, out, offset, length), repeat, rm_out)
        rows.append(("  alternative: read/hash/write loop vs cp", loop, cp, ""))
        send = timed(lambda: copy_sendfile(stored, out, offset, length), repeat, rm_out)
        rows.append(("  alternative: sendfile + mmap hash vs cp", send, cp, ""))
        in_place = timed(lambda: hash_in_place(stored, offset, length), repeat)
        rows.append(("  alternative: verify in place (no copy) vs cp", in_place, cp, "runner cannot read a zip range"))
        cached = timed(lambda: open_carton(stored), 20)
        rows.append(("open_carton again (stamped cache entry: one stat per file) vs cp", cached, cp,
                     "every load after the first"))  # fmt: skip

        # An unpacked carton folder: verified in place on the first load, one stat per file afterwards.
        folder = root / "unpacked"
        (folder / "model").mkdir(parents=True)
        with open_reader(stored, ReadLimits(), cache) as reader:
            for name in reader.manifest:
                if name != "model/weights.bin":
                    (folder / name).parent.mkdir(parents=True, exist_ok=True)
                    (folder / name).write_bytes(reader.read(name))
            (folder / "MANIFEST").write_bytes(reader.manifest_bytes)
        os.link(model_bytes, folder / "model" / "weights.bin")
        for file in folder.rglob("*"):
            os.utime(file, (1_600_000_000, 1_600_000_000))  # not "racy" (see _stamp.RACY_NS)
        unstamp = lambda: shutil.rmtree(cache / "verified", ignore_errors=True)  # noqa: E731
        first_dir = timed(lambda: open_carton(folder), repeat, unstamp)
        rows.append(("open_carton folder, first load (hash every model file) vs cp", first_dir, cp, "no copy"))
        open_carton(folder)
        later_dir = timed(lambda: open_carton(folder), 20)
        rows.append(("open_carton folder, later loads (stamp: one stat per file) vs cp", later_dir, cp, ""))
        mib = big / (1 << 20)
        summary.append(f"cp {mib / cp:.0f} MiB/s, carton.load's open stored {mib / deferred:.0f} MiB/s "
                       f"(verified on return: {mib / ours:.0f} MiB/s)")  # fmt: skip

    if only in (None, "zstd"):
        packed = cartons[big, "zstd"]
        with open_reader(packed, ReadLimits(), cache) as reader:
            assert isinstance(reader.store, ZipStore)
            z_offset, z_length = reader.store.zip.data_span(reader.store.entry("model/weights.bin"))
        frame = root / "weights.zst"
        with packed.open("rb") as f, frame.open("wb") as dst:
            f.seek(z_offset)
            dst.write(f.read(z_length))
        unzstd = ["zstd", "-q", "-d", "-f", str(frame), "-o", str(out)]
        pair_z = timed_deferred(packed, repeat, clear, lambda: subprocess.run(unzstd, check=True), rm_out)
        zstd_d, deferred_z = pair_z.reference, pair_z.opened
        rows += pair_z.rows("carton.load's open, zstd: streaming decompress + write vs zstd -d", "zstd -d", "output",
                            repeat)  # fmt: skip
        ours_z = timed(lambda: open_carton(packed), repeat, clear)
        rows.append(("open_carton zstd, verified on return (decompress + hash + write) vs zstd -d", ours_z, zstd_d, ""))
        mib = big / (1 << 20)
        summary.append(f"zstd -d {mib / zstd_d:.0f} MiB/s, carton.load's open zstd {mib / deferred_z:.0f} MiB/s "
                       f"(verified on return: {mib / ours_z:.0f} MiB/s)")  # fmt: skip

    width = max(len(r[0]) for r in rows)
    print(f"\n{'measurement':<{width}}  {'carton':>10}  {'reference':>10}  {'speed vs ref':>12}  note")
    for name, ours_t, ref_t, note in rows:
        print(f"{name:<{width}}  {ours_t * 1000:>8.1f}ms  {ref_t * 1000:>8.1f}ms  {ref_t / ours_t:>11.0%}  {note}")
    if summary:
        print("\nthroughput: " + "; ".join(summary))


@dataclass(frozen=True, slots=True, kw_only=True)
class Paired:
    """Medians and minima of a reference and of `open_carton(defer_verification=True)`, timed turn about."""

    reference: float
    opened: float
    verified: float
    best_reference: float
    best_opened: float

    def rows(self, title: str, reference: str, what: str, repeat: int) -> list[tuple[str, float, float, str]]:
        """The goal row (medians), the best runs, and the time until the deferred SHA-256 ended."""
        return [
            (title, self.opened, self.reference, f"goal >= 80 % of {reference} (medians)"),
            (f"  the same, best of {repeat} each", self.best_opened, self.best_reference, ""),
            (f"  + SHA-256 of the {what} on a helper thread (overlaps the runner's load)", self.verified,
             self.reference, "if nothing overlapped it"),
        ]  # fmt: skip


def timed_deferred(
    path: Path, repeat: int, clear: Callable[[], object], reference: Callable[[], object], rm_out: Callable[[], object]
) -> Paired:
    """Time the reference and the deferred open in alternation, so that both see the same state of the machine:
    on a VM whose host lends memory back and forth, writing 1 GiB can take 2-5x longer in one run than the next,
    and two blocks of runs taken a minute apart compare that more than the code. ``opened`` is the time until
    `open_carton` returns (the folder a runner may start reading), ``verified`` until its `Verification` ended."""
    refs, opened_times, verified_times = [], [], []
    for _ in range(repeat):
        rm_out()
        settle()
        start = time.perf_counter()
        reference()
        refs.append(time.perf_counter() - start)
        clear()
        settle()
        start = time.perf_counter()
        opened = open_carton(path, defer_verification=True)
        opened_times.append(time.perf_counter() - start)
        assert opened.verification is not None
        opened.verification.wait()
        verified_times.append(time.perf_counter() - start)
    return Paired(
        reference=statistics.median(refs), opened=statistics.median(opened_times),
        verified=statistics.median(verified_times), best_reference=min(refs), best_opened=min(opened_times),
    )  # fmt: skip


if __name__ == "__main__":
    main()
