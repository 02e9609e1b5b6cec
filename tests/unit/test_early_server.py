"""`rankflow run` starts Prefect's temporary server itself, before the input checks, and hands it to Prefect.

The references: Prefect's own command for its temporary server (captured from
`SubprocessASGIServer`, so a Prefect upgrade that changes it fails here), the
instance Prefect's client looks up, and real processes (gone once stopped).
No Prefect server is started here (a local HTTP server answers the health check).
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest

from flows.early_server import SERVER_ENV, EarlyServer, server_command


def test_the_command_and_environment_are_prefect_s_own(monkeypatch):
    from prefect.server.api import server as prefect_server

    captured = {}

    def capture(args, env):
        captured.update(args=args, env=env)

    monkeypatch.setattr(prefect_server.subprocess, "Popen", capture)
    prefect_server.SubprocessASGIServer(port=41234)._run_uvicorn_command()
    prefect_server.SubprocessASGIServer._instances.pop(41234)
    assert server_command(41234) == captured["args"]
    assert SERVER_ENV.items() <= captured["env"].items()


def test_nothing_is_started_when_the_environment_names_an_api(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert EarlyServer.start() is None


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the handler's protocol
        self.send_response(200 if self.path == "/api/health" else 404)
        self.end_headers()
        self.wfile.write(b"true")

    def log_message(self, *args):
        pass


@pytest.fixture
def answering_server():
    """A process standing for the server, and a health endpoint on its port."""
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield EarlyServer(port=httpd.server_address[1], process=process)
    process.kill()
    process.wait()
    httpd.shutdown()


def test_handed_to_prefect_it_is_the_temporary_server_prefect_uses_and_starts_no_other(answering_server):
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, temporary_settings

    before = SubprocessASGIServer._instances.get(None)
    try:
        with temporary_settings(updates={PREFECT_API_URL: None, PREFECT_SERVER_EPHEMERAL_ENABLED: True}):
            assert answering_server.hand_to_prefect() and answering_server.handed
            server = SubprocessASGIServer()  # what Prefect's client calls, then .start()
            server.start()  # already running: no second process
            assert server.server_process is answering_server.process
            assert server.api_url == answering_server.api_url
            answering_server.stop_unless_handed()  # Prefect's now: left alone
            assert answering_server.process.poll() is None
            server.stop()  # as at exit: the process is gone
            assert answering_server.process.poll() is not None
    finally:
        SubprocessASGIServer._instances.pop(answering_server.port, None)
        if before is None:
            SubprocessASGIServer._instances.pop(None, None)
        else:
            SubprocessASGIServer._instances[None] = before


def test_when_prefect_has_an_api_configured_the_early_server_is_stopped_unused(answering_server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert not answering_server.hand_to_prefect()
    assert answering_server.process.poll() is not None and not answering_server.handed


def test_a_way_out_before_prefect_took_it_stops_it():
    server = EarlyServer(port=1, process=subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
    server.stop_unless_handed()
    assert server.process.poll() is not None
