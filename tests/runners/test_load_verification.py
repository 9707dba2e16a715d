"""`carton.load` hashes the model files while the runner loads them (docs/format.md, "Verification while loading").

What must hold: a file that does not match MANIFEST fails the load with `ManifestError` naming it, whether the
runner loaded the bad bytes or choked on them; nothing is left behind (no cache entry, no stamp, no runner
process); and a good carton is stamped, so the next load reads no model byte.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import carton
import numpy as np
import pytest
from carton._format import open_carton
from carton._format._open import ENTRY_STAMP, dir_stamp_path, models_dir
from runner_models import write_mlp


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    cache = tmp_path / "cache"
    monkeypatch.setenv("CARTON_CACHE_DIR", str(cache))
    monkeypatch.setenv("CARTON_SPARE_RUNNERS", "0")  # every runner this test starts is one it must see end
    _EARLIER.clear()
    _EARLIER.update(_all_children())
    yield cache


#: The test process's children when the current test started: not this test's (a worker process shared with other
#: tests' files may have some).
_EARLIER: set[int] = set()


def _all_children() -> list[int]:
    me = str(os.getpid())
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _children() -> list[str]:
    """The live children this test started, each as its pid and command line (for the failure's message)."""
    found = []
    for pid in _all_children():
        if pid not in _EARLIER:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                command = "?"
            found.append(f"{pid}: {command.strip()}")
    return found


def _packed_mlp(tmp_path: Path) -> tuple[Path, bytes]:
    write_mlp(tmp_path / "model")
    data = (tmp_path / "model" / "model.onnx").read_bytes()
    packed = carton.pack(
        tmp_path / "model",
        tmp_path / "mlp.carton",
        runner_name="onnxruntime",
        required_framework_version="*",
        compression="stored",
    )
    return packed, data


def _corrupt(packed: Path, model_bytes: bytes, at: int) -> None:
    """Flip one byte of the stored model/model.onnx entry (the zip stays valid: only MANIFEST can tell)."""
    blob = bytearray(packed.read_bytes())
    start = blob.find(model_bytes)
    assert start > 0 and blob.find(model_bytes, start + 1) == -1
    blob[start + at] ^= 0xFF
    packed.write_bytes(bytes(blob))


def _assert_nothing_left(cache: Path) -> None:
    entries = models_dir(cache)
    assert not entries.exists() or list(entries.iterdir()) == [], list(entries.iterdir())
    assert _children() == []


def test_a_good_carton_is_stamped_while_loading(tmp_path: Path, isolated: Path) -> None:
    packed, _ = _packed_mlp(tmp_path)
    x = np.ones((2, 16), np.float32)
    with carton.load(packed) as model:
        first = model.infer({"x": x})["probs"]
        entry = model.model_dir.parent
        assert (entry / ENTRY_STAMP).is_file()  # verified before load returned
    assert open_carton(packed).cached  # the next open reads no model byte
    with carton.load(packed) as again:
        assert np.array_equal(again.infer({"x": x})["probs"], first)


def test_bytes_the_runner_loads_fine_but_manifest_refuses(tmp_path: Path, isolated: Path) -> None:
    packed, data = _packed_mlp(tmp_path)
    _corrupt(packed, data, len(data) - 8)  # inside the last weights: onnxruntime loads it without complaint
    with pytest.raises(carton.ManifestError, match=r"model/model\.onnx has sha256 [0-9a-f]{64} but MANIFEST says"):
        carton.load(packed)
    _assert_nothing_left(isolated)


def test_bytes_the_runner_cannot_parse_report_the_manifest_error(tmp_path: Path, isolated: Path) -> None:
    packed, data = _packed_mlp(tmp_path)
    _corrupt(packed, data, 0)  # the first protobuf tag: onnxruntime fails to parse the model
    with pytest.raises(carton.ManifestError, match=r"model/model\.onnx has sha256") as caught:
        carton.load(packed)
    assert any("its runner failed" in note for note in getattr(caught.value, "__notes__", []))
    _assert_nothing_left(isolated)


def test_an_unpacked_folder_that_does_not_match_is_refused_and_not_stamped(tmp_path: Path, isolated: Path) -> None:
    packed, _ = _packed_mlp(tmp_path)
    folder = tmp_path / "unpacked"
    _unzip(packed, folder)
    target = folder / "model" / "model.onnx"
    target.chmod(0o644)
    blob = bytearray(target.read_bytes())
    blob[-8] ^= 0xFF
    target.write_bytes(bytes(blob))
    with pytest.raises(carton.ManifestError, match=r"model/model\.onnx has sha256"):
        carton.load(folder)
    assert not dir_stamp_path(isolated, folder.resolve()).exists()
    assert _children() == []


def test_an_entry_published_but_never_stamped_is_extracted_again(tmp_path: Path, isolated: Path) -> None:
    """A host that died between publishing an entry and stamping it leaves an entry nobody may trust."""
    packed, _ = _packed_mlp(tmp_path)
    with carton.load(packed) as model:
        entry = model.model_dir.parent
    (entry / ENTRY_STAMP).unlink()
    reopened = open_carton(packed)
    assert not reopened.cached and (entry / ENTRY_STAMP).is_file()


def _unzip(packed: Path, folder: Path) -> None:
    import zipfile

    with zipfile.ZipFile(packed) as archive:
        archive.extractall(folder)
