"""The local SeaweedFS gives access only through the S3 port with its keys.

Before the server wrote a security.toml, the filer's HTTP and gRPC ports on
loopback accepted unauthenticated reads, writes and deletes, and the master's
`/col/delete` wiped a bucket's data; these tests attack every internal port
the way a local process would.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from infra.services.s3_server import S3Server
from tests.s3_fixture import TEST_BUCKET

pytestmark = pytest.mark.s3
GRPC_OFFSET = 10000


def _request(url: str, method: str, data: bytes | None = None, context: ssl.SSLContext | None = None) -> str:
    """What came back: an HTTP status, or the name of the error that stopped the request."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, data=data, method=method), timeout=120, context=context
        ) as response:
            return str(response.status)
    except urllib.error.HTTPError as error:
        return str(error.code)
    except (urllib.error.URLError, ssl.SSLError, ConnectionError, OSError) as error:
        return type(error).__name__


def _seed(s3_server: S3Server, s3_bucket_url: str) -> tuple[str, str]:
    fs = s3_server.filesystem()
    fs.pipe(f"{s3_bucket_url}/committed.txt", b"committed")
    return s3_bucket_url.removeprefix(f"s3://{TEST_BUCKET}/"), f"{s3_bucket_url}/committed.txt"


def _assert_untouched(s3_server: S3Server, s3_bucket_url: str) -> None:
    fs = s3_server.filesystem()
    assert fs.cat(f"{s3_bucket_url}/committed.txt") == b"committed"
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(s3_bucket_url, refresh=True)] == ["committed.txt"]


def test_filer_port_refuses_unauthenticated_reads_writes_and_deletes(s3_server, s3_bucket_url, tmp_path):
    prefix, _ = _seed(s3_server, s3_bucket_url)
    filer = s3_server.internal_ports["filer"]
    no_client_cert = ssl.create_default_context(cafile=str(s3_server.data_dir / "tls" / "ca.crt"))
    for scheme, context in (("http", None), ("https", no_client_cert)):
        base = f"{scheme}://127.0.0.1:{filer}/buckets/{TEST_BUCKET}/{prefix}"
        outcomes = {
            "read": _request(f"{base}/committed.txt", "GET", context=context),
            "write": _request(f"{base}/intruder.txt", "PUT", b"intruder", context=context),
            "post": _request(f"{base}/intruder2.txt", "POST", b"intruder", context=context),
            "delete": _request(f"{base}/committed.txt", "DELETE", context=context),
            "list": _request(f"{base}/", "GET", context=context),
        }
        assert not any(outcome.startswith("2") for outcome in outcomes.values()), (scheme, outcomes)
    _assert_untouched(s3_server, s3_bucket_url)


def test_master_admin_api_refuses_unauthenticated_callers(s3_server, s3_bucket_url):
    _seed(s3_server, s3_bucket_url)
    master = s3_server.internal_ports["master"]
    no_client_cert = ssl.create_default_context(cafile=str(s3_server.data_dir / "tls" / "ca.crt"))
    for scheme, context in (("http", None), ("https", no_client_cert)):
        # Without protection this deletes every volume of the bucket's collection.
        outcome = _request(f"{scheme}://127.0.0.1:{master}/col/delete?collection={TEST_BUCKET}", "GET", context=context)
        assert not outcome.startswith("2"), (scheme, outcome)
        assert not _request(f"{scheme}://127.0.0.1:{master}/dir/assign", "GET", context=context).startswith("2")
    _assert_untouched(s3_server, s3_bucket_url)


def test_every_internal_http_and_grpc_port_demands_the_servers_certificate(s3_server):
    ca = str(s3_server.data_dir / "tls" / "ca.crt")
    ports = [port + offset for port in s3_server.internal_ports.values() for offset in (0, GRPC_OFFSET)]
    assert len(ports) == 8
    for port in ports:
        context = ssl.create_default_context(cafile=ca)  # trusts the server, presents no certificate
        context.set_alpn_protocols(["h2", "http/1.1"])
        with socket.create_connection(("127.0.0.1", port), timeout=120) as raw:
            with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
                with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                    # TLS 1.3 reports a missing client certificate at the first read.
                    tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                    tls.recv(1)


def test_weed_shell_without_the_certificate_cannot_delete(s3_server, s3_bucket_url, tmp_path):
    """The real tool a local user would reach for: `weed shell` talks gRPC to the master and filer."""
    prefix, _ = _seed(s3_server, s3_bucket_url)
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    ports = s3_server.internal_ports
    # No security.toml in its working directory or home: an outsider's view.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEED_"))}, "HOME": str(tmp_path)}
    shell = subprocess.Popen(
        [weed, "shell", f"-master=127.0.0.1:{ports['master']}", f"-filer=127.0.0.1:{ports['filer']}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env=env,
        start_new_session=True,
    )
    try:
        # The shell never gets through: refused at the TLS handshake, it retries in silence (no output, no exit).
        # 20 s is ample for it to start and dial loopback (120 s before, waiting on the same silence).
        output, _ = shell.communicate(f"fs.rm -r /buckets/{TEST_BUCKET}/{prefix}\nexit\n".encode(), timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(shell.pid, 9)
        output, _ = shell.communicate()
    _assert_untouched(s3_server, s3_bucket_url)
    assert b"committed.txt" not in output
