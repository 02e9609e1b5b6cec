"""Pytest plugin: one local PostgreSQL server per test session.

Load it from tests/conftest.py with `pytest_plugins = [..., "tests.postgres_fixture"]`.
Tests that use it carry `@pytest.mark.postgres`; where PostgreSQL's binaries
are missing they are skipped with the reason (Debian: `apt-get install -y
postgresql`; `.ci/run` installs it, and under CI=true a missing PostgreSQL
fails instead of skipping).

- `postgres_cluster`: a running cluster (session scope) on a free loopback
  port, in a fresh directory under /tmp (pytest's own temp root is private to
  its owner, and as root the server runs as another user who must reach its
  directory); stopped and removed at the session's end, with a check that
  none of its processes survived.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.services.postgres import PostgresCluster, find_postgres_bin, start_postgres

from .processes import group_members


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    try:
        find_postgres_bin()
    except FileNotFoundError as missing:
        if os.environ.get("CI") == "true":  # .ci/run installs it: a skip there would hide a broken set-up
            pytest.fail(f"PostgreSQL is not installed in CI: {missing}")
        pytest.skip(f"PostgreSQL is not installed: {missing}")
    root = Path(tempfile.mkdtemp(prefix="rankflow-pg-"))
    try:
        # Not durable (no fsync): a test database has nothing to lose.
        cluster = start_postgres(root, durable=False)
        try:
            yield cluster
        finally:
            cluster.stop()
            assert not cluster.is_running()
            assert group_members(cluster.pid) == [], "a PostgreSQL process outlived the fixture"
    finally:
        shutil.rmtree(root, ignore_errors=True)
