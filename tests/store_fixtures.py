"""The store fixture the publication and retention tests share: the in-memory store and a local directory."""

from __future__ import annotations

import pytest

from infra.store import open_store
from infra.store.memory import MemoryStore


@pytest.fixture(params=["memory", "local"])
def memory_or_local_store(request, tmp_path):
    """The same assertions on each backend: these tests use the store through its protocol only."""
    if request.param == "memory":
        with MemoryStore() as memory:
            yield memory
    else:
        yield open_store(str(tmp_path / "store"))
