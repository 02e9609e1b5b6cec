"""A lease on a name in the object store: one holder at a time, across processes and machines.

A lease is a small JSON object (owner, token, generation, expiry) written with
compare-and-swap (infra/store/conditional.py): `If-None-Match: *` to take a free
lease, `If-Match` to renew, release or take over one whose holder let it
expire. While held, a heartbeat thread renews it every `heartbeat_s`; a
holder that stops renewing (killed, paused, cut off) loses it `ttl_s` after
its last renewal, and the next acquirer takes it over, so a crash never
wedges the run. Expiry is wall-clock time: machines sharing a lease need
clocks within a small fraction of `ttl_s` of each other (NTP).

A holder that is known to be dead is not waited for: when the lease names
this machine and a process that no longer exists (or this very process, which
no longer holds it — an earlier try that crashed), it is taken over at once.

Fencing: a holder whose lease was taken over learns it at its next renewal
(`lost`, `check()` raises LeaseLostError); callers check before each write
that must not come from a stale holder.

What the store holds decides, never a lost answer: a write that was refused
or failed is settled by reading the lease object back. If it holds this
holder's token, the lease is this holder's (a write of its own landed and only
the answer was lost), whatever tag the holder last saw; only another token
(a takeover) or a released record is a loss. A holder that could not renew
while the store was unreachable keeps trying, and gets its lease back if
nobody took it over meanwhile.

    with Lease.for_run(store, run_id, "finalizer", ttl_s=60).hold(wait_s=600) as lease:
        ...                      # heartbeat running; lease.check() before critical writes

The publication finalizer (one committer per run) uses it; a run lease (one
run of a run id at a time) is the same object under another name.
"""

from __future__ import annotations

import json
import os
import posixpath
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from .base import ObjectStore, Versioned
from .conditional import check_conditional_writes, create_if_absent, read_versioned, replace_if_unchanged

LEASES_DIR = "leases"


def lease_key(run_id: str, name: str) -> str:
    """The key of the lease `name` of a run: `RUN_ID/leases/NAME.json`."""
    return posixpath.join(run_id, LEASES_DIR, f"{name}.json")


def default_owner() -> str:
    """`host:pid`, what a person needs to find the holder."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _process_start(pid: int) -> str:
    """When process `pid` started (clock ticks since boot), to tell it from a later one with its pid; '' if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


# Tokens of the leases this process holds right now. A lease object naming this
# process with a token not in here was left by an earlier try that crashed.
_HELD_TOKENS: set[str] = set()
_HELD_LOCK = threading.Lock()


def _holder_is_dead(holder: "LeaseRecord") -> bool:
    """Whether the holder certainly no longer runs: on this machine, and its process is gone."""
    if not holder.host or holder.host != socket.gethostname() or holder.pid <= 0:
        return False  # another machine: only the expiry can tell
    if holder.pid == os.getpid():
        with _HELD_LOCK:
            return holder.token not in _HELD_TOKENS
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return bool(holder.process_start) and _process_start(holder.pid) != holder.process_start


Seconds = Annotated[float, Field(allow_inf_nan=False)]
"""A wall-clock time or a duration: a NaN expiry would hold the lease for ever (`now >= nan` is never true)."""


class LeaseRecord(BaseModel):
    """The lease object's content: strict types, so a record that is not one reads as unreadable (taken over).

    Unknown keys are ignored, not refused: a lease written by a newer rankflow
    with one more field must still guard its holder here, not be taken over as
    unreadable while it is alive.
    """

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    owner: str
    token: str
    """Unique per acquisition: tells this holder's writes from a later holder's."""
    generation: int = Field(ge=0)
    """Increases with every acquisition of this lease (a fencing number: a later holder has a larger one)."""
    acquired_at: Seconds
    renewed_at: Seconds
    expires_at: Seconds
    ttl_s: Seconds
    host: str = ""
    pid: int = 0
    process_start: str = ""
    released: bool = False
    """Given up by its holder: free, but kept so the next generation counts on from it."""

    def expired(self, now: float) -> bool:
        return self.released or now >= self.expires_at

    def to_bytes(self) -> bytes:
        # The bytes of every lease written before this model (sorted keys, default separators).
        return json.dumps(self.model_dump(), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseRecord:
        """The record in `data`; ValueError (pydantic's ValidationError) if it is not one."""
        return cls.model_validate(json.loads(data))


def _describe(holder: LeaseRecord | None, now: float) -> str:
    if holder is None:
        return "a holder whose lease object is unreadable"
    left = holder.expires_at - now
    when = f"expires in {left:.0f} s" if left > 0 else f"expired {-left:.0f} s ago"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.expires_at))
    return f"{holder.owner} (generation {holder.generation}, {when}, at {stamp})"


class LeaseHeldError(TimeoutError):
    """Someone else holds the lease; the message names the holder and when it expires."""

    def __init__(self, path: str, holder: LeaseRecord | None, waited_s: float, purpose: str):
        self.path, self.holder, self.waited_s = path, holder, waited_s
        super().__init__(
            f"{purpose}: the lease {path} is held by {_describe(holder, time.time())}; waited {waited_s:.0f} s. "
            "Wait for that holder to finish, or stop it: a holder that stops renewing loses the lease "
            f"{holder.ttl_s if holder else 'ttl_s'} s after its last renewal and this retry takes it over"
        )


