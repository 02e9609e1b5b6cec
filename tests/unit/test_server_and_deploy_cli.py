"""`rankflow deploy` and `rankflow server`: bad input exits 2 with one message, before any server is contacted or started."""

from __future__ import annotations

import json
import os
import socket

import pytest

from flows.cli import main
from flows.cli.deploy import parse_job_variables
from flows.cli.server import asyncpg_url, redact_url
from infra.services.postgres import find_postgres_bin
from tests.conftest import tiny_tree
from trainer_core.errors import ConfigError


def _config_file(tmp_path, **sections):
    path = tmp_path / "run.toml"
    path.write_text(
        "\n".join(
            f"[{section}]\n" + "\n".join(f"{key} = {json.dumps(value)}" for key, value in values.items())
            for section, values in sections.items()
        )
    )
    return path


@pytest.fixture
def config_file(tmp_path):
    return _config_file(tmp_path, **tiny_tree(tmp_path))


@pytest.fixture
def no_server(tmp_path):
    """An API URL that refuses connections: a check that exits 2 must not have needed it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}):
        yield


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--pool", "a/b"], "--pool 'a/b': use letters, digits"),
        (["--pool", "ok", "--name", "has space"], "--name 'has space'"),
        (["--pool", "ok", "--cron", "0 3 * * *", "--interval", "60"], "give at most one of them"),
        (["--pool", "ok", "--cron", "every day"], "--cron 'every day': not a valid cron expression"),
        (["--pool", "ok", "--interval", "-5"], "--interval -5.0: must be a positive number"),
        (["--pool", "ok", "--job-variable", "no-equals-sign"], "expected KEY=VALUE"),
        (["--pool", "ok", "--set", "train.steps=-1"], "train.steps"),
    ],
)
def test_deploy_bad_input_exits_2_with_one_message(no_server, config_file, tmp_path, capsys, extra, message):
    assert main(["deploy", str(config_file), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rankflow: bad input: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "work").exists()


def test_deploy_checks_the_inputs_like_run(no_server, tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    config_file = _config_file(tmp_path, **tiny_tree(tmp_path, data={"path": str(missing)}))
    assert main(["deploy", str(config_file), "--pool", "ok"]) == 2
    assert f"data.path={str(missing)!r} does not exist" in capsys.readouterr().err


def test_deploy_without_a_server_url_is_bad_input(config_file, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(["deploy", str(config_file), "--pool", "ok"]) == 2
    assert "PREFECT_API_URL is not set" in capsys.readouterr().err


def test_deploy_to_an_unreachable_server_fails_with_exit_1(no_server, config_file, capsys):
    assert main(["deploy", str(config_file), "--pool", "ok"]) == 1
    err = capsys.readouterr().err
    assert "could not register the deployment" in err and "Is the server up" in err


def test_job_variables_parse_json_or_keep_strings():
    assert parse_job_variables(['env={"A": "1"}', "working_dir=/srv/runs", "stream_output=false"]) == {
        "env": {"A": "1"},
        "working_dir": "/srv/runs",
        "stream_output": False,
    }


def test_database_urls_get_the_async_driver_and_never_show_a_password():
    assert asyncpg_url("postgresql://u:p@db:5432/prefect") == "postgresql+asyncpg://u:p@db:5432/prefect"
    assert asyncpg_url("postgres://u@db/prefect") == "postgresql+asyncpg://u@db/prefect"
    assert asyncpg_url("postgresql+asyncpg://db/prefect") == "postgresql+asyncpg://db/prefect"
    assert redact_url("postgresql://u:s3cret@db:5432/x") == "postgresql://u:***@db:5432/x"
    with pytest.raises(ConfigError, match=r"not a PostgreSQL URL") as error:
        asyncpg_url("mysql://u:s3cret@db/x")
    assert "s3cret" not in str(error.value)


def test_server_with_a_non_postgres_url_exits_2_without_the_password(capsys):
    assert main(["server", "--port", "0", "--db", "sqlite:///x.db"]) == 2  # port 0: checked first
    assert main(["server", "--db", "mysql://admin:hunter22@db/x", "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err
    assert "--port 0" in err and "not a PostgreSQL URL" in err and "hunter22" not in err


def test_server_on_a_taken_port_exits_2(capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["server", "--port", str(port), "--db", "postgresql://u@db/x"]) == 2
    assert f"--port {port} is taken" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the directory to another user")
def test_server_pg_dir_that_postgres_cannot_enter_exits_2(tmp_path, capsys):
    try:
        find_postgres_bin()
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert main(["server", "--port", str(_free_port()), "--pg-dir", str(private / "pg")]) == 2
    assert "cannot be entered by user" in capsys.readouterr().err
    assert not (private / "pg").exists()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
