"""`rankflow checkpoints runs | list | verify | pull | gc [RUN_ID [STEP]]`: the verifying readers from a shell.

    rankflow checkpoints runs (--store URL | --config TOML) [--json]   every run in the store, with its LATEST
    rankflow checkpoints list RUN_ID (--store URL | --config TOML) [--json]
    rankflow checkpoints verify RUN_ID [STEP] ...     hash every byte against the manifest; exit 1 if any fails
                                    (one retention removed, its removal interrupted, says "retired")
    rankflow checkpoints pull RUN_ID [STEP] [--dest DIR]   download the newest verified (or STEP), verified
    rankflow checkpoints gc RUN_ID [--dry-run]        remove orphans of crashed or superseded commits
                                    (with --config: and the checkpoints its storage.keep_last/keep_every drop)

A corrupt LATEST or manifest is reported on standard error and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from trainer_core.config import ConfigError

EXIT_OK, EXIT_FAILED = 0, 1


def _store(args: argparse.Namespace):
    from infra.store import open_store

    if (args.store is None) == (args.config is None):
        raise ConfigError(
            f"checkpoints {args.checkpoints_command}: give exactly one of --store URL "
            "(a path, file://PATH or s3://BUCKET/PREFIX) or --config TOML (its storage.url)"
        )
    if args.store is not None:
        from trainer_core.storage_url import check_local_store

        check_local_store(args.store, "--store")
        return open_store(args.store)
    from trainer_core.config import load_config

    return open_store(load_config(args.config).storage.url)


def _size(num_bytes: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return ""


def cmd_list(args: argparse.Namespace) -> int:
    from infra.publication.checkpoints import resolve_latest, scan_checkpoints

    store = _store(args)
    resolution = resolve_latest(store, args.run_id)
    if resolution.message:
        print(f"rankflow: {resolution.message}", file=sys.stderr)
    reports = scan_checkpoints(store, args.run_id)
    if args.json:
        print(
            json.dumps(
                {
                    "run_id": args.run_id,
                    "latest": resolution.checkpoint,
                    "latest_pointer": resolution.pointer,
                    "note": resolution.message,
                    "checkpoints": [r.to_dict() for r in reports],
                }
            )
        )
        return EXIT_OK
    if not reports:
        print(f"run {args.run_id}: no checkpoints")
    for report in reports:
        mark = "  <- latest" if report.name == resolution.checkpoint else ""
        status = "verified" if report.verified else "NOT VERIFIED"
        print(f"{report.name}  {status:12s} {report.num_files:3d} files  {_size(report.num_bytes):>9s}{mark}")
        for problem in report.problems:
            print(f"    {problem}")
    return EXIT_OK


def cmd_runs(args: argparse.Namespace) -> int:
    from infra.runs.store_runs import list_runs

    store = _store(args)
    runs = list_runs(store)
    if args.json:
        print(json.dumps({"store": store.url, "runs": [run.to_dict() for run in runs]}))
        return EXIT_OK
    if not runs:
        print(f"{store.url}: no runs")
    width = max((len(run.run_id) for run in runs), default=0)
    for run in runs:
        latest = run.latest or "no LATEST"
        last = f"{run.last_stage} {run.last_status}" if run.last_status else "no stored ledger"
        when = f" ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(run.last_time))})" if run.last_time else ""
        print(f"{run.run_id:{width}s}  {latest:14s} {run.num_checkpoints:3d} checkpoints  last: {last}{when}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from infra.publication.checkpoints import checkpoint_names, verify_checkpoint
    from infra.publication.manifests import checkpoint_name

    store = _store(args)
    names = [checkpoint_name(args.step)] if args.step is not None else checkpoint_names(store, args.run_id)
    if not names:
        print(f"rankflow: run {args.run_id} has no checkpoints at {store.url}", file=sys.stderr)
        return EXIT_FAILED
    failed = 0
    for name in names:
        report = verify_checkpoint(store, args.run_id, name, full=True)
        if not report.verified and (why := _retired(store, args.run_id, report.step)) is not None:
            # A gc stopped between hiding the manifest and removing the data: removed by intent, not damaged.
            print(f"{name}  retired ({why}): not a checkpoint any more; the next gc removes what is left of it")
            continue
        failed += not report.verified
        print(f"{name}  {'verified (every byte hashed)' if report.verified else 'FAILED'}")
        for problem in report.problems:
            print(f"    {problem}")
    return EXIT_OK if failed == 0 else EXIT_FAILED


def _retired(store, run_id: str, step: int) -> str | None:
    """Why retention removed the checkpoint of `step` (its retired record is there and its manifest is not), or
    None: a checkpoint with a manifest, refused or not, is no retired one."""
    from pydantic import ValidationError

    from infra.publication.latest import manifest_exists
    from infra.publication.manifests import retired_key
    from infra.publication.retention import RetiredCheckpoint

    if step < 0:
        return None
    with store.errors(f"retention record of step {step} of run {run_id}"):
        record = store.get(retired_key(run_id, step))
    if record is None or manifest_exists(store, run_id, step):
        return None
    try:
        return RetiredCheckpoint.model_validate_json(record.data).reason
    except ValidationError:
        return "its retention record is unreadable"


def cmd_pull(args: argparse.Namespace) -> int:
    from infra.publication.checkpoints import pull_checkpoint
    from infra.publication.manifests import checkpoint_name

    store = _store(args)
    name = checkpoint_name(args.step) if args.step is not None else None
    dest = Path(args.dest) if args.dest else Path(args.run_id) / (name or "latest")
    try:
        name, path, note = pull_checkpoint(store, args.run_id, dest, step=args.step)
    except (FileNotFoundError, FileExistsError) as error:
        print(f"rankflow: {error}", file=sys.stderr)
        return EXIT_FAILED
    if note:
        print(f"rankflow: {note}", file=sys.stderr)
    print(f"{name} of run {args.run_id} verified and saved to {path}")
    from infra.publication.local_copy import loader_line

    line = loader_line(path)
    if line is not None:  # a LoRA adapter's base is named from any current directory (peft reads it from the current)
        print(f"load it from any directory: {line}")
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    from infra.publication.orphans import collect_garbage

    store = _store(args)
    report = collect_garbage(store, args.run_id, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    if args.config is not None and not args.dry_run:
        _retain(store, args)
    print(
        f"run {args.run_id}: {verb} {len(report.removed)} objects ({_size(report.removed_bytes)}), "
        f"aborted {report.aborted_uploads} dangling uploads"
    )
    for path in report.removed:
        print(f"    {path}")
    for kept in report.kept:
        print(f"    kept {kept}", file=sys.stderr)
    return EXIT_OK


def _retain(store, args: argparse.Namespace) -> None:
    """With --config: remove the checkpoints its storage.keep_last / keep_every do not keep (as a run does)."""
    from infra.publication.finalizer import FinalizerSettings
    from infra.publication.retention import RetentionPolicy, apply_retention
    from trainer_core.config import load_config

    policy = RetentionPolicy.of(load_config(args.config).storage)
    report = apply_retention(store, args.run_id, policy, FinalizerSettings(wait_s=60.0))
    print(
        f"run {args.run_id}: retention (storage.keep_last = {policy.keep_last}, keep_every = {policy.keep_every}) removed {len(report.removed)} checkpoints"
    )
    for name in report.removed:
        print(f"    {name}")
    for name in report.kept_for_readers + report.hidden:
        print(f"    kept {name}: a reader is pulling it", file=sys.stderr)


def _reporting_failures(handler):
    """A storage failure (unreachable, timed out, a lease held) is one line on stderr and exit 1."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except OSError as error:
            what = " ".join(filter(None, (args.checkpoints_command, getattr(args, "run_id", None))))
            print(f"rankflow: checkpoints {what}: {type(error).__name__}: {error}", file=sys.stderr)
            return EXIT_FAILED

    return run


