"""`check_store_writable`: before anything else, that the store at `storage.url` is reachable and writable.

The probe and the classes of its failure are infra/store/preflight.py's; this
module opens the store (through the registry, `open_store`), which the
backends that the probe serves cannot import without a cycle.
"""

from __future__ import annotations

import time

from . import open_store
from .base import ObjectStore, StoreTimeouts
from .preflight import check_credentials_setting, check_endpoint_setting, classified


def _probe_store(url: str, connect_timeout_s: float) -> ObjectStore:
    # Short limits and two attempts: a wrong endpoint must fail in seconds.
    return open_store(url, StoreTimeouts(connect_s=connect_timeout_s, read_s=connect_timeout_s, max_attempts=2))


def check_store_writable(url: str, connect_timeout_s: float = 5.0) -> dict:
    """Probe the store at `url` with short limits (`store.check_writable()`); returns the probe's timing.

    Raises StoreSettingError or StoreUnavailable naming the store, its endpoint and what to check.
    """
    started = time.perf_counter()
    check_endpoint_setting(url)
    check_credentials_setting(url)
    try:
        store = _probe_store(url, connect_timeout_s)
    except Exception as error:  # noqa: BLE001 - a client that cannot even be made is classified like a failed probe
        raise classified(url, error) from None
    store.check_writable()
    return {"store": url, "probe_s": time.perf_counter() - started}
