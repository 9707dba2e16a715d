"""``carton serve``: the KServe v2 / Triton model server over a repository of cartons."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

__all__ = ["register"]


def _size(text: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    suffix = text[-1:].lower()
    try:
        value = int(text[:-1]) * units[suffix] if suffix in units else int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or a number with k, m or g)") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError("the size must be positive")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from exc
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError("a port is between 0 and 65535 (0 picks a free one)")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from exc
    if not value > 0:
        raise argparse.ArgumentTypeError("the number of seconds must be positive")
    return value


def _processes(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from exc
    if value < 1:
        raise argparse.ArgumentTypeError("there must be at least 1 server process")
    return value


def register(subparsers: Any) -> None:
    """Add ``carton serve`` to the ``carton`` parser's `subparsers` (called by `build_parser`)."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a repository of cartons over the KServe v2 / Triton protocol (HTTP and gRPC)",
        description=(
            "Serve the cartons of REPO over the KServe v2 / Triton inference protocol, with the binary tensor data, "
            "model repository, model configuration and statistics extensions, and Prometheus metrics at /metrics. "
            "Layout: REPO/<model>/<version>/model.carton (or an unpacked carton there), REPO/<model>.carton "
            "(version 1), optional REPO/<model>/config.json (Triton's ModelConfig in JSON). Stop with Ctrl-C."
        ),
    )
    parser.add_argument("repository", metavar="REPO", type=Path, help="the model repository folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--http-port", type=_port, default=8000, help="HTTP port (default: 8000; 0 picks one)")
    parser.add_argument("--grpc-port", type=_port, default=8001, help="gRPC port (default: 8001; 0 picks one)")
    parser.add_argument("--no-grpc", action="store_true", help="do not start the gRPC endpoint")
    parser.add_argument(
        "--model-control-mode",
        choices=("none", "explicit"),
        default="none",
        help="none: load every model at start, refuse load/unload requests; explicit: load only --load-model "
        "models at start and accept load/unload requests (default: none)",
    )
    parser.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="with --model-control-mode explicit, a model to load at start (repeatable; '*' loads all)",
    )
    parser.add_argument(
        "--max-body-size",
        type=_size,
        default=256 * 1024 * 1024,
        metavar="SIZE",
        help="largest request body accepted, in bytes or with k/m/g (default: 256m); larger ones get 413",
    )
    parser.add_argument(
        "--disable-upload",
        action="store_true",
        help="refuse load requests carrying 'file:' payloads (uploaded models) with 403",
    )
    parser.add_argument(
        "--workers", type=int, default=1, metavar="N",
        help="runner processes per model version unless its config sets instance_group (default: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--processes", type=_processes, default=1, metavar="N",
        help="server processes sharing the HTTP and gRPC ports (SO_REUSEPORT), each with its own copy of every model "
        "and its own runner processes, so that requests use more cores (default: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--sandbox",
        choices=("none", "best_effort", "strict"),
        default=None,
        help="sandbox policy for models of the repository (default: the runtime's default)",
    )
    parser.add_argument(
        "--upload-sandbox",
        choices=("best_effort", "strict"),
        default="best_effort",
        help="sandbox policy for uploaded models, which are untrusted (default: best_effort)",
    )
    parser.add_argument(
        "--memory-limit", type=_size, default=None, metavar="SIZE",
        help="address-space limit of each runner process, bytes or with k/m/g (exceeding it: RunnerMemoryLimit)",
    )  # fmt: skip
    parser.add_argument(
        "--cpu-limit", type=_positive, default=None, metavar="SECONDS",
        help="CPU-time limit of each runner process over its life (exceeding it: RunnerCPULimit)",
    )  # fmt: skip
    parser.add_argument(
        "--request-timeout", type=_positive, default=None, metavar="SECONDS",
        help="wall-time limit of each inference; the runner is killed and restarted, the request gets 503",
    )  # fmt: skip
    parser.add_argument(
        "--process-limit", type=int, default=None, metavar="N",
        help="processes and threads each runner may have (RLIMIT_NPROC; needs a sandbox with a non-root uid)",
    )  # fmt: skip
    parser.add_argument(
        "--load-timeout", type=float, default=300.0, metavar="SECONDS",
        help="a model load taking longer fails and is reported UNAVAILABLE (default: 300)",
    )  # fmt: skip
    parser.add_argument(
        "--strict-readiness", action="store_true",
        help="as Triton's --strict-readiness: /v2/health/ready is false while a model that was asked for failed to "
        "load (until it loads or is unloaded); by default readiness only waits for loads and unloads in progress",
    )  # fmt: skip
    parser.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import functools

    from .._runtime import RunnerLimits
    from ..server import ModelControlMode, ServerOptions, run_server
    from ..server._handle import load_carton
    from ..server._server import listening_text

    if args.workers < 1:
        raise SystemExit("carton serve: --workers must be at least 1")
    if args.load_model and args.model_control_mode != "explicit":
        raise SystemExit("carton serve: --load-model needs --model-control-mode explicit")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        limits = RunnerLimits(
            memory_bytes=args.memory_limit,
            cpu_seconds=args.cpu_limit,
            request_seconds=args.request_timeout,
            processes=args.process_limit,
        )
    except ValueError as exc:
        raise SystemExit(f"carton serve: {exc}") from exc
    limited = any(
        value is not None for value in (args.memory_limit, args.cpu_limit, args.request_timeout, args.process_limit)
    )
    run_server(
        on_started=lambda server: print(listening_text(server), file=sys.stderr, flush=True),
        options=ServerOptions(
            loader=functools.partial(load_carton, limits=limits) if limited else load_carton,
            repository=args.repository,
            host=args.host,
            http_port=args.http_port,
            grpc_port=None if args.no_grpc else args.grpc_port,
            model_control_mode=ModelControlMode(args.model_control_mode),
            load_models=tuple(args.load_model),
            max_body_size=args.max_body_size,
            allow_upload=not args.disable_upload,
            workers=args.workers,
            processes=args.processes,
            sandbox=args.sandbox,
            upload_sandbox=args.upload_sandbox,
            load_timeout=args.load_timeout,
            strict_readiness=args.strict_readiness,
        ),
    )
    return 0
