"""Fixtures of the storage tests: a loopback proxy between rankflow and the real SeaweedFS."""

from __future__ import annotations

import pytest

from infra.services.s3_server import CONFLICTING_AWS_ENV_VARS
from tests.storage.cutting_proxy import CuttingProxy


@pytest.fixture
def proxy(s3_server, monkeypatch):
    """A `CuttingProxy` in front of the session's server; the `AWS_*` variables point at the proxy."""
    proxy = CuttingProxy(s3_server.endpoint_url).start()
    for name in CONFLICTING_AWS_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.url}.items():
        monkeypatch.setenv(name, value)
    yield proxy
    proxy.stop()
