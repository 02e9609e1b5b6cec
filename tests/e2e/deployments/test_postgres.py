"""The local PostgreSQL cluster `rankflow server --pg-dir` keeps: data and password survive a restart; nothing outlives a stop."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from infra.services.postgres import PostgresCluster, start_postgres
from tests.processes import group_members
from trainer_core.errors import BadInputError

pytestmark = [pytest.mark.postgres]


@pytest.fixture
def cluster_dir(postgres_cluster):
    del postgres_cluster  # only for its skip (or CI failure) where PostgreSQL is not installed
    base = Path(tempfile.mkdtemp(prefix="rankflow-pg-test-"))
    os.chmod(base, 0o755)  # as root the server runs as another user, who must enter it
    yield base / "pg"
    shutil.rmtree(base, ignore_errors=True)


def _execute(cluster: PostgresCluster, *statements: str):
    import asyncpg

    async def run():
        connection = await asyncpg.connect(
            host=cluster.host,
            port=cluster.port,
            user=cluster.user,
            password=cluster.password,
            database=cluster.database,
        )
        try:
            return [await connection.fetch(statement) for statement in statements]
        finally:
            await connection.close()

    return asyncio.run(run())


def test_a_restarted_cluster_keeps_its_data_and_password_and_binds_loopback_only(cluster_dir):
    with start_postgres(cluster_dir) as first:
        _execute(first, "CREATE TABLE kept (value int)", "INSERT INTO kept VALUES (42)")
        [[listen]] = _execute(first, "SHOW listen_addresses")
    assert listen["listen_addresses"] == "127.0.0.1"
    assert not first.is_running() and group_members(first.pid) == []
    with start_postgres(cluster_dir) as second:
        assert second.password == first.password
        (rows,) = _execute(second, "SELECT value FROM kept")
    assert [row["value"] for row in rows] == [42]
    assert (cluster_dir / "password").stat().st_mode & 0o077 == 0  # the password file is private


def test_a_wrong_password_is_refused(cluster_dir):
    import asyncpg

    with start_postgres(cluster_dir) as cluster:
        with pytest.raises(asyncpg.InvalidPasswordError):
            asyncio.run(
                asyncpg.connect(
                    host=cluster.host,
                    port=cluster.port,
                    user=cluster.user,
                    password="not-the-password",
                    database=cluster.database,
                )
            )


def test_a_directory_with_a_foreign_cluster_is_refused(cluster_dir):
    (cluster_dir / "pgdata").mkdir(parents=True)
    (cluster_dir / "pgdata" / "PG_VERSION").write_text("15\n")
    with pytest.raises(BadInputError, match="no `password` file; it was not made by rankflow"):
        start_postgres(cluster_dir)
