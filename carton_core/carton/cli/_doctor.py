"""``carton doctor``: what this machine can do to isolate runners, layer by layer."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``carton doctor`` to the ``carton`` parser's `subparsers` (called by `build_parser`)."""
    doctor = subparsers.add_parser(
        "doctor",
        help="report, layer by layer, which sandbox protections this machine supports",
        description=(
            "Probe this machine the way carton.load(..., sandbox=...) does and report each sandbox layer: "
            "parent-death signal; PID, network, mount and IPC namespaces (bubblewrap, else carton's own unshare "
            "backend, which calls unshare(2) itself and needs no util-linux binary; each tried by starting a "
            "sandboxed process); the filesystem view; resource limits; Landlock (with its "
            "ABI version); the seccomp filter; a non-root uid. 'best_effort' runs with whatever is present and "
            "warns about the rest; 'strict' refuses to start unless every layer is present. Set "
            "CARTON_SANDBOX_BACKEND=bwrap|unshare to force a backend. Also whether each runner gets a cgroup of "
            "its own (cgroup v2, cgroup.kill), which is what ends, under any policy, a runner that fights its own "
            "process tree (CARTON_RUNNER_CGROUPS=0 turns that off)."
        ),
    )
    doctor.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    doctor.add_argument(
        "--strict", action="store_true", help="exit with status 1 unless the strict policy can start here"
    )
    doctor.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from .._runtime import cgroup_support
    from .._sandbox import machine_support
    from .._sandbox._wrap import forced_backend

    support = machine_support()
    cgroups = cgroup_support()
    forced = forced_backend()
    backend = support.backend(forced)
    layers = support.layers(backend)
    strict_ok = all(status.available for status in layers)
    if args.json:
        report = {
            "root": support.is_root,
            "backends": {
                name.value: {"path": support.backend_paths[name], "usable": why is None, "problem": why}
                for name, why in support.backends.items()
            },
            "backend": backend.value if backend else None,
            "landlock_abi": support.landlock_abi,
            "layers": {s.layer.value: {"available": s.available, "detail": s.detail} for s in layers},
            "strict": strict_ok,
            "runner_cgroups": {"available": cgroups.available, "detail": cgroups.detail},
        }
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print("backends:")
        for name, why in support.backends.items():
            state = "usable" if why is None else f"unusable: {why}"
            print(f"  {name.value:<8} {support.backend_paths[name] or '-'}: {state}")
        print(f"backend used: {backend.value if backend else 'none'}{' (forced)' if forced else ''}")
        print("layers:")
        for status in layers:
            print(f"  {'yes' if status.available else 'NO ':<4}{status.layer.value:<20} {status.detail}")
        print(f"runner cgroups: {'yes' if cgroups.available else 'NO'} ({cgroups.detail})")
        missing = [status.layer.value for status in layers if not status.available]
        if missing:
            print(f"strict: refused here (missing {', '.join(missing)}); best_effort: runs with a warning for each")
        else:
            print("strict: available (every layer is present)")
    return 1 if args.strict and not strict_ok else 0
