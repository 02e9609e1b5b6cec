"""A local PostgreSQL cluster for a Prefect server, in tests and for users.

`start_postgres(root)` creates a cluster under `root` with `initdb` on first
use (a generated password, SCRAM authentication, no Unix socket), starts the
server bound to 127.0.0.1 on a free port, creates the database Prefect uses,
and returns once an authenticated connection succeeds. `PostgresCluster.stop`
does a fast shutdown and kills the process group if that stalls.

The binaries come from the distribution's package (Debian: `postgresql`,
`/usr/lib/postgresql/<version>/bin`). `initdb` and `postgres` refuse to run as
root, so as root they run as an unprivileged user (`postgres` where it exists,
else `nobody`) through `setpriv`, and `root` is handed to that user.

`postgres` is started directly rather than through `pg_ctl start`: `pg_ctl`
daemonizes it, and a server we launch ourselves can be reaped and killed by
process group, so no test or Ctrl-C leaves one behind. The equivalent plain
commands are in the README ("A Prefect server on PostgreSQL").
"""

from __future__ import annotations

import asyncio
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from infra.services.local_process import LOOPBACK, log_tail, pick_free_port, process_is_running, stop_process_group
from trainer_core.errors import BadInputError

__all__ = ["PostgresCluster", "find_postgres_bin", "start_postgres"]

_SUPERUSER = "rankflow"
_DATA_DIR_NAME = "pgdata"
_PASSWORD_FILE = "password"
_LOG_NAME = "postgres.log"
_NUM_LAUNCH_ATTEMPTS = 3
_READY_POLL_INTERVAL_S = 0.2
_DATABASE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,62}")
_RUN_AS_CANDIDATES = ("postgres", "nobody")
# Durability settings a throwaway test database can drop: nothing to lose, and
# less disk traffic on a machine shared with other tests (Prefect's first
# start, migrations included, measured 12.4 s against 13.4 s durable here).
_NOT_DURABLE_SETTINGS = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")


