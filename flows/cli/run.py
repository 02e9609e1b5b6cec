"""`rankflow run` and `rankflow serve`: check every input, probe the store, then run or serve the pipeline.

`run` prints, as the last line of its standard output, one JSON object
summarising the run (`_summary`); the exit statuses are those of the command
line (`flows.cli.parser`'s docstring), and 130 after a Ctrl-C (`_interrupted`:
one line and the result line, `"status": "interrupted"`). Once the inputs and the store have
passed, before Prefect starts and the first segment launches, it writes the
memory model's per-rank table to standard error (`print_memory`; a run that
cannot fit was refused by `validate_inputs`). Prefect is imported only then,
so bad input costs seconds. `wall_s` counts from the command's start
(`args.started_s`: the process's start as the kernel records it, for the
`rankflow` command), its imports and config checks included.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import TYPE_CHECKING

from trainer_core.config import ConfigError, RunConfig, load_config
from trainer_core.errors import BadInputError

from .output import emit

if TYPE_CHECKING:
    from trainer_core.run.device_memory import MemoryReport
    from trainer_core.run.validate import CheckedInputs

__all__ = [
    "EXIT_ALREADY_RUNNING",
    "EXIT_BAD_INPUT",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "cmd_run",
    "cmd_serve",
    "print_memory",
]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_ALREADY_RUNNING = 75
"""EX_TEMPFAIL: another run of the run id holds the run lease; nothing was done, try again later."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT, as a shell reports a command Ctrl-C stopped: the run stopped; the same command resumes it."""


def _load(args: argparse.Namespace) -> RunConfig:
    return load_config(args.config, args.set or [], args.unset or [])


def _summary(result: dict | None, wall_s: float, error: BaseException | None) -> dict:
    if result is None:
        return {
            "run_id": None,
            "status": "failed",
            "checkpoint_url": None,
            "steps": 0,
            "losses": [],
            "wall_s": round(wall_s, 3),
            "error": f"{type(error).__name__}: {error}",
        }
    # Launches and training time count this invocation's own segments only (see flows/run_record.py).
    summary = {**result, "wall_s": round(wall_s, 3)}
    # Time outside torchrun launches and training: Prefect, planning, commits. The state uploads run beside the
    # next segment; only the time the flow waited for them (`upload_wait_s`) is on the critical path.
    upload_wait_s = result.get("upload_wait_s", 0.0)
    summary["upload_wait_s"] = round(upload_wait_s, 3)
    summary["orchestration_s"] = round(wall_s - result["launch_wall_s"] - result["export_wall_s"] - upload_wait_s, 3)
    summary["launch_overhead_s"] = round(result["launch_wall_s"] - result["train_s"], 3)
    return summary


def check_tracking(config: RunConfig) -> None:
    """A tracking backend whose library is missing is bad input (exit 2, the extra to install named)."""
    from infra.tracking import missing_library

    problem = missing_library(config.tracking.backend)
    if problem is not None:
        raise ConfigError(problem)


def _wall_s(args: argparse.Namespace) -> float:
    """Seconds since the command started (`flows.cli.parser.main` sets `started_s`; epoch seconds, as the kernel's
    process start is given), the interpreter's start-up and the imports included."""
    return time.time() - getattr(args, "started_s", time.time())


def cmd_run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt as interrupt:  # Ctrl-C (SIGINT), wherever it landed: one line, the result line, exit 130
        return _interrupted(args, getattr(interrupt, "rankflow_summary", None))


