"""The documentation against the repository: every ``pip install`` line installs this project under its real
distribution name (the index's "carton" is another project) with extras that exist, every file a document cites
exists, and no document names a path of one particular machine."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DISTRIBUTION = PYPROJECT["project"]["name"]
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
#: Where users read commands: the README, docs, the examples (their docstrings), fuzz harnesses' docstrings, CI.
DOCUMENTS = sorted(
    [ROOT / "README.md", ROOT / ".ci" / "run", *ROOT.glob("docs/*.md"), *ROOT.glob("examples/**/*.md"),
     *ROOT.glob("examples/**/*.py"), *ROOT.glob("fuzz/*.py"), *ROOT.glob("bench/*.py")]
)  # fmt: skip
#: Top-level folders of the repository: a cited path starting with one of these must exist.
TOP_LEVEL = ("carton_core/", "protocol/", "runners/", "tests/", "examples/", "docs/", "bench/", "deploy/", "fuzz/",
             ".ci/")  # fmt: skip
#: Paths inside the carton package are also cited from the package's root (carton/server/...).
PACKAGE_ROOTS = {"carton/": ROOT / "carton_core", "carton_protocol/": ROOT / "protocol"}


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _pip_install_commands(text: str) -> list[str]:
    commands = []
    for line in text.splitlines():
        for match in re.finditer(r"pip install ([^`&|#;\n]*)", line):
            commands.append(match.group(1).strip())
    return commands


def _requirements(command: str) -> list[str]:
    """The requirement arguments of one ``pip install`` command (options and their values left out)."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    found: list[str] = []
    skip_next = False
    for word in words:
        if skip_next:
            skip_next = False
            continue
        if word in ("-r", "-c", "--python", "--target", "-t", "--index-url", "-i", "--extra-index-url"):
            skip_next = True
            continue
        if word.startswith("-") or word in ("...",):
            continue
        found.append(word)
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=_relative)
def test_every_pip_install_line_names_the_real_distribution(document: Path) -> None:
    problems = []
    for command in _pip_install_commands(document.read_text()):
        for argument in _requirements(command):
            local = argument.startswith((".", "/")) or "/" in argument.split("[")[0]
            if local:
                # A checkout (`pip install -e ".[onnx]"`): its extras must exist when it is this project's.
                folder, _, extras = argument.partition("[")
                if folder.rstrip("/") in (".", "") and extras:
                    unknown = set(extras.rstrip("]").split(",")) - EXTRAS
                    if unknown:
                        problems.append(f"{argument!r}: no extra {sorted(unknown)} in pyproject.toml")
                continue
            try:
                requirement = Requirement(argument)
            except InvalidRequirement:
                continue  # prose after the command, a placeholder such as FILE.whl
            name = canonicalize_name(requirement.name)
            if name == "carton":
                problems.append(f"{argument!r} installs the index's unrelated 'carton', not {DISTRIBUTION}")
            if name == canonicalize_name(DISTRIBUTION):
                unknown = requirement.extras - EXTRAS
                if unknown:
                    problems.append(f"{argument!r}: no extra {sorted(unknown)} in pyproject.toml")
    assert not problems, f"{_relative(document)}: " + "; ".join(problems)


@pytest.mark.parametrize("pyproject", sorted(ROOT.glob("**/pyproject.toml")), ids=_relative)
def test_no_distribution_depends_on_the_indexs_carton(pyproject: Path) -> None:
    """This project's own extras and the example plugins' dependencies name carton-runtime, never "carton"."""
    project = tomllib.loads(pyproject.read_text())["project"]
    assert canonicalize_name(project["name"]) != "carton"
    requirements = [*project.get("dependencies", [])]
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    named = [canonicalize_name(Requirement(text).name) for text in requirements]
    assert "carton" not in named, f"{_relative(pyproject)} depends on the index's unrelated 'carton'"


def _cited_paths(text: str) -> set[str]:
    cited = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.rstrip(".,:;)")
        if any(character in token for character in "*<>{}$") or "..." in token:
            continue
        if token.startswith(TOP_LEVEL) or token.startswith(tuple(PACKAGE_ROOTS)):
            cited.add(token.split("::")[0].split("#")[0])
    return cited


@pytest.mark.parametrize("document", [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))], ids=_relative)
def test_every_file_a_document_cites_exists(document: Path) -> None:
    text = document.read_text()
    missing = []
    for cited in sorted(_cited_paths(text)):
        root = next((base for prefix, base in PACKAGE_ROOTS.items() if cited.startswith(prefix)), ROOT)
        path = cited.split(":")[0]
        if not (root / path).exists():
            missing.append(cited)
    # Markdown links to files, relative to the document, and top-level documents named in prose (DEVELOPERS.md).
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in link and not (document.parent / link).resolve().is_relative_to(ROOT):
            missing.append(f"{link} (outside the repository)")
        elif "://" not in link and not (document.parent / link).exists():
            missing.append(link)
    for name in re.findall(r"(?<![\w/.-])([A-Z][A-Z_]+\.md)\b", text):
        if not (ROOT / name).exists():
            missing.append(name)
    assert not missing, f"{_relative(document)} cites files that are not in the repository: {missing}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=_relative)
def test_no_document_names_a_path_of_one_machine(document: Path) -> None:
    found = re.findall(r"(?<![\w.])/(?:work|root|home|tmp|Users)/[^\s`'\")]*", document.read_text())
    assert not found, f"{_relative(document)} names machine paths: {found}"
