"""Why a stage failed: the first failing rank, the cause class, and whether a retry can help.

| class              | what happened                                             | retried |
|--------------------|-----------------------------------------------------------|---------|
| bad_input          | the data or the config is wrong (ValueError, DataError)   | no      |
| code_error         | a bug: TypeError, AttributeError, a shape mismatch, …     | no      |
| out_of_memory      | an allocation failed inside the rank (it would again)     | no      |
| rank_died          | a rank was killed (SIGKILL: the OOM killer, an operator)  | yes     |
| rank_stalled       | no progress for train.stall_timeout_s (a hung or stopped rank) | yes |
| collective_timeout | a collective timed out or lost a peer                     | yes     |
| preempted          | a rank was told to stop (SIGTERM, SIGINT, SIGHUP)         | yes     |
| storage_outage     | object storage was unreachable or failed                  | yes     |
| lease_lost         | another run of this run id took the run lease over        | no      |
| finalizer_lost     | another holder (a gc, a stale takeover) took the finalizer lease over mid-write; this run still holds its run lease | yes |
| launch_timeout     | the launch ran past its wall-clock limit                  | yes     |
| no_space           | a disk filled up (ENOSPC, EDQUOT): it stays full          | no      |
| transient          | anything else (an injected fault, an unknown error)       | yes     |

A rank killed by a signal is the first failing rank even when a peer reported
an error first: the peer's error ("connection closed by peer") is the effect.
Otherwise the earliest recorded error that is not a lost-peer effect wins.
Retries resume from the last saved state (see tasks/segment.py). A storage
outage is first ridden out within the attempt, up to 5 minutes of it, with a
growing pause (tasks/retry_policy.py): stores have minute-long brownouts. Missing
S3 credentials (botocore's NoCredentialsError) are bad input: no retry finds
them.

A lost lease is never a code error. A lost run lease is never retried: the
run belongs to the new holder, which resumes it. A lost finalizer lease alone
is retried: the run lease (checked inside every finalizer-held write) still
says no other run of the run id is at work, so the next try takes the
finalizer again and resumes from what the store holds. A lease write whose
answer was lost is no loss at all (infra/store/lease.py settles it by what the store
holds).

A `Failure` is one failed attempt: where and why, and, once the task that
failed reports it (`tasks.failure_report`), which attempt it was and whether
Prefect retries it (`retried`); its `headline` never promises a retry that
will not happen.
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import asdict, dataclass
from enum import Enum


class FailureClass(str, Enum):
    BAD_INPUT = "bad_input"
    CODE_ERROR = "code_error"
    OUT_OF_MEMORY = "out_of_memory"
    RANK_DIED = "rank_died"
    RANK_STALLED = "rank_stalled"
    COLLECTIVE_TIMEOUT = "collective_timeout"
    PREEMPTED = "preempted"
    STORAGE_OUTAGE = "storage_outage"
    LAUNCH_TIMEOUT = "launch_timeout"
    LEASE_LOST = "lease_lost"
    FINALIZER_LOST = "finalizer_lost"
    NO_SPACE = "no_space"
    TRANSIENT = "transient"

    @property
    def retriable(self) -> bool:
        return self not in (
            FailureClass.BAD_INPUT,
            FailureClass.CODE_ERROR,
            FailureClass.OUT_OF_MEMORY,
            FailureClass.NO_SPACE,
            FailureClass.LEASE_LOST,
        )

    @property
    def fix(self) -> str:
        """What to do once no retry is left (or none can help)."""
        if self is FailureClass.LEASE_LOST:
            return "nothing to do: the run's new holder (another run of this run id) resumes the work"
        if self is FailureClass.NO_SPACE:
            return (
                "free space on that disk (or point run.work_dir at a larger one), then run the same command again: "
                "finished segments are kept"
            )
        if not self.retriable:
            return "fix the cause, then run the same config again"
        return "run the same command again to resume from the last saved state"


_BAD_INPUT_TYPES = {
    "ValueError",
    "DataError",
    "ConfigError",
    "UnicodeDecodeError",
    "JSONDecodeError",
    "NoCredentialsError",
    "PartialCredentialsError",
}
_CODE_ERROR_TYPES = {
    "TypeError",
    "AttributeError",
    "NameError",
    "UnboundLocalError",
    "ImportError",
    "ModuleNotFoundError",
    "AssertionError",
    "KeyError",
    "IndexError",
    "ZeroDivisionError",
    "NotImplementedError",
    "SyntaxError",
    "RecursionError",
    "FileNotFoundError",
    "IsADirectoryError",
    "NotADirectoryError",
}
_OOM_TYPES = {"MemoryError", "OutOfMemoryError"}
# infra/store/lease.py and infra/runs/run_lease.py: RuntimeErrors, but no bug.
_LEASE_LOST_TYPES = {"RunLeaseLost"}
_FINALIZER_LOST_TYPES = {"LeaseLostError"}
_STORAGE_TYPES = {
    "ConnectionError",
    "ConnectionRefusedError",
    "ConnectionResetError",
    "TimeoutError",
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "OSError",
    "PermissionError",
}
_COLLECTIVE_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError", "GradientTransactionError"}
# What gloo, NCCL and the c10d store say when a peer is gone or silent.
_LOST_PEER_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "socket",
    "nccl",
    "gloo",
    "peer",
    "connection refused",
)
_PREEMPTION_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
# How a full disk reads in a rank's error record (os.strerror of ENOSPC and EDQUOT, with or without "[Errno N]").
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_MARKERS = tuple(os.strerror(code).lower() for code in _NO_SPACE_ERRNOS)


@dataclass(frozen=True)
class Failure:
    stage: str
    cause: FailureClass
    rank: int | None
    """The first failing rank, when one can be named."""
    detail: str
    """One line: what the rank did or said."""
    log_tail: tuple[str, ...] = ()
    """The last lines of that rank's log (or of the launch when no rank is named)."""
    attempt: int | None = None
    """Which attempt of its task failed (1-based); None outside a task (the flow itself)."""
    max_attempts: int | None = None
    """How many attempts the task has (its retries + 1)."""
    retried: bool | None = None
    """Whether Prefect runs the task again after this attempt; None: not known yet (the launch's own diagnosis)."""
    log_file: str | None = None
    """Where the attempt's full error and traceback were written (RUN_DIR/logs/failures/…)."""

    @property
    def retriable(self) -> bool:
        return self.cause.retriable

    def verdict(self) -> str:
        """What happens next: the truth once `retried` is known, what the class allows before."""
        attempt = f"attempt {self.attempt} of {self.max_attempts}, " if self.attempt is not None else ""
        if self.retried is None:
            return "a retry can help" if self.retriable else f"a retry cannot help: {self.cause.fix}"
        if self.retried:
            return f"{attempt}retried from the last saved state"
        if not self.retriable:
            why = f"a retry cannot help ({self.cause.value})"
        elif self.attempt is None:
            why = "nothing retries the flow itself"
        elif self.max_attempts is not None and self.attempt >= self.max_attempts:
            why = "no attempts left"
        else:
            why = "its task does not retry this failure"
        return f"{attempt}not retried: {why}; {self.cause.fix}"

    def headline(self) -> str:
        where = f" on rank {self.rank}" if self.rank is not None else ""  # a whole launch (a timeout) has no rank
        return f"{self.stage} failed{where}: {self.cause.value} ({self.detail}); {self.verdict()}"

    def to_dict(self) -> dict:
        figures = asdict(self)
        figures.update(cause=self.cause.value, retriable=self.retriable, log_tail=list(self.log_tail))
        return figures


