"""How the CLI maps errors found inside the flow: any BadInputError is exit 2, one message, no credential."""

from __future__ import annotations

import pytest

from flows import cli
from infra.launch.warm_ranks import DISABLE_ENV
from tests.conftest import EXAMPLES
from trainer_core.errors import BadInputError


class StoreSettingError(BadInputError):
    """What a storage pre-flight raises for a configuration error (a missing bucket, a refused key)."""


@pytest.mark.parametrize("secret_in_message", [False, True])
def test_bad_input_found_inside_the_flow_exits_2_without_credentials(tmp_path, capsys, monkeypatch, secret_in_message):
    import flows.pipeline
    import flows.temporary_server

    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")

    def flow_that_finds_a_bad_store(config):
        detail = f" (signed with {secret})" if secret_in_message else ""
        raise StoreSettingError(
            f"storage.url='s3://nope/runs': bucket 'nope' does not exist at http://127.0.0.1:9/{detail}; "
            "create it or fix storage.url"
        )

    monkeypatch.setattr(flows.pipeline, "train_flow", flow_that_finds_a_bad_store)
    # Neither Prefect's temporary server nor a warm process serves a flow that raises at once: the mapping of its
    # error is the test (starting both cost this unit test a server and a torch import per case).
    monkeypatch.setattr(flows.temporary_server, "start_temporary_server", lambda: None)
    monkeypatch.setenv(DISABLE_ENV, "0")
    monkeypatch.chdir(tmp_path)
    code = cli.main(
        [
            "run",
            str(EXAMPLES / "tiny_sft.toml"),
            "--set",
            f"run.work_dir={tmp_path}/work",
            "--set",
            f"storage.url={tmp_path}/store",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 2 and not out
    ours = [line for line in err.splitlines() if line.startswith("rankflow: ")]  # after the memory table
    assert len(ours) == 1 and err.rstrip("\n").splitlines()[-1] == ours[0], err
    assert ours[0].startswith(
        "rankflow: bad input: storage.url='s3://nope/runs': bucket 'nope' does not exist at http://127.0.0.1:9/"
    )
    assert secret not in err and "AKIAIOSFODNN7EXAMPLE" not in err and "Traceback" not in err
    assert ("<AWS_SECRET_ACCESS_KEY>" in err) == secret_in_message
