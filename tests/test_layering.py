"""The import rules of docs/architecture.md, checked on the source (AST) of every module, and complete ``__all__``s.

* `carton_protocol` imports nothing of ours;
* a runner imports `carton_protocol` and the framework-free tensor-file libraries (`carton.mcf`,
  `carton.safetensors`) only: never `carton.errors` or the host's internals;
* those libraries import nothing of the host but `carton.errors` (and each other);
* the host never imports a framework, anywhere (a model is only ever loaded into one in a runner process);
* the host imports only public `carton_protocol` names;
* carton's own parts import only parts of a lower layer (`LAYERS`), so there is no import cycle among them;
* every ``__all__`` lists exactly the public names a module defines, and names only what exists.

Imports are found wherever they are written (inside functions and ``if TYPE_CHECKING:`` blocks too), and so are
``importlib.import_module("carton...")`` calls with a constant name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import carton_protocol
import pytest

ROOT = Path(__file__).resolve().parent.parent
HOST = ROOT / "carton_core" / "carton"
PROTOCOL = ROOT / "protocol" / "carton_protocol"
ECHO = ROOT / "examples" / "carton-runner-echo" / "src"
RUNNER_PACKAGES = [*sorted((ROOT / "runners").glob("carton_runner_*")), ECHO]

#: carton's parts, lowest layer first: a part may import parts of a lower layer only (docs/architecture.md).
LAYERS: list[set[str]] = [
    {"_version"},
    {"errors"},  # the exception tree (and carton_protocol's runner faults, below carton)
    {"_paths", "_progress", "_warnings", "_semver"},  # small stand-alone helpers
    {"safetensors"},  # the framework-free tensor-file libraries: safetensors, then MCF (its converter reads
    {"mcf"},  # safetensors checkpoints)
    {"_format", "_environments"},  # the package format; isolated runner environments
    {"_runtime"},  # plugins, resolution, runner processes, Model
    {"_sandbox"},  # wraps the runtime's launch plans
    {"_workflows"},  # load, load_unpacked, pack: format + runtime + sandbox
    {"server"},
    {"ray", "cli"},  # the server on Ray Serve; the command line
    {"__main__"},
]
LEAF_LIBRARIES = {"mcf", "safetensors"}
#: Frameworks (and their tokenizers and templating) that only runner processes may import.
FRAMEWORKS = {"onnxruntime", "onnx", "xgboost", "torch", "transformers", "tokenizers", "jinja2", "sklearn", "gguf",
              "tensorflow", "jax", "safetensors"}  # fmt: skip


@dataclass(frozen=True)
class Import:
    module: str  # the module importing
    target: str  # the absolute name imported (a module, or module.name for `from module import name`)
    names: tuple[str, ...]  # for `from x import a, b`: the names
    line: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(package: Path, base: Path) -> Iterator[tuple[str, Path, ast.Module]]:
    for path in sorted(package.rglob("*.py")):
        if path.name.endswith("_pb2.py"):
            continue  # generated protobuf code
        yield module_name(path, base), path, ast.parse(path.read_text(), str(path))


def imports(module: str, path: Path, tree: ast.Module, known: set[str]) -> Iterator[Import]:
    """What `module` imports; ``from package import submodule`` counts as an import of the submodule (`known`
    holds every module name of the package)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = tuple(alias.name for alias in node.names)
            submodules = [name for name in names if f"{target}.{name}" in known]
            for name in submodules:
                yield Import(module, f"{target}.{name}", (), node.lineno)
            rest = tuple(name for name in names if name not in submodules)
            if rest:
                yield Import(module, target, rest, node.lineno)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            argument = node.args[0]
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                yield Import(module, argument.value, (), node.lineno)


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )


def _all_imports(package: Path, base: Path) -> list[Import]:
    parsed = list(sources(package, base))
    known = {module for module, _, _ in parsed}
    return [found for module, path, tree in parsed for found in imports(module, path, tree, known)]


def _base(package: Path) -> Path:
    """The folder a runner package's modules are named from (the echo example keeps its package under src/)."""
    return package if package == ECHO else package.parent


def _top(name: str) -> str:
    return name.split(".")[0]


def _is_ours(name: str) -> bool:
    top = _top(name)
    return top in ("carton", "carton_protocol") or top.startswith("carton_runner_")