def classify_error(type_name: str, message: str) -> FailureClass:
    """The class of an exception, by its type name and message (ranks report both as text)."""
    lowered = message.lower()
    if type_name == "InjectedFault":
        return FailureClass.TRANSIENT
    if type_name in _LEASE_LOST_TYPES:
        return FailureClass.LEASE_LOST
    if type_name in _FINALIZER_LOST_TYPES:
        return FailureClass.FINALIZER_LOST
    if any(marker in lowered for marker in _NO_SPACE_MARKERS):
        return FailureClass.NO_SPACE
    if type_name in _OOM_TYPES or "out of memory" in lowered:
        return FailureClass.OUT_OF_MEMORY
    if type_name in _COLLECTIVE_TYPES:
        return FailureClass.COLLECTIVE_TIMEOUT
    if type_name in ("RuntimeError", "DistError") and any(m in lowered for m in _LOST_PEER_MARKERS):
        return FailureClass.COLLECTIVE_TIMEOUT
    if type_name in _BAD_INPUT_TYPES:
        return FailureClass.BAD_INPUT
    if type_name in _CODE_ERROR_TYPES or type_name == "RuntimeError":
        return FailureClass.CODE_ERROR
    if type_name in _STORAGE_TYPES or type_name.startswith(("S3", "Client", "Botocore", "NoCredentials")):
        return FailureClass.STORAGE_OUTAGE
    return FailureClass.TRANSIENT


