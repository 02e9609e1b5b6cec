"""`rankflow deploy CONFIG --pool NAME`: register the training flow on a work pool of a Prefect server.

Everything a deployment's runs would trip over is checked first, like `run`
does (config, inputs, schedule, names, a server to register with): bad input
exits 2 with one message and nothing registered. Then the pool is created if
missing and the deployment created or updated. The last line of standard
output is one JSON object (`deployment_id`, `deployment`, `work_pool`,
`worker_command`, `run_command`, ...); the lines before it tell a person what
to run next.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable

from trainer_core.config import RunConfig, load_config
from trainer_core.data_sources import describe
from trainer_core.errors import ConfigError

EXIT_OK, EXIT_FAILED = 0, 1
# Stricter than Prefect's own rule (no / % & > <): these names end up in shell
# commands, Kubernetes labels and queue names, so keep them plain.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def add_deploy_parser(
    commands: argparse._SubParsersAction, with_config: Callable[[argparse.ArgumentParser], None]
) -> None:
    deploy = commands.add_parser("deploy", help="deploy the flow to a work pool of a Prefect server (PREFECT_API_URL)")
    with_config(deploy)
    deploy.add_argument("--pool", required=True, help="work pool; created as a process pool if missing")
    deploy.add_argument("--name", default=None, help="deployment name (default: the run name)")
    deploy.add_argument("--work-queue", default=None, help="work queue of the pool (default: the pool's default queue)")
    deploy.add_argument("--cron", help='cron schedule, e.g. "0 3 * * *" (default: no schedule, runs on demand)')
    deploy.add_argument("--interval", type=float, help="schedule every N seconds")
    deploy.add_argument(
        "--job-variable",
        action="append",
        metavar="KEY=VALUE",
        help="override a job variable of the pool's template, e.g. working_dir=/srv/runs "
        "(VALUE is parsed as JSON when it can be)",
    )
    deploy.set_defaults(handler=cmd_deploy)


def cmd_deploy(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.set or [], args.unset or [])
    _check_names(args)
    _check_schedule(args.cron, args.interval)
    job_variables = parse_job_variables(args.job_variable or [])
    # transformers and torch: only once a command reads its inputs, not at `import flows.cli`
    from trainer_core.model_source import resolve_hub_model
    from trainer_core.run.validate import validate_inputs

    # A hub model id is checked from this machine's cache and deployed at the commit checked: each run's worker
    # resolves it in its own cache (infra/publication/parent.py), where this machine's path would not exist.
    checked_config = config.model_copy(deep=True)
    resolve_hub_model(checked_config)
    config.model.revision = checked_config.model.revision
    checked = validate_inputs(checked_config)  # a deployment whose every run would fail on its input is not registered
    api_url = _require_api_url()

    from ..deploy import deploy_training

    try:
        deployed = deploy_training(
            config,
            pool=args.pool,
            name=args.name,
            work_queue=args.work_queue,
            job_variables=job_variables,
            cron=args.cron,
            interval_s=args.interval,
        )
    except Exception as error:  # noqa: BLE001 - the API's answer, reported in one line
        print(
            f"rankflow deploy: could not register the deployment with the Prefect API at {api_url}: "
            f"{type(error).__name__}: {error}. Is the server up (`rankflow server`) and PREFECT_API_URL right?",
            file=sys.stderr,
        )
        return EXIT_FAILED
    from .run import print_memory

    print_memory(checked.memory)  # once registered: a refusal before it is one message alone
    _print_next_steps(config, deployed.as_dict())
    print(json.dumps(deployed.as_dict()))
    return EXIT_OK


def parse_job_variables(pairs: list[str]) -> dict:
    variables = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--job-variable {pair!r}: expected KEY=VALUE, e.g. --job-variable working_dir=/srv/runs")
        try:
            variables[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            variables[key.strip()] = raw  # a bare string such as a path or an image name
    return variables


def _check_names(args: argparse.Namespace) -> None:
    for flag, value in (("--pool", args.pool), ("--name", args.name), ("--work-queue", args.work_queue)):
        if value is not None and not _NAME.fullmatch(value):
            raise ConfigError(
                f"{flag} {value!r}: use letters, digits, '.', '_' and '-' (at most 100), "
                f"starting with a letter or digit, e.g. {flag} nightly-sft"
            )


def _check_schedule(cron: str | None, interval_s: float | None) -> None:
    if cron is None and interval_s is None:
        return  # on demand: `prefect deployment run`, the UI, or run_deployment
    if cron is not None and interval_s is not None:
        raise ConfigError('--cron and --interval: give at most one of them, e.g. --cron "0 3 * * *" or --interval 3600')
    from .schedule import check_schedule

    check_schedule(cron, interval_s)


def _require_api_url() -> str:
    from prefect.settings import get_current_settings

    api_url = get_current_settings().api.url
    if not api_url:
        raise ConfigError(
            "PREFECT_API_URL is not set, so there is no Prefect server to deploy to; set it to the server's API, e.g. "
            "export PREFECT_API_URL=http://127.0.0.1:4200/api (`rankflow server` prints it). Without it "
            "the deployment would go to a temporary API that disappears when this command exits"
        )
    return api_url


def _print_next_steps(config: RunConfig, deployed: dict) -> None:
    print(
        f"Deployment {deployed['deployment']} ({deployed['deployment_id']}) on work pool "
        f"{deployed['work_pool']} ({deployed['work_pool_type']})."
    )
    print(
        f"Its runs read the inputs at {describe(config.data.path)} (and the model and tokenizer paths of the config), use "
        f"the work dir {config.run.work_dir} and publish to {config.storage.url}, on the worker's machine: those "
        "paths must exist there (override with --set run.work_dir=...)."
    )
    print("Start a worker (a machine with rankflow installed, PREFECT_API_URL and the store's AWS_* variables set):")
    print(f"  {deployed['worker_command']}")
    print(f"Start a run now: {deployed['run_command']}")