@dataclass(frozen=True)
class PostgresCluster:
    """A running (or stopped) local PostgreSQL server."""

    host: str
    """Address the server listens on (loopback)."""
    port: int
    """TCP port of the server."""
    user: str
    """Superuser the cluster was created with."""
    password: str = field(repr=False)
    """Generated password of `user`; kept out of repr."""
    database: str
    """Database created for Prefect."""
    root: Path
    """Directory holding `pgdata/`, `password` and `postgres.log`."""
    pid: int
    """PID of the postmaster, also its process group id."""
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def log_path(self) -> Path:
        return self.root / _LOG_NAME

    def url(self, driver: str = "postgresql+asyncpg") -> str:
        """SQLAlchemy URL with the password, for PREFECT_API_DATABASE_CONNECTION_URL. Never log it."""
        return f"{driver}://{self.user}:{self.password}@{self.host}:{self.port}/{self.database}"

    def redacted_url(self, driver: str = "postgresql+asyncpg") -> str:
        """`url()` with the password replaced by `***`, for messages."""
        return f"{driver}://{self.user}:***@{self.host}:{self.port}/{self.database}"

    def is_running(self) -> bool:
        return process_is_running(self.pid, self._process)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Fast shutdown (SIGINT: end sessions, checkpoint, exit); SIGKILL the group after `timeout_s`. Idempotent.

        Fast shutdown waits for every backend before the postmaster exits, and
        SIGKILL hits the whole group: either way nothing of the server is left.
        """
        stop_process_group(self.pid, self._process, signal.SIGINT, timeout_s, "postgres")

    def __enter__(self) -> PostgresCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def find_postgres_bin() -> Path:
    """The directory of `initdb` and `postgres`: on PATH, or the newest under /usr/lib/postgresql."""
    on_path = shutil.which("initdb")
    if on_path is not None and shutil.which("postgres"):
        return Path(on_path).resolve().parent  # e.g. /usr/local/bin/initdb -> /usr/lib/postgresql/15/bin
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda path: int(path.parent.parent.name) if path.parent.parent.name.isdigit() else 0,
    )
    if versions:
        return versions[-1].parent
    raise FileNotFoundError(
        "PostgreSQL's initdb is neither on PATH nor under /usr/lib/postgresql/*/bin; "
        "install it (Debian: `apt-get install -y postgresql`), or point "
        "`rankflow server --db URL` at an existing PostgreSQL server"
    )


def start_postgres(
    root: Path, *, database: str = "prefect", durable: bool = True, startup_timeout_s: float = 60.0
) -> PostgresCluster:
    """Start (creating on first use) a cluster under `root` on a free loopback port and wait until it serves.

    `durable=False` turns off fsync and full-page writes: for throwaway test
    databases only. Raises FileNotFoundError when PostgreSQL is not installed,
    BadInputError when `root` is not usable by the user the server runs as, and
    RuntimeError (with the log's tail) when the server does not come up.
    """
    if not _DATABASE_NAME.fullmatch(database):
        raise BadInputError(f"database name {database!r}: use letters, digits and underscores, starting with a letter")
    bin_dir = find_postgres_bin()
    root = Path(root).expanduser().resolve()
    run_as = _unprivileged_user() if os.geteuid() == 0 else None
    _prepare_root(root, run_as)
    password = _initdb_once(bin_dir, root, run_as)
    deadline = time.monotonic() + startup_timeout_s
    for attempt in range(1, _NUM_LAUNCH_ATTEMPTS + 1):
        port = pick_free_port()
        process = _launch(bin_dir, root, port, durable, run_as)
        cluster = PostgresCluster(
            host=LOOPBACK,
            port=port,
            user=_SUPERUSER,
            password=password,
            database=database,
            root=root,
            pid=process.pid,
            _process=process,
        )
        try:
            last_error = _wait_until_ready(cluster, process, deadline)
        except BaseException:
            cluster.stop()
            raise
        if last_error is None:
            return cluster
        exit_code = process.poll()
        cluster.stop()
        if exit_code is not None and attempt < _NUM_LAUNCH_ATTEMPTS and time.monotonic() < deadline:
            continue  # most likely a port taken between the probe and the bind
        raise RuntimeError(
            f"PostgreSQL did not accept connections on {LOOPBACK}:{port} within {startup_timeout_s}s "
            f"({last_error}). Last lines of {cluster.log_path}:\n{log_tail(cluster.log_path)}"
        )
    raise AssertionError("unreachable: the last launch attempt always returns or raises")


def _unprivileged_user() -> pwd.struct_passwd:
    for name in _RUN_AS_CANDIDATES:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(
        "running as root, and neither a `postgres` nor a `nobody` user exists to run PostgreSQL as; "
        "create one (`useradd --system postgres`) or run rankflow as a non-root user"
    )


def _prepare_root(root: Path, run_as: pwd.struct_passwd | None) -> None:
    if run_as is not None:
        blocked = _first_untraversable_parent(root, run_as)
        if blocked is not None:
            raise BadInputError(
                f"PostgreSQL directory {root}: its parent {blocked} cannot be entered by user {run_as.pw_name!r}, "
                "which PostgreSQL runs as when rankflow runs as root; choose a directory under /var/lib or /srv "
                f"(e.g. --pg-dir /var/lib/rankflow/postgres), or run rankflow as a non-root user"
            )
    root.mkdir(parents=True, exist_ok=True)
    if run_as is not None:
        # The server writes its log and initdb its cluster here; pgdata itself is made by initdb as that user.
        os.chown(root, run_as.pw_uid, run_as.pw_gid)
    os.chmod(root, 0o700)


def _first_untraversable_parent(root: Path, user: pwd.struct_passwd) -> Path | None:
    """The first existing ancestor of `root` that `user` cannot enter (by mode bits), or None."""
    for parent in reversed(root.parents):
        try:
            info = parent.stat()
        except FileNotFoundError:
            return None  # created below by root with mode 0o777 & ~umask, normally traversable
        if info.st_uid == user.pw_uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid == user.pw_gid:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if not allowed:
            return parent
    return None


def _as_user(command: list[str], run_as: pwd.struct_passwd | None) -> list[str]:
    if run_as is None:
        return command
    return ["setpriv", f"--reuid={run_as.pw_uid}", f"--regid={run_as.pw_gid}", "--clear-groups", "--", *command]


def _child_env() -> dict[str, str]:
    # PG* variables of the caller (PGDATA, PGPORT, ...) must not redirect the server we start.
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}


def _initdb_once(bin_dir: Path, root: Path, run_as: pwd.struct_passwd | None) -> str:
    """Create the cluster unless `root` already holds one; return the superuser's password."""
    password_path = root / _PASSWORD_FILE
    data_dir = root / _DATA_DIR_NAME
    if (data_dir / "PG_VERSION").is_file():
        if not password_path.is_file():
            raise BadInputError(
                f"PostgreSQL directory {root} holds a cluster but no `{_PASSWORD_FILE}` file; "
                "it was not made by rankflow: point --db at that server, or choose an empty --pg-dir"
            )
        return password_path.read_text().strip()
    if data_dir.exists() and any(data_dir.iterdir()):
        raise BadInputError(
            f"PostgreSQL directory {data_dir} is not empty but holds no cluster (no PG_VERSION); "
            "remove it or choose another --pg-dir"
        )
    password = secrets.token_hex(16)
    descriptor = os.open(password_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(password + "\n")
    if run_as is not None:
        os.chown(password_path, run_as.pw_uid, run_as.pw_gid)
    command = [
        str(bin_dir / "initdb"),
        "-D",
        str(data_dir),
        f"--username={_SUPERUSER}",
        f"--pwfile={password_path}",
        "--auth=scram-sha-256",
        "--encoding=UTF8",
        "--no-locale",
    ]
    with open(root / "initdb.log", "wb") as log:
        result = subprocess.run(
            _as_user(command, run_as),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_child_env(),
            cwd=root,
            check=False,
        )
    if result.returncode != 0:
        raise RuntimeError(
            f"initdb failed with code {result.returncode}; see {root / 'initdb.log'}:\n{log_tail(root / 'initdb.log')}"
        )
    return password


def _launch(
    bin_dir: Path, root: Path, port: int, durable: bool, run_as: pwd.struct_passwd | None
) -> subprocess.Popen[bytes]:
    settings = [
        f"listen_addresses={LOOPBACK}",
        f"port={port}",
        # No Unix socket: its default directory (/var/run/postgresql) is not writable by an arbitrary user.
        "unix_socket_directories=",
        *(() if durable else _NOT_DURABLE_SETTINGS),
    ]
    command = [str(bin_dir / "postgres"), "-D", str(root / _DATA_DIR_NAME)]
    for setting in settings:
        command += ["-c", setting]
    with open(root / _LOG_NAME, "ab") as log:
        # Own session: stop() signals the postmaster and its backends together, and a
        # terminal's Ctrl-C reaches only the caller, which then stops it in order.
        return subprocess.Popen(
            _as_user(command, run_as),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_child_env(),
            cwd=root,
            start_new_session=True,
        )


def _wait_until_ready(cluster: PostgresCluster, process: subprocess.Popen[bytes], deadline: float) -> str | None:
    """Connect with the password and create the database; None once done, else the last error."""
    import asyncpg

    async def attempt() -> None:
        connection = await asyncpg.connect(
            host=cluster.host,
            port=cluster.port,
            user=cluster.user,
            password=cluster.password,
            database="postgres",
            timeout=5,
        )
        try:
            exists = await connection.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", cluster.database)
            if not exists:
                await connection.execute(f'CREATE DATABASE "{cluster.database}"')
        finally:
            await connection.close()

    last_error = "no attempt made"
    while True:
        if process.poll() is not None:
            return f"postgres exited with code {process.returncode}"
        try:
            asyncio.run(attempt())
        except (OSError, asyncio.TimeoutError, asyncpg.PostgresError) as error:
            # Refused until it listens; "the database system is starting up" during recovery.
            last_error = f"{type(error).__name__}: {error}"
        else:
            return None
        if time.monotonic() >= deadline:
            return last_error
        time.sleep(_READY_POLL_INTERVAL_S)
