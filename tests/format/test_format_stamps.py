"""Unpacked folders and cache entries: resolved paths, verification before use, stamps, symlinks, tampering."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import carton
import numpy as np
import pytest
from carton import DType, TensorSpec
from carton._format import _open, _stamp, open_carton
from carton._format._reader import open_reader
from carton.errors import ArchiveTooLarge, ManifestError, UnsafeArchive

from .conftest import FileServer

OLD = 1_600_000_000  # seconds: an mtime well before any stamp, so no file counts as "racy"


def pack(model_dir: Path, output: Path, **kwargs: object) -> Path:
    base: dict[str, object] = dict(runner_name="onnxruntime", required_framework_version="*",
                                   runner_compat_version=1, validate=False)  # fmt: skip
    base.update(kwargs)
    return carton.pack(model_dir, output, **base)  # type: ignore[arg-type]


def unpack(path: Path, folder: Path, cache: Path) -> Path:
    with open_reader(path, carton.ReadLimits(), cache) as reader:
        for name in reader.manifest:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(reader.read(name, 1 << 30))
        (folder / "MANIFEST").write_bytes(reader.manifest_bytes)
    for file in folder.rglob("*"):
        os.utime(file, (OLD, OLD))
    return folder


def age(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file() and not file.is_symlink():
            os.utime(file, (OLD, OLD))


@pytest.fixture
def unpacked(model_dir: Path, tmp_path: Path, cache: Path) -> Path:
    return unpack(pack(model_dir, tmp_path / "m.carton"), tmp_path / "unpacked", cache)


def test_relative_directory_is_resolved(unpacked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    opened = open_carton("unpacked")
    assert opened.model_dir.is_absolute() and opened.model_dir == unpacked.resolve() / "model"
    monkeypatch.chdir("/")  # lazy loads reopen the resolved folder, not the caller's relative spelling
    assert opened.info.misc_files == ()
    assert carton.get_model_info(unpacked).manifest_sha256 == opened.info.manifest_sha256


def test_relative_carton_file_and_lazy_loads_survive_chdir(
    model_dir: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    pack(model_dir, tmp_path / "m.carton", inputs=[TensorSpec(name="x", dtype=DType.FLOAT32, shape=(2, 3))],
         self_tests=[{"inputs": {"x": x}}])  # fmt: skip
    monkeypatch.chdir(tmp_path)
    info = carton.get_model_info("m.carton")
    monkeypatch.chdir("/")
    np.testing.assert_array_equal(info.self_tests[0].inputs["x"].load(), x)


def test_carton_load_of_a_relative_unpacked_folder_runs(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, save

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
    )  # fmt: skip
    (tmp_path / "onnx").mkdir()
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "onnx" / "model.onnx")
    spec = dict(dtype=DType.FLOAT32, shape=("n", 3))
    packed = pack(tmp_path / "onnx", tmp_path / "relu.carton", inputs=[TensorSpec(name="x", **spec)],  # type: ignore[arg-type]
                  outputs=[TensorSpec(name="y", **spec)])  # type: ignore[arg-type]  # fmt: skip
    unpack(packed, tmp_path / "unp2", cache)
    monkeypatch.chdir(tmp_path)
    with carton.load("unp2") as model:
        x = np.array([[-1.0, 2.0, -3.0]], np.float32)
        np.testing.assert_array_equal(model.infer({"x": x})["y"], np.maximum(x, 0))


def test_unpacked_model_files_are_verified(unpacked: Path) -> None:
    weights = unpacked / "model" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[0] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"model/weights\.bin has sha256"):
        open_carton(unpacked)


def test_stamp_makes_later_loads_stat_only(unpacked: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = open_carton(unpacked)
    assert not first.cached
    stamp = _open.dir_stamp_path(cache, unpacked.resolve())
    assert stamp.is_file()

    def no_hashing(*args: object) -> None:
        raise AssertionError("an unchanged folder must not be hashed again")

    monkeypatch.setattr(_open, "hash_stable", no_hashing)
    assert open_carton(unpacked).cached
    monkeypatch.undo()
    # Same size, new bytes, new mtime: the stamp no longer matches and the folder is hashed again.
    weights = unpacked / "model" / "weights.bin"
    size = weights.stat().st_size
    weights.write_bytes(b"\1" * size)
    with pytest.raises(ManifestError, match=r"model/weights\.bin has sha256"):
        open_carton(unpacked)


def test_racy_files_are_hashed_again(unpacked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.utime(unpacked / "model" / "weights.bin")  # modified just now: could change again within the same tick
    open_carton(unpacked)
    calls: list[object] = []
    real = _open.hash_stable
    monkeypatch.setattr(_open, "hash_stable", lambda *a: calls.append(a) or real(*a))  # type: ignore[func-returns-value]
    assert not open_carton(unpacked).cached and calls


def test_symlink_out_of_the_folder_is_refused(unpacked: Path, tmp_path: Path) -> None:
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"secret")
    (unpacked / "model" / "sub" / "config.json").unlink()
    (unpacked / "model" / "sub" / "config.json").symlink_to(outside)
    with pytest.raises(UnsafeArchive, match="symlink leads out of the carton folder"):
        open_carton(unpacked)
    with pytest.raises(UnsafeArchive, match="symlink leads out of the carton folder"):
        carton.get_model_info(unpacked)


def test_directory_symlink_out_of_the_folder_is_refused(unpacked: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (unpacked / "model" / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeArchive, match="symlink leads out of the carton folder"):
        open_carton(unpacked)


def test_symlink_inside_the_folder_is_followed_and_verified(model_dir: Path, tmp_path: Path, cache: Path) -> None:
    path = pack(model_dir, tmp_path / "m.carton", misc_files={"c.json": b'{"layers": 2}'})
    folder = unpack(path, tmp_path / "unpacked", cache)
    config = folder / "model" / "sub" / "config.json"
    config.unlink()
    config.symlink_to(Path("..") / ".." / "misc" / "c.json")  # same bytes, inside the folder
    assert not open_carton(folder).cached
    (folder / "misc" / "c.json").write_text('{"layers": 3}')  # the link's target changes: caught
    with pytest.raises(ManifestError, match=r"model/sub/config\.json has sha256"):
        open_carton(folder)


def test_fifo_is_refused(unpacked: Path) -> None:
    os.mkfifo(unpacked / "model" / "pipe")
    with pytest.raises(UnsafeArchive, match="not a regular file"):
        open_carton(unpacked)


# --- the materialized cache entry -------------------------------------------------------------------------------


def test_tampered_cache_entry_is_extracted_again(model_dir: Path, tmp_path: Path, cache: Path) -> None:
    path = pack(model_dir, tmp_path / "m.carton")
    first = open_carton(path)
    assert not first.cached
    assert open_carton(path).cached
    weights = first.model_dir / "weights.bin"
    original = weights.read_bytes()
    weights.chmod(0o644)
    weights.write_bytes(b"\0" * len(original))  # same size, new mtime
    again = open_carton(path)
    assert not again.cached and again.model_dir == first.model_dir
    assert (again.model_dir / "weights.bin").read_bytes() == original
    assert open_carton(path).cached
    assert [p.name for p in (cache / "models").iterdir()] == [first.model_dir.parent.name]  # nothing left over


@pytest.mark.parametrize("damage", ["delete", "add", "stamp"])
def test_damaged_cache_entry_is_extracted_again(
    model_dir: Path, tmp_path: Path, cache: Path, damage: str
) -> None:
    path = pack(model_dir, tmp_path / "m.carton")
    entry = open_carton(path).model_dir
    if damage == "delete":
        (entry / "sub" / "config.json").unlink()
    elif damage == "add":
        (entry / "extra.py").write_text("import os")
    else:
        (entry.parent / _open.ENTRY_STAMP).unlink()
    again = open_carton(path)
    assert not again.cached
    assert (entry / "sub" / "config.json").read_text() == '{"layers": 2}'
    assert not (entry / "extra.py").exists()


def test_tampered_linked_blob_is_detected_and_fetched_again(
    model_dir: Path, tmp_path: Path, cache: Path, server: FileServer
) -> None:
    path = pack(model_dir, tmp_path / "m.carton")
    original = (model_dir / "weights.bin").read_bytes()
    digest = hashlib.sha256(original).hexdigest()
    server.files["/w.bin"] = original
    shrunk = carton.shrink(path, {digest: [server.url("/w.bin")]}, tmp_path / "s.carton")
    entry = open_carton(shrunk).model_dir
    blob = cache / "blobs" / "sha256" / digest
    assert (entry / "weights.bin").stat().st_ino == blob.stat().st_ino  # hard-linked, one inode
    blob.chmod(0o644)
    with blob.open("r+b") as handle:  # tamper with the cache's copy: the linked model file changes too
        handle.write(b"\xff" * 8)
    again = open_carton(shrunk)
    assert not again.cached
    assert (again.model_dir / "weights.bin").read_bytes() == original
    assert blob.read_bytes() == original  # the bad blob was dropped and downloaded again


def test_stamp_blind_spot_is_what_the_docs_say(model_dir: Path, tmp_path: Path, cache: Path) -> None:
    """A same-size rewrite with the mtime set back is not seen (documented: outside the threat model)."""
    path = pack(model_dir, tmp_path / "m.carton")
    entry = open_carton(path).model_dir
    weights = entry / "weights.bin"
    before = weights.stat()
    weights.chmod(0o644)
    weights.write_bytes(b"\0" * before.st_size)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    weights.chmod(0o444)
    assert _stamp.RACY_NS > 0 and open_carton(path).cached


# --- read limits through carton.load ------------------------------------------------------------------------------


def test_load_honours_read_limits(model_dir: Path, tmp_path: Path, cache: Path) -> None:
    path = pack(model_dir, tmp_path / "m.carton")
    with pytest.raises(ArchiveTooLarge):
        carton.load(path, read_limits=carton.ReadLimits(max_total_size=10_000))
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())