def _part(name: str) -> str | None:
    """The part of carton a module belongs to (``_runtime`` for ``carton._runtime._model``), ``None`` for the
    ``carton`` package itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


HOST_IMPORTS = _all_imports(HOST, HOST.parent)
PROTOCOL_IMPORTS = _all_imports(PROTOCOL, PROTOCOL.parent)


def test_carton_protocol_imports_nothing_of_ours() -> None:
    found = [str(i) for i in PROTOCOL_IMPORTS if _is_ours(i.target) and _top(i.target) != "carton_protocol"]
    assert found == []


@pytest.mark.parametrize("package", RUNNER_PACKAGES, ids=lambda path: path.name)
def test_runners_import_the_protocol_and_the_tensor_file_libraries_only(package: Path) -> None:
    for found in _all_imports(package, _base(package)):
        if not _is_ours(found.target):
            continue
        top = _top(found.target)
        own = top == _top(found.module)
        if own or top == "carton_protocol":
            continue
        assert top == "carton", f"{found}: a runner imports another runner"
        part = _part(found.target)
        if part is None:  # `from carton import mcf`
            assert set(found.names) <= LEAF_LIBRARIES, f"{found}: only carton.mcf and carton.safetensors"
        else:
            assert part in LEAF_LIBRARIES, f"{found}: runners may import carton.mcf and carton.safetensors only"


def test_the_tensor_file_libraries_import_only_carton_errors() -> None:
    for found in HOST_IMPORTS:
        if _part(found.module) not in LEAF_LIBRARIES or _top(found.target) != "carton":
            continue
        part = _part(found.target)
        assert part in {"errors", *LEAF_LIBRARIES}, f"{found}: a leaf library imports the host"


def test_the_host_never_imports_a_framework() -> None:
    found = [str(i) for i in HOST_IMPORTS if _top(i.target) in FRAMEWORKS]
    assert found == []


def test_the_host_imports_only_public_protocol_names() -> None:
    public = set(carton_protocol.__all__)
    for found in HOST_IMPORTS:
        if _top(found.target) != "carton_protocol":
            continue
        assert found.target == "carton_protocol", f"{found}: a private module of carton_protocol"
        private = [name for name in found.names if name not in public]
        assert private == [], f"{found}: {private} are not in carton_protocol.__all__"
    for module, _, tree in sources(HOST, HOST.parent):
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "carton_protocol"
                and not node.attr.startswith("__")
            ):
                assert node.attr in public, f"{module}:{node.lineno} uses carton_protocol.{node.attr}"


def test_carton_parts_import_only_lower_layers() -> None:
    layer = {part: index for index, parts in enumerate(LAYERS) for part in parts}
    on_disk = {_part(module) for module, _, _ in sources(HOST, HOST.parent)} - {None}
    assert on_disk == set(layer), "every part of carton has a layer (update LAYERS and docs/architecture.md)"
    for found in HOST_IMPORTS:
        if _top(found.target) != "carton":
            continue
        source, target = _part(found.module), _part(found.target)
        if source is None:  # carton/__init__.py: the facade, above every part
            continue
        assert target is not None, f"{found}: a part imports the carton package itself (a cycle)"
        if source != target:
            assert layer[target] < layer[source], f"{found}: {target} is not below {source}"


def _public_definitions(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_") and name != "TYPE_CHECKING"}


def _bound_names(tree: ast.Module) -> set[str]:
    """Every name the module binds anywhere at its top level (imports under ``if`` included)."""
    bound = set(_public_definitions(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.Assign):
            bound.update(_public_definitions(ast.Module(body=[node], type_ignores=[])))
    return bound


def _declared_all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == "__all__" for target in targets):
            declared = ast.literal_eval(value)
            assert isinstance(declared, list) and all(isinstance(name, str) for name in declared)
            return declared
    return None


def _modules_with_all() -> Iterator[tuple[str, ast.Module]]:
    for package, base in ((HOST, HOST.parent), (PROTOCOL, PROTOCOL.parent)):
        for module, _, tree in sources(package, base):
            yield module, tree
    for package in RUNNER_PACKAGES:
        for module, _, tree in sources(package, _base(package)):
            yield module, tree


@pytest.mark.parametrize(("module", "tree"), list(_modules_with_all()), ids=lambda value: value
                         if isinstance(value, str) else "")  # fmt: skip
def test_every_all_is_complete(module: str, tree: ast.Module) -> None:
    declared = _declared_all(tree)
    if declared is None:
        assert module.endswith("__main__") or module.endswith("_shim"), f"{module} has no __all__"
        return
    assert len(declared) == len(set(declared)), f"{module}: __all__ lists a name twice"
    missing = sorted(set(declared) - _bound_names(tree) - {"__version__"})
    assert missing == [], f"{module}: __all__ lists {missing}, which the module does not define or import"
    unlisted = sorted(_public_definitions(tree) - set(declared))
    assert unlisted == [], f"{module}: defines public {unlisted} without listing them in __all__"
