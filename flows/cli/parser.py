"""The `rankflow` command line.

    rankflow run CONFIG [--set dotted.key=value ...] [--unset dotted.key ...]
                                                        run the pipeline (in-process Prefect by default)
    rankflow serve CONFIG (--cron EXPR | --interval S)  serve it as a scheduled Prefect deployment
    rankflow ui [--port P] [--log FILE]                 start a Prefect server + UI on 127.0.0.1 (output to FILE)
    rankflow server [--port P] [--db URL | --pg-dir D]  start a Prefect server on PostgreSQL, for workers
    rankflow deploy CONFIG --pool NAME [--cron EXPR]    deploy the flow to a work pool of that server
    rankflow s3 serve [--dir D] [--bucket B]            start a local S3 server (SeaweedFS)
    rankflow checkpoints runs|list|verify|pull|gc [RUN_ID]  the runs of a store; read, verify, download or tidy a run's checkpoints
    rankflow eval CHECKPOINT --data FILE [...]           the eval loss of a committed checkpoint (verified first)

Exit status: 0 success; 2 bad config or input (nothing started, nothing
written); 1 a failure during the run; 75 (EX_TEMPFAIL) another run of the
same run id is running (it holds the run lease; nothing was done: run again
later, or set run.lease_wait_s to wait); 130 interrupted by Ctrl-C (one
line, then the JSON line with status "interrupted"; run again to resume). Standard output closed is bad input
(exit 2, before anything runs); a result that standard output refuses (a full
disk, a closed pipe) is one line on standard error and exit 1
(`flows.cli.output`). `run` prints, as the last line of its
standard output, one JSON object summarising the run; `eval` prints one JSON
line, the eval loss of a committed checkpoint.

Bad input is found before Prefect starts: `validate_inputs` reads and checks
the config, tokenizer, model and data, so a bad input costs seconds and prints
one message (`rankflow: bad input: …`, naming the file and line or the key and
the fix) and no traceback. Any `BadInputError` — raised here, in the flow, or
by a storage pre-flight that finds a configuration error — exits 2. The
storage pre-flight (`infra.store.preflight`) also runs here, before the stage cache
or anything else is written: a store that does not answer is one line and
exit 1, before Prefect starts.

A failed run prints one line, `rankflow: run failed: STAGE failed on rank R:
CAUSE (…); attempt N of M, not retried: …; … (full error and traceback:
FILE)`; Prefect's own console lines stay, one line each, without tracebacks
(`flows.terminal`). As the `rankflow` command, `run` exits within a moment of
its JSON line (`flows.finish`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from trainer_core.errors import BadInputError

from .checkpoints import add_checkpoint_commands
from .deploy import add_deploy_parser
from .eval import add_eval_parser
from .output import OutputLost, flush_stdout, guarded_stdout, require_stdout
from .run import EXIT_BAD_INPUT, EXIT_FAILED, cmd_run, cmd_serve
from .server import add_server_parser


def _prefect_defaults() -> None:
    """Prefect settings for rankflow's commands, set before Prefect reads its settings.

    Servers rankflow starts (the temporary one of `run`, the one of `ui`)
    inherit them. A user's own value wins.
    """
    # The temporary API server Prefect starts without PREFECT_API_URL can take
    # longer than its default start-up limit on a 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    # Server telemetry is on by default and DO_NOT_TRACK does not stop it; offline
    # it fails with a "database is locked" traceback at the first run.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def cmd_ui(args: argparse.Namespace) -> int:
    from .ui import run_ui

    return run_ui(port=args.port, log_path=Path(args.log))


def cmd_s3_serve(args: argparse.Namespace) -> int:
    from infra.services.s3_server import serve_until_interrupted

    return serve_until_interrupted(Path(args.dir), bucket=args.bucket)


def build_parser() -> argparse.ArgumentParser:
    from .ui import DEFAULT_LOG

    parser = argparse.ArgumentParser(
        prog="rankflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def with_config(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("config", help="TOML run configuration")
        sub.add_argument(
            "--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. train.steps=10"
        )
        sub.add_argument(
            "--unset",
            action="append",
            metavar="KEY",
            help="remove a key (or a section) the file sets, applied before --set: e.g. --unset model.config "
            "--set model.path=DIR",
        )

    run = commands.add_parser("run", help="run the whole pipeline")
    with_config(run)
    run.set_defaults(handler=cmd_run)

    serve = commands.add_parser("serve", help="serve the flow as a scheduled deployment")
    with_config(serve)
    serve.add_argument("--cron", help='cron schedule, e.g. "0 3 * * *"')
    serve.add_argument("--interval", type=float, help="schedule every N seconds")
    serve.add_argument("--name", default=None, help="deployment name (default: the run name)")
    serve.set_defaults(handler=cmd_serve)

    ui = commands.add_parser("ui", help="start a Prefect server and UI on 127.0.0.1")
    ui.add_argument("--port", type=int, default=4200)
    ui.add_argument("--log", default=DEFAULT_LOG, help=f"where the server's output goes (default {DEFAULT_LOG})")
    ui.set_defaults(handler=cmd_ui)

    add_server_parser(commands)
    add_deploy_parser(commands, with_config)

    s3 = commands.add_parser("s3", help="local S3 server").add_subparsers(dest="s3_command", required=True)
    s3_serve = s3.add_parser("serve", help="start SeaweedFS on 127.0.0.1 and print the AWS_* variables")
    s3_serve.add_argument("--dir", default=".rankflow/s3", help="data directory")
    s3_serve.add_argument("--bucket", default="rankflow", help="bucket to create")
    s3_serve.set_defaults(handler=cmd_s3_serve)
    add_checkpoint_commands(commands)
    add_eval_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; `argv` None means this process is the `rankflow` command itself.

    As the command, `rankflow run` ends within a moment of its last line once
    a flow ran (flows/finish.py): the temporary Prefect server is stopped
    without Prefect's 5 s wait and the process exits at once. Called with
    `argv` (tests, other Python code), it returns the exit status instead.
    """
    started_s = command_started_s(argv)
    _prefect_defaults()
    args = build_parser().parse_args(argv)
    args.started_s = started_s  # `run`'s wall_s counts from here
    try:
        require_stdout()
        with guarded_stdout():
            code = args.handler(args)
            flush_stdout()
    except BadInputError as error:
        print(f"rankflow: bad input: {_without_credentials(str(error))}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    except OutputLost as lost:
        print(f"rankflow: {lost}", file=sys.stderr)
        code = EXIT_FAILED
    if argv is None and args.handler is cmd_run and "prefect" in sys.modules:
        from ..finish import exit_now, stop_temporary_server

        stop_temporary_server()
        exit_now(code)
    return code


def command_started_s(argv: list[str] | None) -> float:
    """When the command started, in epoch seconds: for the `rankflow` command itself (`argv` None), the process's
    start as the kernel records it (`process_start_time`), so the interpreter's start-up and the imports count;
    called from other Python code, now."""
    from trainer_core.run.launch_phases import process_start_time

    started = process_start_time() if argv is None else None
    return started if started is not None else time.time()


_CREDENTIAL_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


def _without_credentials(message: str) -> str:
    """A last guard: a message about a storage setting never shows a credential, whoever wrote it."""
    for name in _CREDENTIAL_VARIABLES:
        secret = os.environ.get(name, "")
        if len(secret) >= 4:
            message = message.replace(secret, f"<{name}>")
    return message