def classify_exception(error: BaseException) -> FailureClass:
    """The class of an exception raised in the orchestrator (a launch error carries its diagnosis)."""
    diagnosed = getattr(error, "failure", None)
    if isinstance(diagnosed, Failure):
        return diagnosed.cause
    if no_space_error(error) is not None:
        return FailureClass.NO_SPACE
    if _caused_by(error, _CREDENTIAL_TYPES):  # s3fs and S3Store.errors wrap botocore's error in an OSError
        return FailureClass.BAD_INPUT
    for kind in type(error).__mro__:  # a subclass of ConnectionError is a storage outage, and so on
        cause = classify_error(kind.__name__, str(error))
        if cause is not FailureClass.TRANSIENT or kind.__name__ == "InjectedFault":
            return cause
    return FailureClass.TRANSIENT


_CREDENTIAL_TYPES = frozenset({"NoCredentialsError", "PartialCredentialsError"})


def _caused_by(error: BaseException | None, type_names: frozenset[str]) -> bool:
    """Whether `error` or an exception it was raised from has one of these type names."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(kind.__name__ in type_names for kind in type(error).__mro__):
            return True
        error = error.__cause__ or error.__context__
    return False


def no_space_error(error: BaseException | None) -> OSError | None:
    """The ENOSPC/EDQUOT OSError `error` is or was raised from, if any (wrappers keep it as their cause)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _NO_SPACE_ERRNOS:
            return error
        error = error.__cause__ or error.__context__
    return None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _record_detail(record: dict) -> str:
    first_line = (record["message"].splitlines() or [""])[0]
    return f"{record['type']}: {first_line[:300]}"


def _waiting_in_collective(lines: tuple[str, ...]) -> bool:
    """Whether a rank's stack dump (printed on SIGUSR1) shows it blocked in torch.distributed."""
    return any("torch/distributed/" in line for line in lines)


TIMEOUT_KEYS = {"segment": "train.segment_timeout_s", "export": "export.timeout_s"}
"""The config key that limits each stage's launch: a timeout names it, and how to raise it."""


def timeout_detail(stage: str, timeout_s: float | None) -> str:
    """What a launch that ran past its limit says: the key that set the limit and how to raise it."""
    key = TIMEOUT_KEYS.get(stage)
    if key is None:
        return "the launch ran past its wall-clock limit"
    limit = f" = {timeout_s:g} s" if timeout_s is not None else ""
    return f"the launch ran past {key}{limit}: raise it in the config, or with --set {key}=SECONDS"