def _interrupted(args: argparse.Namespace, so_far: dict | None = None) -> int:
    """Report a Ctrl-C: the run stopped where it was; its saved states stand, so the same command resumes it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the command at once
    if "prefect" in sys.modules:
        from ..finish import drain_prefect

        drain_prefect()  # the UI shows the run as it ended (Prefect marks an interrupted flow run Crashed)
    print(
        "rankflow: interrupted (Ctrl-C): the run stopped where it was; run the same command again "
        "to resume from its last saved state",
        file=sys.stderr,
    )
    # The run's summary so far where the flow had one (its run id, steps done, losses), as a failed run's line has.
    summary = {"run_id": None, "checkpoint_url": None, "steps": 0, "losses": [], **(so_far or {})}
    summary.update(
        status="interrupted",
        wall_s=round(_wall_s(args), 3),
        error="KeyboardInterrupt: interrupted by SIGINT (Ctrl-C)",
    )
    emit(json.dumps(summary))
    return EXIT_INTERRUPTED


def _run(args: argparse.Namespace) -> int:
    config = _load(args)
    check_tracking(config)
    checked = _checked_before_start(config, args)
    if isinstance(checked, int):
        return checked
    checked.store_cache()
    # The check the README promises before a run starts: shown before Prefect's server and the first launch.
    print_memory(checked.memory)
    return _train(config, args)


def _checked_before_start(config: RunConfig, args: argparse.Namespace) -> CheckedInputs | int:
    """Every input read and checked, and the store probed, before Prefect starts; an exit status when not."""
    # A bad config is reported without transformers or torch.
    from infra.launch.failures import classify_exception
    from infra.publication.parent import resolve_parent, undo, undone_if_refused
    from trainer_core.run.validate import validate_inputs

    with undone_if_refused() as created:  # bad input writes nothing: not even the parent's verified copy
        try:
            resolve_parent(config, created)  # model.path naming a committed checkpoint: fetched, verified
        except OSError as outage:  # its store does not answer, or the checkpoint does not verify there: exit 1
            undo(created)  # nothing of the fetch stays (a damaged parent is no bad input, but leaves nothing)
            print(f"rankflow: run failed: {outage}", file=sys.stderr)
            failure = {"failed_stage": "model-fetch", "failure_cause": classify_exception(outage).value}
            emit(json.dumps({**_summary(None, _wall_s(args), outage), **failure}))
            return EXIT_FAILED
        # Every input is read and checked before Prefect (and its temporary server) starts,
        # and the store is probed before the first byte is written (the stage cache included).
        checked = validate_inputs(config)
    unavailable = _storage_preflight(config)
    if unavailable is not None:
        print(f"rankflow: run failed: {unavailable}", file=sys.stderr)
        emit(
            json.dumps(
                {
                    **_summary(None, _wall_s(args), unavailable),
                    "failed_stage": "storage-check",
                    "failure_cause": "storage_outage",
                    "failed_rank": None,
                }
            )
        )
        return EXIT_FAILED
    return checked


def _train(config: RunConfig, args: argparse.Namespace) -> int:
    """The flow under Prefect's temporary server, beside warm ranks; the result line; the exit status."""
    from infra.launch.warm_ranks import warm_ranks
    from infra.runs.run_lease import RunAlreadyActive

    from ..finish import drain_prefect
    from ..pipeline import RunFailed, train_flow
    from ..temporary_server import start_temporary_server
    from ..terminal import quiet_tracebacks

    quiet_tracebacks()  # tracebacks go to the run's log files and the Prefect API, not to the terminal
    result, error, message = None, None, None
    try:
        with warm_ranks():  # the ranks' imports, once, beside the start of Prefect's temporary server
            start_temporary_server()  # here, not at Prefect's first call: one at a time, and it dies with us
            summary = train_flow(config)
        # Called directly, a flow returns its state's result: the Cancelled state it returns when
        # another run holds the run id raises its data (RunAlreadyActive, below), so a value is the summary.
        assert isinstance(summary, dict)
        result = summary
    except BadInputError:
        drain_prefect()
        raise  # found inside the flow (an input changed since the check, or a storage setting): still exit 2
    except RunAlreadyActive as busy:  # the flow run ended as Cancelled, having done nothing
        drain_prefect()
        print(f"rankflow: {busy}", file=sys.stderr)
        emit(
            json.dumps(
                {
                    "run_id": busy.run_id,
                    "status": "already_running",
                    "checkpoint_url": None,
                    "steps": 0,
                    "losses": [],
                    "wall_s": round(_wall_s(args), 3),
                    "error": str(busy),
                }
            )
        )
        return EXIT_ALREADY_RUNNING
    except RunFailed as failure:  # its message is the failed attempt's headline and where its traceback is
        error, result, message = failure, failure.summary, f"rankflow: run failed: {failure}"
    except Exception as failure:  # noqa: BLE001 - reported in the summary line
        error, message = (
            failure,
            f"rankflow: run failed: {type(failure).__name__}: {(str(failure).splitlines() or [''])[0]}",
        )
    drain_prefect()  # the UI gets every log line and event before the result line (see flows/finish.py)
    if message is not None:
        print(message, file=sys.stderr)
    emit(json.dumps(_summary(result, _wall_s(args), error)))
    return EXIT_OK if error is None else EXIT_FAILED


def print_memory(report: MemoryReport | None) -> None:
    """The memory model's per-rank table, on standard error (standard output ends with the summary line)."""
    if report is None:
        return
    from trainer_core.memory_model import format_table, human

    for line in format_table(report.estimate, report.settings):
        print(line, file=sys.stderr)
    limit = report.limit_bytes
    checked = f"fits the {human(limit)} of {report.limit_source}" if limit is not None else report.limit_source
    print(f"  ({checked})", file=sys.stderr)


def _storage_preflight(config: RunConfig) -> ConnectionError | None:
    """Probe the store: a refused setting raises (bad input, exit 2); a store that does not answer is returned."""
    from infra.store.preflight import StoreUnavailable
    from infra.store.writable import check_store_writable

    try:
        check_store_writable(config.storage.url)
    except StoreUnavailable as outage:  # an outage, not bad input: exit 1, run the same command again later
        return outage
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    from .schedule import check_schedule

    config = _load(args)
    check_schedule(args.cron, args.interval)
    from trainer_core.run.validate import validate_inputs

    validate_inputs(config)  # a deployment whose every run would fail on its input is not served
    from ..deployment import serve_deployment

    serve_deployment(config, name=args.name, cron=args.cron, interval_s=args.interval)
    return EXIT_OK
