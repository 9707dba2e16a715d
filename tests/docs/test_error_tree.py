"""The exception tree drawn in `carton.errors`' docstring is the real one: every `CartonError` subclass that carton
defines (the host's, the server's, carton.ray's) is drawn once, under its real parent."""

from __future__ import annotations

import importlib
import re

import carton.errors
import pytest
from carton.errors import CartonError

#: The modules that define public exceptions of the tree.
MODULES = ["carton.errors", "carton.server.errors", "carton.ray"]
_NODE = re.compile(r"^(?P<indent>[ │]*)[├└]── (?P<name>\w+)")


def _drawn_tree() -> dict[str, str]:
    """Each drawn class name -> the name of the class drawn as its parent."""
    doc = carton.errors.__doc__ or ""
    lines = doc.splitlines()
    root = next(index for index, line in enumerate(lines) if line.strip() == "CartonError")
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = [(len(lines[root]) - len(lines[root].lstrip()), "CartonError")]
    for line in lines[root + 1 :]:
        match = _NODE.match(line)
        if match is None:
            if line.strip() and not line.lstrip().startswith("│") and not line.startswith(" " * 20):
                break
            continue
        depth = match.start("name")
        while stack and stack[-1][0] >= depth:
            stack.pop()
        name = match.group("name")
        assert name not in parents, f"{name} is drawn twice"
        parents[name] = stack[-1][1]
        stack.append((depth, name))
    return parents


def _defined_tree() -> dict[str, str]:
    parents: dict[str, str] = {}
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:  # carton.ray without the ray extra
            pytest.skip(f"{module_name} cannot be imported here: {error}")
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, CartonError) and value is not CartonError:
                parent = next(base for base in value.__mro__[1:] if issubclass(base, CartonError))
                parents[value.__name__] = parent.__name__
    return parents


def test_the_drawn_exception_tree_is_the_real_one() -> None:
    assert _drawn_tree() == _defined_tree()
