"""Every fixture carton in tests/fixtures/format produces exactly the error expected.toml names (or loads)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import carton
import numpy as np
import pytest
from carton import errors
from carton._format import open_carton

FIXTURES = Path(__file__).parents[1] / "fixtures" / "format"
EXPECTED = tomllib.loads((FIXTURES / "expected.toml").read_text())


def test_every_fixture_is_described() -> None:
    assert {p.stem for p in FIXTURES.glob("*.carton")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(n for n, e in EXPECTED.items() if not e.get("ok")))
def test_bad_fixture(name: str, cache: Path) -> None:
    expected = EXPECTED[name]
    path = FIXTURES / f"{name}.carton"
    error = getattr(errors, expected["error"])
    steps = {"info": carton.get_model_info, "open": open_carton, "load": carton.verify}
    order = ["info", "open", "load"]
    for stage in order[: order.index(expected["stage"])]:
        steps[stage](path)  # earlier stages must succeed
    with pytest.raises(error) as caught:
        steps[expected["stage"]](path)
    assert type(caught.value) is error
    assert expected["match"] in str(caught.value)
    if expected["stage"] in ("info", "open"):
        # Nothing was left behind in the cache: no extracted model, no partial directory.
        models = cache / "models"
        assert not models.exists() or not any(models.iterdir())


@pytest.mark.parametrize("name", sorted(n for n, e in EXPECTED.items() if e.get("ok")))
def test_good_fixture(name: str, cache: Path) -> None:
    path = FIXTURES / f"{name}.carton"
    info = carton.get_model_info(path)
    assert info.manifest_sha256 == EXPECTED[name]["model_hash"]
    carton.verify(path)
    opened = open_carton(path)
    assert (opened.model_dir / "model.bin").is_file()


def test_original_quirks_read_as_the_original_meant(cache: Path) -> None:
    info = carton.get_model_info(FIXTURES / "ok_original_quirks.carton")
    assert info.model_name == "quirky"
    assert info.runner.opts == {"use_gpu": 1}  # a boolean the original wrote as an integer
    test = info.self_tests[0]
    np.testing.assert_array_equal(test.inputs["x"].load(), np.array([1.5, -2.0], dtype=np.float32))
    out = test.expected_out["y"].load() if test.expected_out else None
    assert isinstance(out, np.ndarray) and out.shape == () and out[()] == "hello"
    assert info.inputs[0].shape == (2,) and info.outputs[0].shape == ()


def test_regenerating_fixtures_is_deterministic(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("ok_original_quirks", "size_lie", "overlapping_entries"):
        assert module.FIXTURES[name]() == (FIXTURES / f"{name}.carton").read_bytes()