def add_checkpoint_commands(commands: argparse._SubParsersAction) -> None:
    """Register `rankflow checkpoints …` on the top-level parser's subcommands."""
    group = commands.add_parser(
        "checkpoints",
        help="list the runs of a store; list, verify, pull or garbage-collect a run's checkpoints",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = group.add_subparsers(dest="checkpoints_command", required=True)
    handlers = {"runs": cmd_runs, "list": cmd_list, "verify": cmd_verify, "pull": cmd_pull, "gc": cmd_gc}
    helps = {
        "runs": "list the runs in the store: LATEST, number of checkpoints, last ledger status",
        "list": "list checkpoints (quick check: sizes and recorded digests)",
        "verify": "hash every file of every (or one) checkpoint against its manifest",
        "pull": "download the newest verified checkpoint, or STEP, verifying it",
        "gc": "remove orphaned objects, temporaries and dangling uploads of the run",
    }
    for name, handler in handlers.items():
        command = sub.add_parser(name, help=helps[name])
        if name != "runs":
            command.add_argument("run_id", help="the run id (NAME-DIGEST12), as `rankflow run` prints it")
        if name in ("verify", "pull"):
            command.add_argument("step", nargs="?", type=int, help="one checkpoint's step (default: all / the newest)")
        command.add_argument("--store", help="storage URL: a path, file://PATH or s3://BUCKET/PREFIX")
        command.add_argument("--config", help="a run config TOML whose storage.url to use")
        if name in ("runs", "list"):
            command.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "pull":
            command.add_argument("--dest", help="directory to create (default: RUN_ID/STEP-NAME)")
        if name == "gc":
            command.add_argument("--dry-run", action="store_true", help="only report what would be removed")
        command.set_defaults(handler=_reporting_failures(handler))