class LeaseLostError(RuntimeError):
    """This holder's lease expired and was taken over: stop writing what it guards."""


class Lease:
    """A lease on `path` in `store`, for one owner; see the module docstring."""

    def __init__(
        self,
        store: ObjectStore,
        path: str,
        *,
        owner: str | None = None,
        ttl_s: float = 60.0,
        heartbeat_s: float | None = None,
        purpose: str = "lease",
        clock: Callable[[], float] = time.time,
    ):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s={ttl_s} must be positive (seconds a lease outlives its last renewal)")
        self.store, self.path, self.ttl_s = store, path, ttl_s
        self.owner = owner or default_owner()
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else ttl_s / 3
        self.purpose = purpose
        self._clock = clock
        self._record: LeaseRecord | None = None
        self._tag: str | None = None
        self._lost = False
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_run(cls, store: ObjectStore, run_id: str, name: str, **kwargs) -> "Lease":
        """The lease `name` of run `run_id`: `RUN_ID/leases/NAME.json` in the store."""
        kwargs.setdefault("purpose", f"{name} of run {run_id}")
        return cls(store, store.path(lease_key(run_id, name)), **kwargs)

    @property
    def held(self) -> bool:
        return self._record is not None and not self._lost

    @property
    def lost(self) -> bool:
        return self._lost

    @property
    def record(self) -> LeaseRecord | None:
        return self._record

    # -- acquire -----------------------------------------------------------

    def acquire(self, wait_s: float = 0.0, poll_s: float = 0.5) -> "Lease":
        """Take the lease, waiting up to `wait_s`; raises LeaseHeldError naming the holder."""
        if self.held:
            return self
        check_conditional_writes(self.store, self.store.key_of(self.path.rsplit("/", 1)[0]))
        started = time.monotonic()
        while True:
            holder = self._try_acquire()
            if self.held:
                return self
            waited = time.monotonic() - started
            if waited >= wait_s:
                raise LeaseHeldError(self.path, holder, waited, self.purpose)
            time.sleep(min(poll_s, max(0.01, wait_s - waited)))

    def _new_record(self, generation: int) -> LeaseRecord:
        now = self._clock()
        return LeaseRecord(
            owner=self.owner,
            token=secrets.token_hex(16),
            generation=generation,
            acquired_at=now,
            renewed_at=now,
            expires_at=now + self.ttl_s,
            ttl_s=self.ttl_s,
            host=socket.gethostname(),
            pid=os.getpid(),
            process_start=_process_start(os.getpid()),
        )

    def _try_acquire(self) -> LeaseRecord | None:
        """One attempt; returns the current holder when it fails."""
        current = read_versioned(self.store, self.path)
        if current is None:
            record = self._new_record(generation=1)
            tag, found = self._write(record, lambda: create_if_absent(self.store, self.path, record.to_bytes()))
        else:
            holder = _parse(current.data)  # an unreadable lease object guards nothing: take it over
            if holder is not None and not holder.expired(self._clock()) and not _holder_is_dead(holder):
                return holder
            record = self._new_record(generation=(holder.generation + 1) if holder else 1)
            tag, found = self._write(
                record, lambda: replace_if_unchanged(self.store, self.path, record.to_bytes(), current.tag)
            )
        if tag is None:
            return _parse(found.data) if found is not None else None
        with self._mutex:
            self._record, self._tag, self._lost = record, tag, False
        with _HELD_LOCK:
            _HELD_TOKENS.add(record.token)
        return None

    def _write(self, record: LeaseRecord, write: Callable[[], str | None]) -> tuple[str | None, Versioned | None]:
        """Run a conditional write of `record`: (its tag, None) if the store holds it, else (None, what it holds).

        A write that was refused or raised is settled by what the store holds:
        exactly this record means it landed and only its answer was lost.
        """
        try:
            tag = write()
        except OSError:
            try:
                current = read_versioned(self.store, self.path)
            except OSError:
                current = None
            if current is None or current.data != record.to_bytes():
                raise  # the write's own error stands: it did not land, or the store cannot say
            return current.tag, None
        if tag is not None:
            return tag, None
        current = read_versioned(self.store, self.path)
        if current is not None and current.data == record.to_bytes():
            return current.tag, None
        return None, current

    # -- while held --------------------------------------------------------

    def renew(self) -> None:
        """Push the expiry `ttl_s` ahead; raises LeaseLostError if it was taken over."""
        with self._mutex:
            if self._record is None or self._lost:
                raise LeaseLostError(f"{self.purpose}: the lease {self.path} is not held by {self.owner}")
            now = self._clock()
            renewed = self._record.model_copy(update={"renewed_at": now, "expires_at": now + self.ttl_s})
            tag = self._replace_own(renewed)
            if tag is None:
                self._lost = True
                raise LeaseLostError(
                    f"{self.purpose}: the lease {self.path} of {self.owner} expired and was taken over; stop and retry"
                )
            self._record, self._tag = renewed, tag

    def _replace_own(self, record: LeaseRecord) -> str | None:
        """Write `record` over this holder's lease object; its tag, or None if another holder's is there.

        The tag this holder last saw may be stale: a renewal of its own that
        landed without an answer. A stored record with this holder's token is
        still this holder's, and is replaced under the tag it really has.
        """
        seen = self._tag
        assert seen is not None  # set together with `_record`, which a renewal requires
        tag, found = self._write(record, lambda: replace_if_unchanged(self.store, self.path, record.to_bytes(), seen))
        if tag is not None or found is None:
            return tag
        stored = _parse(found.data)
        if stored is None or stored.token != record.token or stored.released:
            return None  # another holder's record (a takeover), or given up
        tag, _ = self._write(record, lambda: replace_if_unchanged(self.store, self.path, record.to_bytes(), found.tag))
        return tag

    def check(self) -> None:
        """Confirm, against the store, that this owner still holds the lease (fencing).

        Held means the store holds this holder's token. One that expired
        unrenewed (the store unreachable, the process paused) and that nobody
        took over is renewed here; another token, or none, is a loss.
        """
        if self._record is None or self._lost:
            raise LeaseLostError(f"{self.purpose}: the lease {self.path} is not held by {self.owner}")
        current = read_versioned(self.store, self.path)
        stored = _parse(current.data) if current is not None else None
        if current is None or stored is None or stored.token != self._record.token or stored.released:
            self._lost = True
            raise LeaseLostError(
                f"{self.purpose}: the lease {self.path} of {self.owner} was taken over; stop and retry"
            )
        with self._mutex:
            # A renewal of ours that landed without an answer: the store's (newer) copy counts.
            if self._record is not None and current.tag != self._tag and stored.renewed_at >= self._record.renewed_at:
                self._record, self._tag = stored, current.tag
        if stored.expired(self._clock()):
            self.renew()  # nobody took it over meanwhile: it is still ours, for ttl_s more

    def release(self) -> bool:
        """Give the lease up (only if still ours); True if it was released.

        The object stays, marked released, so the next holder's generation
        counts on from this one's.
        """
        self.stop_heartbeat()
        with self._mutex:
            record, lost = self._record, self._lost
            if record is None:
                return False
            try:
                if lost:
                    return False
                now = self._clock()
                released = record.model_copy(update={"renewed_at": now, "expires_at": now, "released": True})
                return self._replace_own(released) is not None
            finally:
                # Given up even when the store could not be told: a retry in this
                # process takes a record it no longer holds over at once.
                self._record, self._tag = None, None
                with _HELD_LOCK:
                    _HELD_TOKENS.discard(record.token)

    # -- heartbeat ---------------------------------------------------------

    def start_heartbeat(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"lease-heartbeat {self.path}", daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=self.heartbeat_s + 30)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.renew()
            except LeaseLostError:
                return
            except OSError:
                # The store is unreachable (or an answer was lost): keep trying. The
                # store decides: this holder's token still there means still held;
                # meanwhile `check()` fails, with the store, and writers stop.
                continue

    @contextmanager
    def hold(self, wait_s: float = 0.0) -> Iterator["Lease"]:
        """Acquire (waiting up to `wait_s`), heartbeat while inside, release on the way out."""
        self.acquire(wait_s)
        self.start_heartbeat()
        try:
            yield self
        finally:
            self.release()

    def __enter__(self) -> "Lease":
        self.acquire()
        self.start_heartbeat()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def _parse(data: bytes) -> LeaseRecord | None:
    try:
        return LeaseRecord.from_bytes(data)
    except (ValueError, KeyError, TypeError):
        return None


