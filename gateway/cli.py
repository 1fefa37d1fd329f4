"""``ferry``: the command line. One sub-command per job; each parses its flags and runs.

    ferry demo     push a few hundred requests through 8 reference workers and print the run
    ferry serve    the HTTP gateway (gateway/http/server.py)
    ferry reload | status | drain | weights   a running gateway's admin socket (gateway/ops/control.py)
    ferry simulate a scenario through the production batcher in virtual time (batcher/sim/)
    ferry fit      the real engine's step times on this machine, fitted into costs for simulate
    ferry check-config FILE   every error of a configuration file at once, each with its field
    ferry --version
"""

from __future__ import annotations

import argparse
import os
import sys

from gateway.log_format import configure as configure_logs
from gateway.ops.control import CONTROL_COMMANDS, add_control_commands
from gateway.version import version


def demo(args: argparse.Namespace) -> int:
    """Open-loop Poisson requests through the fixed mode's core and real `sleep` workers."""
    import trio

    from batcher.core.config import PoolConfig
    from batcher.fixed.worker import ProcessWorker
    from batcher.placement.local import process_workers
    from batcher.sim.fixed.load import open_loop

    spawn = process_workers(["sleep", "--latency-ms", str(args.latency_ms)], args.workers, kind=ProcessWorker)
    print(
        f"ferry demo: {args.workers} sleep workers ({args.latency_ms:g} ms a call), "
        f"{args.rate:g} requests/s for {args.duration:g} s, half paid, half free"
    )
    report = trio.run(
        open_loop,
        spawn,
        args.rate,
        args.duration,
        {"paid": 0.5, "free": 0.5},
        PoolConfig(workers=args.workers),
    )
    print(report.table())
    return 0 if not report.errors else 1


def check_config(args: argparse.Namespace) -> int:
    """Check a configuration file as ``ferry serve`` would (``FERRY_*`` variables applied),
    printing every error at once; exit 1 if there is one."""
    from gateway.config import check_config as check

    try:
        with open(args.file, encoding="utf-8") as file:
            _, errors = check(file.read(), args.file, os.environ)
    except OSError as exc:
        errors = [f"{args.file}: {exc.strerror}"]
    for error in errors:
        print(error)
    if not errors:
        print(f"{args.file}: ok")
    return 1 if errors else 0


def build_parser(control_only: bool = False) -> argparse.ArgumentParser:
    """Every sub-command; ``control_only``: the admin client's alone, which import neither the
    core nor the HTTP server, so that ``ferry weights`` (a rollback) starts in a fraction of
    the time ``ferry serve`` needs to import."""
    parser = argparse.ArgumentParser(prog="ferry", description="A trio batching scheduler for GPU workers.")
    parser.add_argument("--version", action="version", version=f"ferry {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if control_only:
        add_control_commands(commands)
        return parser
    from batcher.sim.fixed import simulate
    from gateway.http.server import add_serve_command
    from workers.engine.fit import command as fit

    sub = commands.add_parser("demo", help=demo.__doc__)
    sub.add_argument("--workers", type=int, default=8)
    sub.add_argument("--latency-ms", type=float, default=200.0)
    sub.add_argument("--rate", type=float, default=500.0, help="requests per second")
    sub.add_argument("--duration", type=float, default=1.0, help="seconds of arrivals")
    sub.set_defaults(run=demo)
    add_serve_command(commands)
    add_control_commands(commands)
    sub = commands.add_parser("check-config", help=(check_config.__doc__ or "").split("\n")[0])
    sub.add_argument("file", metavar="FILE", help="a TOML file (docs/configuration.md)")
    sub.set_defaults(run=check_config)
    sub = commands.add_parser(
        "simulate", help=simulate.main.__doc__, description=simulate.__doc__.split("\n\n")[0]
    )
    simulate.add_arguments(sub)
    sub.set_defaults(run=simulate.main)
    sub = commands.add_parser("fit", help=fit.main.__doc__, description=fit.__doc__.split("\n\n")[0])
    fit.add_arguments(sub)
    sub.set_defaults(run=fit.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_logs("text")  # ferry serve --log-format json writes JSON lines instead
    argv = sys.argv[1:] if argv is None else argv
    quick = bool(argv) and argv[0] in (*CONTROL_COMMANDS, "--version")  # imports neither core nor server
    args = build_parser(control_only=quick).parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
