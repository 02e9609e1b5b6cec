"""One `rankflow server` on PostgreSQL for the session: the deployment and node worker tests share it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.deployments.prefect_server import RunningServer, running_prefect_server


@pytest.fixture(scope="session")
def prefect_server(postgres_cluster, tmp_path_factory) -> Iterator[RunningServer]:
    with running_prefect_server(postgres_cluster, tmp_path_factory.mktemp("prefect-server")) as server:
        yield server
