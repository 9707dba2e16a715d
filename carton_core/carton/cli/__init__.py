"""The ``carton`` command. Each area registers its subcommands from its own module (see `_COMMAND_MODULES`)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import TextIO

from ..errors import CartonError

__all__ = ["build_parser", "main"]

#: Modules under carton.cli, each with ``register(subparsers) -> None`` adding subcommands whose handler is stored
#: as ``func`` (``(args) -> int``). Add a module here when its file exists.
_COMMAND_MODULES: tuple[str, ...] = ("_format", "_mcf", "_environments", "_serve", "_runtime", "_doctor")


def build_parser() -> argparse.ArgumentParser:
    """The ``carton`` argument parser: every area's module (`_COMMAND_MODULES`) registers its subcommands."""
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="carton",
        description="Package ML models as .carton files and run them in isolated runner processes.",
    )
    parser.add_argument("--version", action="version", version=f"carton {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    # On the command line a warning is a message for the user, not a pointer into carton's source.
    print(f"carton: warning: {category.__name__}: {message}", file=file or sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``carton`` command with `argv` (default: ``sys.argv[1:]``) and return its exit status: 0 on success,
    1 for a `carton.CartonError` (printed as one line), 2 for a usage error, 130 when interrupted."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    saved_showwarning = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        return int(args.func(args))
    except CartonError as exc:
        print(f"carton: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("carton: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`carton info ... | head`): not an error of ours. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    finally:
        warnings.showwarning = saved_showwarning


if __name__ == "__main__":
    sys.exit(main())