def read_lease_renewed(
    store: ObjectStore, path: str, token: str, clock: Callable[[], float] = time.time
) -> LeaseRecord | None:
    """`read_lease`, after renewing for its ttl a record that expired unrenewed but still carries `token`.

    For a fence that holds only the token (a stage in another process than the
    heartbeat): as `Lease.check()` does for its holder, a lapse nobody took
    over is no loss. The write is conditional on the version read, so a
    takeover or a renewal landing meanwhile wins and this one is refused; the
    record read back says which. A renewal that failed and did not land raises
    its error (an outage), never passes for a loss.
    """
    current = read_versioned(store, path)
    record = _parse(current.data) if current is not None else None
    if current is None or record is None or record.released:
        return None
    now = clock()
    if record.token != token or not record.expired(now):
        return record
    renewed = record.model_copy(update={"renewed_at": now, "expires_at": now + record.ttl_s})
    try:
        replace_if_unchanged(store, path, renewed.to_bytes(), current.tag)
    except OSError:
        after = read_lease(store, path)
        if after is not None and after.token == token and after.expired(clock()):
            raise  # it did not land, and nothing else did: the store could not be written
        return after
    return read_lease(store, path)


def read_lease(store: ObjectStore, path: str) -> LeaseRecord | None:
    """The current holder's record, or None if the lease is free (never taken, released) or unreadable."""
    current = read_versioned(store, path)
    record = _parse(current.data) if current is not None else None
    return None if record is None or record.released else record
