"""``ferry reload | status | drain | weights``: the command line's side of the admin socket.

    ferry reload                      re-read the config file ferry serve runs, apply it live
    ferry status                      each version's state, readiness, workers, requests in flight;
                                      each alias's weights (in effect and in the file)
    ferry drain MODEL@VERSION         out of service, drained, workers stopped (the file still lists it)
    ferry weights ALIAS VERSION=W ... a new split for ALIAS at once (a rollback: all weight on the old one)

Each finds the socket and the token from ``--config`` (only its ``[state]`` and ``[admin]``
tables are read, so a file a reload would refuse still leads to the socket), else the embedded
default's state directory; ``--socket`` and ``FERRY_ADMIN_TOKEN`` override them. Exit status:
0 done, 1 refused (the message says why), 2 no ferry serve answered."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
import time
import tomllib

from batcher.core.backend import TOP_TENANTS
from gateway.config import ADMIN_SOCKET, ADMIN_TOKEN, StateConfig

CONTROL_COMMANDS = ("reload", "status", "drain", "weights")


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _address(args: argparse.Namespace) -> tuple[str, str]:
    """The admin socket and its token, for the config file given (or the embedded default)."""
    document: dict = {}
    if args.config:
        try:
            with open(args.config, "rb") as file:
                document = tomllib.load(file)
        except (OSError, tomllib.TOMLDecodeError):
            pass  # the server names what is wrong with it; its socket is where the defaults say

    def table(name: str) -> dict:
        value = document.get(name)
        return value if isinstance(value, dict) else {}

    state = os.path.expanduser(table("state").get("dir", StateConfig().dir))
    path = args.socket or os.path.expanduser(
        table("admin").get("socket") or os.path.join(state, ADMIN_SOCKET)
    )
    token = os.environ.get("FERRY_ADMIN_TOKEN")
    if token is None:
        try:
            with open(os.path.join(state, ADMIN_TOKEN), encoding="utf-8") as saved:
                token = saved.read().strip()
        except OSError:
            token = ""
    return path, token


def call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """One admin request: the status and the JSON answer."""
    address, token = _address(args)
    connection = _UnixConnection(address, timeout=args.timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={"Authorization": f"Bearer {token}",
                                                             "Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _run(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict | str | None:
    try:
        status, answer = call(args, method, path, body)
    except OSError as exc:
        print(f"ferry {args.command}: no ferry serve answered on its admin socket ({exc})", file=sys.stderr)
        raise SystemExit(2) from None
    if status != 200:
        print(f"ferry {args.command}: {answer.get('error', answer)}", file=sys.stderr)
        raise SystemExit(1)
    return answer["result"]


def reload_command(args: argparse.Namespace) -> int:
    print(f"ferry reload: {_run(args, 'POST', '/reload')}")
    return 0


def drain_command(args: argparse.Namespace) -> int:
    print(f"ferry drain: {_run(args, 'POST', '/drain', {'model': args.model})}")
    return 0


def weights_command(args: argparse.Namespace) -> int:
    weights = {}
    for pair in args.weights:
        version, _, weight = pair.rpartition("=")
        try:
            weights[version] = float(weight)
        except ValueError:
            print(f"ferry weights: {pair!r}: expected VERSION=WEIGHT, e.g. ferry-large@1=95", file=sys.stderr)
            return 1
    print(f"ferry weights: {_run(args, 'POST', '/weights', {'alias': args.alias, 'weights': weights})}")
    return 0


def status_command(args: argparse.Namespace) -> int:
    status = _run(args, "GET", "/status")
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    assert isinstance(status, dict), "GET /status answers a table"
    print(render_status(status))
    return 0


def render_status(status: dict) -> str:
    """The status as three tables: versions, the tenants with the most work queued, aliases."""
    lines = [f"config: {status['config']}"]
    last = status.get("last_reload") or {}
    if last:
        when = time.strftime("%H:%M:%S", time.localtime(last["at"]))
        lines.append(f"last reload at {when}: {'ok' if last['ok'] else 'refused'}: {last['message']}")
    rows: list[tuple[str, ...]] = [
        ("VERSION", "STATE", "READY", "WORKERS", "IN FLIGHT", "QUEUED", "PLACEMENT")
    ]
    for v in status["versions"]:
        rows.append(
            (
                v["name"],
                v["state"],
                "yes" if v["ready"] else "no",
                f"{v['workers_up']}/{v['workers']}",
                str(v["in_flight"]),
                _queued(v),
                ",".join(v.get("placements", ())) or "-",
            )
        )
    lines += ["", *_table(rows), ""]
    queued = sorted(((work, tenant, v["name"], v["queued_unit"]) for v in status["versions"]
                     for tenant, work in v.get("tenants", {}).items()), key=lambda row: -row[0])
    if queued:
        rows = [("TENANT", "VERSION", "QUEUED")]
        rows += [(tenant or "-", name, f"{work:g} {unit}")
                 for work, tenant, name, unit in queued[:TOP_TENANTS]]
        lines += [*_table(rows), ""]
    scaled = [f"{v['name']} scaled {v['scaling']}" for v in status["versions"] if v.get("scaling")]
    lines += [*scaled, ""] if scaled else []
    rows = [("ALIAS", "VERSION", "WEIGHT", "IN FILE", "SET BY")]
    for alias in status["aliases"]:
        for version in sorted({*alias["weights"], *alias["file"]}):
            rows.append(
                (
                    alias["name"],
                    version,
                    _share(alias["weights"], version),
                    _share(alias["file"], version),
                    alias["set_by"],
                )
            )
    return "\n".join(lines + _table(rows))


def _queued(version: dict) -> str:
    """Work waiting for a version in its own unit (``12 tokens``, ``3 requests``); "-" if closed."""
    return "-" if version["queued"] is None else f"{version['queued']} {version['queued_unit']}"


def _share(shares: dict, version: str) -> str:
    return f"{100 * shares[version]:.1f}%" if version in shares else "-"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip()
        for row in rows
    ]


def add_control_commands(commands) -> None:
    """The four admin sub-commands, each with ``--config`` and ``--socket``."""
    runs = {
        "reload": (reload_command, "re-read the config file ferry serve runs and apply it live"),
        "status": (status_command, "each model version's state, workers and weights"),
        "drain": (drain_command, "take MODEL@VERSION out of service, let it finish, stop its workers"),
        "weights": (weights_command, "set an alias's split at once: ALIAS VERSION=WEIGHT ..."),
    }
    for name, (run, help_text) in runs.items():
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument(
            "--config", help="the config file ferry serve runs (finds its admin socket and token)"
        )
        sub.add_argument("--socket", help="the admin socket (overrides the config's)")
        sub.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer")
        if name == "drain":
            sub.add_argument("model", help="the version, e.g. ferry-large@1")
        elif name == "weights":
            sub.add_argument("alias")
            sub.add_argument("weights", nargs="+", metavar="VERSION=WEIGHT")
        elif name == "status":
            sub.add_argument("--json", action="store_true", help="the status as JSON")
        sub.set_defaults(run=run)
