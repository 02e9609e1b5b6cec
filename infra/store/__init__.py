"""Object storage: the stores a run's objects live in, and the operations on them.

`open_store` makes the store for a `storage.url`; base.py holds the limits
(`StoreTimeouts`, `Deadline`) and error translation, objects.py the verified
uploads and digests, conditional.py the compare-and-swap the leases
(lease.py) and LATEST build on, verified.py the checked downloads,
preflight.py the writability probe run before a run writes anything, and
durable.py the local crash-safe writes.
"""

from .base import Deadline, StorageTimeoutError, StoreLocation, StoreTimeouts, open_store

__all__ = ["Deadline", "StorageTimeoutError", "StoreLocation", "StoreTimeouts", "open_store"]
