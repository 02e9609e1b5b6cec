"""`rankflow ui`: the server's output goes to a log file (a chatty server never blocks), telemetry is off."""

from __future__ import annotations

import os
import signal
import socket
import sys

from flows.cli import parser as cli
from flows.cli.ui import server_env, start_server, stop_server, wait_healthy

# Writes 2 MiB to stdout and stderr before it serves /api/health: behind an
# unread pipe it would block after 64 KiB and never answer.
CHATTY_SERVER = """
import http.server, sys
for i in range(2048):
    sys.stderr.write("e" * 1023 + "\\n"); sys.stdout.write("o" * 1023 + "\\n")
sys.stderr.flush(); sys.stdout.flush()
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"true")
    def log_message(self, *args):
        sys.stderr.write("request\\n")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_chatty_server_is_healthy_and_stops_with_its_output_in_the_log(tmp_path):
    port = _free_port()
    log = tmp_path / "logs" / "server.log"
    process, api_url = start_server(port, log, command=[sys.executable, "-c", CHATTY_SERVER, str(port)])
    try:
        assert wait_healthy(api_url, 60, process), "the server never answered its health check"
    finally:
        returncode = stop_server(process, timeout_s=300)  # SIGKILL only past the bound
    assert returncode == -signal.SIGTERM  # SIGTERM stopped it: nothing blocked
    assert log.stat().st_size >= 4 * 1024 * 1024


def test_telemetry_is_off_for_rankflow_commands_unless_asked(monkeypatch):
    monkeypatch.delenv("PREFECT_SERVER_ANALYTICS_ENABLED", raising=False)
    cli._prefect_defaults()
    assert os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert server_env(4300)["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "true")  # the user's choice wins
    cli._prefect_defaults()
    assert server_env(4300)["PREFECT_SERVER_ANALYTICS_ENABLED"] == "true"


def test_the_ui_calls_the_api_on_the_port_it_was_given(monkeypatch):
    monkeypatch.delenv("PREFECT_UI_API_URL", raising=False)
    assert server_env(4321)["PREFECT_UI_API_URL"] == "http://127.0.0.1:4321/api"


def test_every_command_sets_the_defaults_before_prefect_loads(monkeypatch):
    monkeypatch.delenv("PREFECT_SERVER_ANALYTICS_ENABLED", raising=False)
    seen = {}
    monkeypatch.setattr(
        cli, "cmd_ui", lambda args: seen.setdefault("value", os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED")) and 0
    )
    cli.main(["ui", "--port", "1"])
    assert seen["value"] == "false"
