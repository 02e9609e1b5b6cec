"""`rankflow server`: a Prefect server on PostgreSQL, for deployments, work pools and workers.

    rankflow server [--port P] [--host H] [--db URL | --pg-dir DIR] [--log FILE]

With `--db` (or PREFECT_API_DATABASE_CONNECTION_URL set to a PostgreSQL URL)
the server uses that database. Otherwise it starts a local PostgreSQL cluster
in `--pg-dir` (created on first use, default `.rankflow/postgres`) on a free
loopback port, and stops it again on exit. The server binds 127.0.0.1 unless
`--host` says otherwise, logs to `--log`, and sends no telemetry. It runs until
Ctrl-C or SIGTERM, then stops the server and the cluster it started.

The plain commands it runs are in the README ("A Prefect server on PostgreSQL").
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from infra.launch.ports import LOOPBACK, port_is_free
from trainer_core.errors import ConfigError

if TYPE_CHECKING:
    from infra.services.prefect_server import PrefectServer

EXIT_OK, EXIT_FAILED = 0, 1
_ASYNC_DRIVER = "postgresql+asyncpg"
_POSTGRES_SCHEMES = ("postgresql", "postgres", _ASYNC_DRIVER)
_STARTUP_TIMEOUT_S = 180.0  # the first start migrates an empty database: about 10 s here, more on a loaded machine


def add_server_parser(commands: argparse._SubParsersAction) -> None:
    server = commands.add_parser("server", help="start a Prefect server on PostgreSQL, for deployments and workers")
    server.add_argument("--port", type=int, default=4200)
    server.add_argument(
        "--host",
        default=LOOPBACK,
        help="address to bind (default 127.0.0.1; 0.0.0.0 lets workers on other machines connect)",
    )
    database = server.add_mutually_exclusive_group()
    database.add_argument(
        "--db",
        default=None,
        help="PostgreSQL URL, e.g. postgresql://user:pass@db:5432/prefect "
        "(default: PREFECT_API_DATABASE_CONNECTION_URL, else --pg-dir)",
    )
    database.add_argument(
        "--pg-dir", default=None, help="start a local PostgreSQL cluster in this directory (default .rankflow/postgres)"
    )
    server.add_argument("--log", default=".rankflow/prefect-server.log", help="the server's log file")
    server.set_defaults(handler=cmd_server)


def cmd_server(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port}: choose a TCP port between 1 and 65535, e.g. --port 4200")
    if not port_is_free(args.port, LOOPBACK if args.host in ("0.0.0.0", "") else args.host):
        raise ConfigError(f"--port {args.port} is taken on {args.host}; choose another, e.g. --port {args.port + 1}")
    db_url = args.db or _database_url_from_env()
    if db_url is not None:
        db_url = asyncpg_url(db_url)
    return run_server(
        port=args.port,
        host=args.host,
        db_url=db_url,
        pg_dir=Path(args.pg_dir or ".rankflow/postgres"),
        log_path=Path(args.log),
    )


def asyncpg_url(url: str) -> str:
    """`url` with Prefect's async PostgreSQL driver; ConfigError for anything but PostgreSQL."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _POSTGRES_SCHEMES:
        raise ConfigError(
            f"--db {redact_url(url)}: not a PostgreSQL URL; write postgresql://USER:PASSWORD@HOST:PORT/DB "
            "(for SQLite on one machine use `rankflow ui`)"
        )
    return f"{_ASYNC_DRIVER}://{rest}"


def redact_url(url: str) -> str:
    """`url` with its password replaced by `***`, for messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _database_url_from_env() -> str | None:
    url = os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or os.environ.get(
        "PREFECT_SERVER_DATABASE_CONNECTION_URL"
    )
    return url if url and url.split("://", 1)[0] in _POSTGRES_SCHEMES else None


def run_server(*, port: int, host: str, db_url: str | None, pg_dir: Path, log_path: Path) -> int:
    """Start (PostgreSQL and) the Prefect server, print how to use it, and keep both up until a signal."""
    from infra.services.postgres import start_postgres
    from infra.services.prefect_server import start_prefect_server

    # A signal during start-up is honoured once the start-up returns: stopping
    # half-started services from a handler would race the code starting them.
    stop_requested = threading.Event()
    previous = {
        signum: signal.signal(signum, lambda *_: stop_requested.set()) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    cluster = server = None
    try:
        if db_url is None:
            try:
                cluster = start_postgres(pg_dir)
            except (FileNotFoundError, RuntimeError) as error:  # not installed; did not come up (log tail)
                print(f"rankflow server: {error}", file=sys.stderr)
                return EXIT_FAILED
            db_url = cluster.url()
            print(f"PostgreSQL {cluster.redacted_url()} (pid {cluster.pid}; data and log in {cluster.root})")
        try:
            server = start_prefect_server(
                db_url, log_path=log_path, port=port, host=host, startup_timeout_s=_STARTUP_TIMEOUT_S
            )
        except RuntimeError as error:
            print(f"rankflow server: {error}", file=sys.stderr)
            return EXIT_FAILED
        _print_usage(server, redact_url(db_url))
        while not stop_requested.wait(timeout=0.5):
            for name, process in (("the Prefect server", server), ("PostgreSQL", cluster)):
                if process is not None and not process.is_running():
                    print(f"rankflow server: {name} exited on its own; see {process.log_path}", file=sys.stderr)
                    return EXIT_FAILED
        print("Stopping ...", flush=True)
        return EXIT_OK
    finally:
        try:
            if server is not None:
                server.stop()
            if cluster is not None:
                cluster.stop()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _print_usage(server: PrefectServer, redacted_db_url: str) -> None:
    print(f"Prefect server at {server.api_url} on {redacted_db_url} (pid {server.pid}, log {server.log_path})")
    print(f"UI: {server.ui_url}")
    print("In another shell (and on every worker machine):")
    print(f"  export PREFECT_API_URL={server.api_url}")
    print("  rankflow deploy CONFIG --pool POOL        # register the training flow on a work pool")
    print("  prefect worker start --pool POOL          # run its flow runs on this machine")
    print("Stop with Ctrl-C.", flush=True)
