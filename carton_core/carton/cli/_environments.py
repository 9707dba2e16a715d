"""``carton runner install|list|remove``: isolated runner environments, one per framework version."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._environments import (
    install_runner,
    list_runner_environments,
    rebuild_command,
    remove_runner_environment,
    stale_reason,
)
from .._environments._frameworks import FRAMEWORKS
from .._environments._registry import runners_dir

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``carton runner install|list|remove`` to the ``carton`` parser's `subparsers` (called by `build_parser`)."""
    parser = subparsers.add_parser(
        "runner",
        help="install, list and remove isolated runner environments",
        description=(
            "Manage isolated runner environments: a virtual environment per (runner, framework version) under "
            "the carton data directory, so that a model asking for an older framework version runs even when "
            "another one is installed next to carton. Resolution picks installed environments like any other "
            "runner; `carton runners` lists them all."
        ),
    )
    commands = parser.add_subparsers(dest="runner_command", metavar="SUBCOMMAND", required=True)

    install = commands.add_parser(
        "install",
        help="build an environment for a runner at the highest framework version matching a requirement",
        description=(
            "Find the highest release of the runner's framework on the package index that satisfies the "
            "Cargo-style requirement, build a virtual environment with it, the runner's dependencies and this "
            "carton, check that it can start the runner, then register it. An interrupted install registers "
            "nothing."
        ),
    )
    install.add_argument("name", choices=sorted(FRAMEWORKS), help="runner name")
    install.add_argument(
        "--framework-version",
        default="*",
        metavar="REQ",
        help='Cargo-style version requirement, e.g. "=1.19.2", "~1.18", ">=1.17, <1.20" (default: "*", newest)',
    )
    install.add_argument("--force", action="store_true", help="rebuild even if that version is already installed")
    install.set_defaults(func=_install)

    listing = commands.add_parser("list", help="list installed runner environments",
                                  description="List the registered runner environments.")
    listing.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    listing.set_defaults(func=_list)

    remove = commands.add_parser(
        "remove",
        help="remove runner environments",
        description="Unregister and delete the environments of a runner: one framework version, or --all.",
    )
    remove.add_argument("name", help="runner name")
    remove.add_argument("version", nargs="?", help="exact framework version of the environment to remove")
    remove.add_argument("--all", action="store_true", help="remove every environment of this runner")
    remove.set_defaults(func=_remove)


def _install(args: argparse.Namespace) -> int:
    environment = install_runner(
        args.name,
        framework_version=args.framework_version,
        force=args.force,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(environment.path)
    return 0


def _list(args: argparse.Namespace) -> int:
    environments = list_runner_environments()
    stale = {environment.path: stale_reason(environment) for environment in environments}
    if args.json:
        print(json.dumps([{**environment.to_json(), "path": str(environment.path), "python": str(environment.python),
                           "stale": stale[environment.path]} for environment in environments], indent=2))
        return 0
    if not environments:
        print(f"no runner environments installed (in {runners_dir()})")
        return 0
    rows = [("RUNNER", "FRAMEWORK", "COMPAT", "REQUIREMENT", "PATH")]
    rows += [(environment.runner_name, environment.framework_version, str(environment.runner_compat_version),
              environment.requirement, str(environment.path)) for environment in environments]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    for environment in environments:
        reason = stale[environment.path]
        if reason is not None:
            print(f"stale: {environment.runner_name} {environment.framework_version} is not offered to models "
                  f"({reason}); rebuild it: {rebuild_command(environment.runner_name, environment.framework_version)}")
    return 0


def _remove(args: argparse.Namespace) -> int:
    if (args.version is None) == (not args.all):
        print("carton runner remove: give either a VERSION or --all", file=sys.stderr)
        return 2
    removed = remove_runner_environment(args.name, None if args.all else args.version)
    if not removed:
        which = "" if args.all else f" {args.version}"
        print(f"carton runner remove: no environment for {args.name}{which}", file=sys.stderr)
        return 1
    for environment in removed:
        print(f"removed {environment.runner_name} {environment.framework_version} ({environment.path})")
    return 0
