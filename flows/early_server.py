"""`rankflow run`'s temporary Prefect API server, started first so that its start-up overlaps the input checks.

Prefect starts its temporary server on the first API call, after `rankflow
run` has imported Prefect, read and checked every input and probed the store:
the server's start (its interpreter, imports and database: 5–30 s on two
cores) came after all of that. Here the CLI starts the very same server
process as its first act (Prefect's own command: uvicorn over
`prefect.server.api.server:create_app`, UI off, ephemeral settings, on
127.0.0.1), on another core while it checks the inputs, and hands it to
Prefect once Prefect is imported: it is registered as Prefect's default
temporary server (`SubprocessASGIServer()`, the instance Prefect's client
looks up; the same registration Prefect's own test harness makes), so
Prefect starts no second one and `flows.finish` stops it as before.

When Prefect turns out to have an API configured (PREFECT_API_URL, a profile,
a settings file) or its temporary server disabled, the early process is
stopped unused. It is stopped on every other way out too (bad input found by
the checks, a store that does not answer). It writes nothing the run owns:
only Prefect's own database under PREFECT_HOME, as the temporary server
always did.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from infra.launch.ports import pick_free_port

STOP_GRACE_S = 1.0
"""How long the server gets to stop on SIGTERM before it is killed (as `flows.finish`)."""
_PORT_IN_USE = 3
"""uvicorn's exit status when its port was taken meanwhile: start again on another port (Prefect does the same)."""


def server_command(port: int) -> list[str]:
    """Prefect's command for its temporary server (`SubprocessASGIServer._run_uvicorn_command`), on `port`."""
    spec = find_spec("prefect")
    assert spec is not None and spec.origin is not None, "Prefect is a dependency of rankflow"
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(Path(spec.origin).parent.parent),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]


SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
"""What Prefect sets for its temporary server: no UI, the ephemeral server's settings."""


@dataclass
class EarlyServer:
    """A temporary Prefect API server this process started and owns until it hands it to Prefect."""

    port: int
    process: subprocess.Popen
    handed: bool = False
    """Prefect owns it now (`hand_to_prefect`): it is stopped with Prefect's temporary server."""

    @classmethod
    def start(cls) -> EarlyServer | None:
        """Start the server now (returns at once); None when the environment names an API (nothing to start)."""
        if os.environ.get("PREFECT_API_URL"):
            return None
        port = pick_free_port()
        return cls(port=port, process=_spawn(port))

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until the API answers its health check; RuntimeError past `timeout_s` or if the server died.

        `timeout_s` counts from this call, as Prefect's own start counts from its own (never less time than
        Prefect gives its server: the head start while the inputs were checked comes on top).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.process.poll()
            if status == _PORT_IN_USE:
                self.port = pick_free_port()
                self.process = _spawn(self.port)
                continue
            if status is not None:
                raise RuntimeError(f"the temporary Prefect server exited with status {status} before it answered")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"the temporary Prefect server did not answer within {timeout_s:.0f} s; "
            "raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS or set PREFECT_API_URL to a running server"
        )

    def hand_to_prefect(self) -> bool:
        """Make this Prefect's temporary server (Prefect imported); False (and stopped) when Prefect will not use one.

        Waits for the server's health first (Prefect's own start would have, with its start-up limit).
        """
        from prefect.server.api.server import SubprocessASGIServer
        from prefect.settings import get_current_settings

        settings = get_current_settings()
        if settings.api.url or not settings.server.ephemeral.enabled:
            self.stop()
            return False
        self.wait_healthy(float(settings.server.ephemeral.startup_timeout_seconds))
        server = SubprocessASGIServer(port=self.port)
        server.server_process, server.running = self.process, True
        SubprocessASGIServer._instances[None] = server  # the instance Prefect's client asks for
        atexit.register(server.stop)  # as Prefect's start() registers it
        self.handed = True
        return True

    def stop_unless_handed(self) -> None:
        """On a way out before Prefect took the server (bad input, an unavailable store, an error): stop it."""
        if not self.handed:
            self.stop()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the server (SIGTERM, `grace_s`, SIGKILL) and reap it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _spawn(port: int) -> subprocess.Popen:
    return subprocess.Popen(
        server_command(port), env={**os.environ, **SERVER_ENV}, stdin=subprocess.DEVNULL, start_new_session=False
    )
