"""A store that does not answer is an outage, not bad input: exit 1, one line, and nothing written before the probe.

The storage pre-flight runs in `rankflow run` right after the inputs are
checked and before the stage cache, Prefect or anything of the run exists, so
an S3 endpoint on a closed port costs a second and leaves the work dir as it
was. (Bad storage *settings* — no credentials, a malformed AWS_ENDPOINT_URL —
are bad input and live in the corpus.)
"""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from .harness import Assets, Case, listing, materialize
from .test_corpus import _env, _rankflow


def _closed_port() -> int:
    with socket.socket() as probe:  # bound and closed again: nothing listens there
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# A whole `rankflow` program run end to end (its interpreter, imports and exit): the e2e tier, not the unit one.
@pytest.mark.e2e
def test_an_s3_endpoint_on_a_closed_port_is_one_line_exit_1_and_writes_nothing(tmp_path):
    case = Case("s3_closed_port", "storage", "", "", config={"storage": {"url": "s3://rankflow/runs"}})
    case_dir = tmp_path / "case"
    argv = materialize(case, case_dir, Assets(tmp_path))
    before = listing(case_dir)
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    env = {
        **_env(tmp_path),
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    }
    # Failed in the storage check (below), whose client gives up after two short tries (tests/storage/test_preflight.py):
    # that, not a wall time, is what keeps it to seconds. The timeout only ends a command that hangs.
    done = subprocess.run([*_rankflow(), *argv], capture_output=True, text=True, cwd=case_dir, env=env, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"rankflow: run failed: storage.url='s3://rankflow/runs' at {endpoint} is not reachable"
    ), done.stderr[-3000:]
    assert "then run the same command again" in lines[0] and "wJalrXUtnFEMI" not in lines[0]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(done.stdout.strip().splitlines()) == 1
    assert (summary["status"], summary["failed_stage"], summary["failure_cause"]) == (
        "failed",
        "storage-check",
        "storage_outage",
    )
    assert sorted(set(listing(case_dir)) - set(before)) == []  # no work/cache, no run directory
    assert not (tmp_path / "prefect-home").exists()  # Prefect was never even imported
