"""`carton info|verify|pack|shrink` through the real entry point function."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from carton.cli import build_parser, main

FIXTURES = Path(__file__).parents[1] / "fixtures" / "format"


def test_pack_info_verify_shrink(
    model_dir: Path, tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.carton"
    assert main(["pack", str(model_dir), "-o", str(out), "--runner", "onnxruntime", "--framework-version", "=1.17",
                 "--compat-version", "2", "--no-validate", "--name", "demo", "--input", "x:float32:[batch,3]",
                 "--input", "s:string:[]", "--output-spec", "y:int64:sym", "--opt", "threads=4", "--opt",
                 "mode=fast", "--opt", "on=true", "--misc", f"readme.md={model_dir / 'sub' / 'config.json'}",
                 "--platform", "x86_64-unknown-linux-gnu"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_name"] == "demo" and data["runner"]["runner_compat_version"] == 2
    assert data["runner"]["opts"] == {"mode": "fast", "on": True, "threads": 4}
    assert [i["shape"] for i in data["inputs"]] == [["batch", 3], []] and data["outputs"][0]["shape"] == "sym"
    assert data["misc_files"] == ["readme.md"]
    assert main(["info", str(out)]) == 0
    table = capsys.readouterr().out
    assert "demo" in table and "x                    float32  [batch, 3]" in table
    assert main(["verify", str(out)]) == 0
    assert "ok     model/weights.bin" in capsys.readouterr().out
    digest = hashlib.sha256((model_dir / "weights.bin").read_bytes()).hexdigest()
    assert main(["shrink", str(out), str(tmp_path / "s.carton"), "--link", f"{digest}=http://127.0.0.1:9/w"]) == 0
    assert data["manifest_sha256"] in capsys.readouterr().out


def test_verify_names_the_bad_file(capsys: pytest.CaptureFixture[str], cache: Path) -> None:
    assert main(["verify", "-q", str(FIXTURES / "hash_mismatch.carton")]) == 1
    err = capsys.readouterr().err
    assert "ManifestError" in err and "model/model.bin has sha256" in err


def test_bad_cli_arguments(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack", str(model_dir), "-o", str(tmp_path / "m.carton"), "--runner", "r", "--framework-version",
                 "=1", "--no-validate", "--compat-version", "1", "--input", "x:float99"]) == 1  # fmt: skip
    assert "'float99' is not a carton dtype" in capsys.readouterr().err
    assert not (tmp_path / "m.carton").exists()


@pytest.mark.parametrize("command", ["info", "verify", "pack", "shrink"])
def test_help_is_complete(command: str) -> None:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    assert sub.description
    for action in sub._actions:
        assert action.help, f"{command} {action.dest} has no help"


def test_verify_a_folder_that_is_no_carton_reports_nothing_ok(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "file.txt").write_text("hello")
    assert main(["verify", str(tmp_path / "notes")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    assert "carton.toml is missing" in captured.err


def test_verify_says_linked_files_were_not_checked(
    model_dir: Path, tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    digest = hashlib.sha256((model_dir / "weights.bin").read_bytes()).hexdigest()
    out = tmp_path / "linked.carton"
    link = f"{digest}=http://127.0.0.1:9/w"
    assert main(["pack", str(model_dir), "-o", str(out), "--runner", "r", "--framework-version", "*",
                 "--compat-version", "1", "--no-validate", "--link", link]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    captured = capsys.readouterr()
    assert "linked model/weights.bin" in captured.out
    assert "valid carton" not in captured.out, captured.out
    assert "1 linked file (model/weights.bin) was not checked" in captured.err
    assert "--fetch-links" in captured.err
    assert main(["verify", "-q", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "was not checked" in captured.err
