"""pack -> get_model_info / open_carton / verify round trips, determinism, atomicity, shrink, directories."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import carton
import numpy as np
import pytest
from carton import DType, TensorSpec
from carton._format import open_carton
from carton._format._reader import open_reader
from carton.errors import ConfigError, ManifestError, PackError

X = TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", 3), description="features")
Y = TensorSpec(name="y", dtype=DType.STRING, shape="*", internal_name="out:0")
ALL_DTYPES = [d for d in DType if d is not DType.STRING]


def pack(model_dir: Path, output: Path, **kwargs: object) -> Path:
    base: dict[str, object] = dict(runner_name="onnxruntime", required_framework_version="=1.17.0",
                                   runner_compat_version=1, validate=False)  # fmt: skip
    base.update(kwargs)
    return carton.pack(model_dir, output, **base)  # type: ignore[arg-type]


@pytest.mark.parametrize("compression", ["zstd", "deflate", "stored"])
def test_roundtrip_every_field(model_dir: Path, tmp_path: Path, cache: Path, compression: str) -> None:
    arrays = {d: (np.arange(6).reshape(2, 3) % 3).astype(d.value) for d in ALL_DTYPES}
    inputs = tuple(TensorSpec(name=f"in_{d.value}", dtype=d, shape=(2, 3)) for d in ALL_DTYPES)
    path = pack(
        model_dir, tmp_path / "m.carton", compression=compression, model_name="m", model_description="# Doc\nline 2",
        required_platforms=["x86_64-unknown-linux-gnu"], inputs=(X, *inputs), outputs=(Y,),
        runner_opts={"threads": 2, "fast": True, "ratio": 0.5, "name": "n", "list": [1, 2], "table": {"a": 1}},
        self_tests=[{"name": "t", "description": "d",
                     "inputs": {"x": np.ones((1, 3), np.float32), **{s.name: arrays[s.dtype] for s in inputs}},
                     "expected_out": {"y": [["a", "b"], ["c", "d"]]}}],
        examples=[{"inputs": {"x": [np.ones(2, np.float32), np.zeros((2, 2), np.float32)]},
                   "sample_out": {"y": b"\x89PNG"}}],
        misc_files={"notes.txt": b"hello", "pic.png": model_dir / "sub" / "config.json"},
    )  # fmt: skip
    info = carton.get_model_info(path)
    assert info.model_name == "m" and info.model_description == "# Doc\nline 2"
    assert info.required_platforms == ("x86_64-unknown-linux-gnu",)
    assert info.inputs == (X, *inputs) and info.outputs == (Y,)
    assert info.runner == carton.RunnerInfo(
        runner_name="onnxruntime", required_framework_version="=1.17.0", runner_compat_version=1,
        opts={"threads": 2, "fast": True, "ratio": 0.5, "name": "n", "list": [1, 2], "table": {"a": 1}},
    )  # fmt: skip
    test = info.self_tests[0]
    assert (test.name, test.description) == ("t", "d")
    for spec in inputs:
        loaded = test.inputs[spec.name].load()
        assert isinstance(loaded, np.ndarray) and loaded.dtype == np.dtype(spec.dtype.value)
        np.testing.assert_array_equal(loaded, arrays[spec.dtype])
    assert test.expected_out is not None
    np.testing.assert_array_equal(test.expected_out["y"].load(), np.array([["a", "b"], ["c", "d"]]))
    nested = info.examples[0].inputs["x"].load()
    assert isinstance(nested, list) and [a.shape for a in nested] == [(2,), (2, 2)]
    assert info.examples[0].sample_out["y"].load() == b"\x89PNG"
    assert info.misc_file("notes.txt") == b"hello" and info.misc_file("pic.png") == b'{"layers": 2}'
    with pytest.raises(KeyError, match="no misc file 'nope'"):
        info.misc_file("nope")
    expected_manifest = hashlib.sha256(open_reader(path, carton.ReadLimits(), cache).manifest_bytes).hexdigest()
    assert info.manifest_sha256 == expected_manifest
    carton.verify(path)
    opened = open_carton(path)
    assert (opened.model_dir / "weights.bin").read_bytes() == (model_dir / "weights.bin").read_bytes()
    assert (opened.model_dir / "sub" / "config.json").read_text() == '{"layers": 2}'
    assert not opened.cached and open_carton(path).cached


def test_pack_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    kwargs = dict(inputs=[X], outputs=[Y], self_tests=[{"inputs": {"x": np.ones((1, 3), np.float32)}}])
    first = pack(model_dir, tmp_path / "a.carton", **kwargs).read_bytes()
    os.utime(model_dir / "weights.bin", (0, 0))  # timestamps do not matter
    assert pack(model_dir, tmp_path / "b.carton", **kwargs).read_bytes() == first


def test_manifest_is_sorted_and_lists_every_file(model_dir: Path, tmp_path: Path, cache: Path) -> None:
    path = pack(model_dir, tmp_path / "a.carton", misc_files={"z": b"1", "a": b"2"})
    with open_reader(path, carton.ReadLimits(), cache) as reader:
        lines = reader.manifest_bytes.decode().splitlines()
        assert lines == sorted(lines)
        assert [line.split("=")[0] for line in lines] == [
            "carton.toml", "misc/a", "misc/z", "model/sub/config.json", "model/weights.bin", "tensor_data/index.toml"
        ]  # fmt: skip
        assert reader.read("tensor_data/index.toml") == b"tensor = []\n"  # the original reader requires it


def test_failed_pack_leaves_nothing(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(PackError, match="numpy dtype float16 has no carton dtype"):
        pack(model_dir, out / "m.carton", inputs=[X], self_tests=[{"inputs": {"x": np.ones(3, np.float16)}}])
    with pytest.raises(PackError, match="linked_files names sha256 0000"):
        pack(model_dir, out / "m.carton", linked_files={"0" * 64: ["http://127.0.0.1:1/x"]})
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compression": "lzma"}, "compression 'lzma' is not one of"),
        ({"runner_compat_version": None}, "runner_compat_version is required when validate=False"),
        ({"inputs": [X, X]}, "tensor name 'x' is declared more than once"),
        ({"self_tests": [{"inputs": {"x": np.ones(1)}}]}, "need the model's inputs and outputs"),
        ({"inputs": [X], "self_tests": [{"inputs": {"q": np.ones(1)}}]}, "no such tensor is declared"),
        ({"inputs": [X], "self_tests": [{"expected_out": {}}]}, "self_tests\\[0\\].inputs is required"),
        ({"inputs": [X], "examples": [{"inputs": {"x": "@misc/nope"}}]}, "names a misc file that misc_files"),
        ({"misc_files": {"../x": b""}}, "not a valid misc file name"),
        ({"inputs": [X], "self_tests": [{"inputs": {"x": [[1], [1, 2]]}}]}, "ragged"),
    ],
)
def test_pack_refuses_bad_arguments(model_dir: Path, tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PackError, match=message):
        pack(model_dir, tmp_path / "m.carton", **kwargs)
    assert not (tmp_path / "m.carton").exists()


def test_pack_refuses_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(PackError, match="not a directory"):
        pack(tmp_path / "nope", tmp_path / "m.carton")


def test_default_output_is_beside_the_model_folder(model_dir: Path, tmp_path: Path) -> None:
    path = carton.pack(model_dir, runner_name="r", required_framework_version="=1", runner_compat_version=1,
                       validate=False)  # fmt: skip
    assert path == tmp_path / "model_src.carton"  # as `carton pack` without -o
    assert carton.get_model_info(path).runner.runner_name == "r"
    with pytest.raises(PackError, match="output= is required"):
        carton.pack(object(), runner_name="r", required_framework_version="=1", runner_compat_version=1,
                    validate=False)  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (TensorSpec(name="x", dtype="float17", shape="*"), r"inputs\[0\]\.dtype 'float17' is not a carton dtype"),  # type: ignore[arg-type]
        (TensorSpec(name="x", dtype=DType.FLOAT32, shape=(2, -1)), r"inputs\[0\]\.shape\[1\] is negative"),
        (TensorSpec(name="x", dtype=DType.FLOAT32, shape=""), r"inputs\[0\]\.shape must not be an empty string"),
        (TensorSpec(name="x", dtype=DType.FLOAT32, shape=(2.5,)), r"inputs\[0\]\.shape\[0\] must be"),  # type: ignore[arg-type]
        (TensorSpec(name="", dtype=DType.FLOAT32, shape="*"), r"inputs\[0\]\.name"),
        (TensorSpec(name=3, dtype=DType.FLOAT32, shape="*"), r"inputs\[0\]\.name"),  # type: ignore[arg-type]
    ],
)
def test_pack_refuses_bad_specs(model_dir: Path, tmp_path: Path, spec: TensorSpec, message: str) -> None:
    with pytest.raises(PackError, match=message):
        pack(model_dir, tmp_path / "m.carton", inputs=[spec])
    assert not (tmp_path / "m.carton").exists()


def test_dtype_given_as_a_string_is_accepted(model_dir: Path, tmp_path: Path) -> None:
    path = pack(model_dir, tmp_path / "m.carton", inputs=[TensorSpec(name="x", dtype="int8", shape=[2])])  # type: ignore[arg-type]
    assert carton.get_model_info(path).inputs == (TensorSpec(name="x", dtype=DType.INT8, shape=(2,)),)


@pytest.mark.parametrize("urls", [["notaurl"], ["ftp://example.com/w"], [], "https://example.com/w", ["https://"]])
def test_shrink_and_pack_require_http_urls(model_dir: Path, tmp_path: Path, urls: object) -> None:
    path = pack(model_dir, tmp_path / "m.carton")
    digest = hashlib.sha256((model_dir / "weights.bin").read_bytes()).hexdigest()
    with pytest.raises(PackError, match=f"sha256 {digest}"):
        carton.shrink(path, {digest: urls}, tmp_path / "s.carton")  # type: ignore[dict-item]
    with pytest.raises(PackError, match=f"sha256 {digest}"):
        pack(model_dir, tmp_path / "l.carton", linked_files={digest: urls})
    assert not (tmp_path / "s.carton").exists() and not (tmp_path / "l.carton").exists()


def test_runner_refusal_names_the_callers_folder(tmp_path: Path) -> None:
    runtime = pytest.importorskip("carton._runtime")
    if not hasattr(runtime, "pack_in_runner"):
        pytest.skip("carton._runtime.pack_in_runner is not available yet")
    pytest.importorskip("xgboost")
    folder = tmp_path / "bad_model"
    folder.mkdir()
    (folder / "model.json").write_text("{not json")
    with pytest.raises(PackError) as caught:
        carton.pack(folder, tmp_path / "m.carton", runner_name="xgboost", required_framework_version="*")
    assert str(folder) in str(caught.value) and "carton-pack-" not in str(caught.value)


def test_unpacked_directory_is_used_in_place(model_dir: Path, tmp_path: Path, cache: Path) -> None:
    path = pack(model_dir, tmp_path / "m.carton", inputs=[X])
    folder = tmp_path / "unpacked"
    with open_reader(path, carton.ReadLimits(), cache) as reader:
        for name in reader.manifest:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(reader.read(name, 1 << 30))
        (folder / "MANIFEST").write_bytes(reader.manifest_bytes)
    info = carton.get_model_info(folder)
    assert info == carton.get_model_info(path)
    opened = open_carton(folder)
    assert opened.model_dir == folder / "model"
    assert not (cache / "models").exists()
    (folder / "model" / "weights.bin").write_bytes(b"changed")
    with pytest.raises(ManifestError, match=r"model/weights\.bin has sha256"):
        carton.verify(folder)
    (folder / "MANIFEST").unlink()  # without a MANIFEST, one is computed: a different model hash
    assert carton.get_model_info(folder).manifest_sha256 != info.manifest_sha256


def test_directory_without_carton_toml(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    with pytest.raises(ConfigError, match=r"carton\.toml is missing"):
        carton.get_model_info(tmp_path)


def test_missing_path() -> None:
    with pytest.raises(carton.FormatError, match="no such file or directory"):
        carton.get_model_info("/nonexistent/model.carton")


def test_shrink_keeps_model_hash(model_dir: Path, tmp_path: Path, cache: Path) -> None:
    path = pack(model_dir, tmp_path / "m.carton")
    digest = hashlib.sha256((model_dir / "weights.bin").read_bytes()).hexdigest()
    shrunk = carton.shrink(path, {digest: ["http://127.0.0.1:9/weights.bin"]}, tmp_path / "s.carton")
    assert carton.get_model_info(shrunk).manifest_sha256 == carton.get_model_info(path).manifest_sha256
    assert shrunk.stat().st_size < path.stat().st_size - 40_000
    with open_reader(shrunk, carton.ReadLimits(), cache) as reader:
        assert "model/weights.bin" not in reader.present
        assert reader.links == {digest: ("http://127.0.0.1:9/weights.bin",)}
    with pytest.raises(PackError, match="is not the hash of any file"):
        carton.shrink(path, {"1" * 64: ["http://127.0.0.1:9/x"]}, tmp_path / "t.carton")
    toml_hash = carton.get_model_info(path).manifest["carton.toml"]
    with pytest.raises(PackError, match=r"carton\.toml cannot be moved"):
        carton.shrink(path, {toml_hash: ["http://127.0.0.1:9/x"]}, tmp_path / "t.carton")
    assert not (tmp_path / "t.carton").exists()


def test_open_carton_rejects_tampered_model_and_cleans_up(model_dir: Path, tmp_path: Path, cache: Path) -> None:
    path = pack(model_dir, tmp_path / "m.carton", compression="stored")
    data = bytearray(path.read_bytes())
    weights = (model_dir / "weights.bin").read_bytes()
    index = data.find(weights[:64]) + 60_000  # inside the zero half of weights.bin, stored as is
    assert data[index] == 0
    data[index] = 1
    path.write_bytes(bytes(data))
    carton.get_model_info(path)  # metadata is intact
    with pytest.raises(ManifestError, match=r"model/weights\.bin has sha256"):
        open_carton(path)
    assert list((cache / "models").iterdir()) == []


def test_validate_path_runs_in_a_runner(model_dir: Path, tmp_path: Path) -> None:
    runtime = pytest.importorskip("carton._runtime")
    if not hasattr(runtime, "pack_in_runner"):
        pytest.skip("carton._runtime.pack_in_runner is not available yet")
    pytest.importorskip("onnx")
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
    )  # fmt: skip
    folder = tmp_path / "onnx_model"
    folder.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "model.onnx")
    import onnxruntime

    path = carton.pack(folder, tmp_path / "m.carton", runner_name="onnxruntime",
                       required_framework_version=f"={onnxruntime.__version__}")  # fmt: skip
    info = carton.get_model_info(path)
    assert [s.name for s in info.inputs] == ["x"] and info.runner.runner_compat_version >= 1