def diagnose_launch(result, stage: str | None = None, timeout_s: float | None = None) -> Failure:
    """Name the first failing rank of a failed launch (an `infra.launch.launcher.LaunchResult`) and the cause.

    `timeout_s` is the launch's wall-clock limit, named with its config key when the launch ran past it."""
    stage = stage or "launch"

    def failure(cause: FailureClass, rank: int | None, detail: str) -> Failure:
        tail = result.rank_tails.get(rank, ()) if rank is not None else ()
        return Failure(stage, cause, rank, detail, tuple(tail or result.tail)[-30:])

    if result.stalled:
        if result.stopped_ranks:
            rank = result.stopped_ranks[0]
            return failure(FailureClass.RANK_STALLED, rank, f"stopped (SIGSTOP) and made no progress: {result.stalled}")
        stuck = [r for r, lines in sorted(result.rank_tails.items()) if not _waiting_in_collective(lines)]
        rank = stuck[0] if len(stuck) < len(result.rank_tails) and stuck else None
        return failure(FailureClass.RANK_STALLED, rank, f"{result.stalled}; stacks are in the ranks' logs")
    if result.timed_out:
        return failure(FailureClass.LAUNCH_TIMEOUT, None, timeout_detail(stage, timeout_s))
    # A rank that recorded an error told its own story; a rank killed without one did not choose to fail.
    recorded = {r["rank"] for r in result.error_records}
    signalled = {r: c for r, c in result.rank_exits.items() if c < 0 and r not in recorded}
    records = [(r, classify_error(r["type"], r["message"])) for r in result.error_records]
    timeouts = [
        r
        for r, c in records
        if c is FailureClass.COLLECTIVE_TIMEOUT
        and ("timed out" in r["message"].lower() or "timeout" in r["message"].lower())
    ]
    if (
        timeouts
    ):  # a peer went silent (a hang, a stop): name it; torchrun then ended it, with SIGTERM or, past its grace, SIGKILL
        silent = min(signalled) if signalled else timeouts[0]["rank"]
        return failure(
            FailureClass.COLLECTIVE_TIMEOUT,
            silent,
            f"rank {timeouts[0]['rank']}'s collective timed out waiting for its peers ({_record_detail(timeouts[0])})",
        )
    # torchrun ends the surviving ranks with SIGTERM, so a SIGTERM is only the cause when nothing else is.
    hard = {r: c for r, c in signalled.items() if -c not in _PREEMPTION_SIGNALS}
    if hard:
        rank = result.root_cause_rank if result.root_cause_rank in hard else min(hard)
        code = hard[rank]
        how = "SIGKILL: the kernel's OOM killer or an operator" if code == -signal.SIGKILL else _signal_name(code)
        return failure(FailureClass.RANK_DIED, rank, f"killed by {how}")
    own = [(r, c) for r, c in records if c is not FailureClass.COLLECTIVE_TIMEOUT]
    if own:
        return failure(own[0][1], own[0][0]["rank"], _record_detail(own[0][0]))
    if signalled:
        # A peer torchrun ended may have no record either (it was ended before its collective failed):
        # torchrun's root cause names the rank signalled first, its own SIGTERMs came after.
        rank = result.root_cause_rank if result.root_cause_rank in signalled else min(signalled)
        return failure(
            FailureClass.PREEMPTED, rank, f"stopped by {_signal_name(signalled[rank])} (a preemption or an operator)"
        )
    if records:
        return failure(records[0][1], records[0][0]["rank"], _record_detail(records[0][0]))
    for line in result.rank_errors:  # a rank that printed its error but recorded none
        rank = int(line.split("]", 1)[0].removeprefix("[rank "))
        type_name, _, message = line.split("] ERROR ", 1)[1].partition(": ")
        return failure(classify_error(type_name, message), rank, f"{type_name}: {message[:300]}")
    failed = sorted(result.rank_exits)
    return failure(FailureClass.TRANSIENT, failed[0] if failed else None, f"exit status {result.returncode}")
