"""A served deployment's run that is SIGKILLed mid-segment does not wedge the deployment.

`rankflow serve` runs each flow run in a subprocess; the test kills the process
the run lease names (the one training), then asks the deployment for another
run. The runner marks the killed run Crashed, which frees the deployment's
concurrency slot (limit 1, CANCEL_NEW), so the next run is not cancelled; it
finds the run lease's holder dead (same machine) and takes it over at once,
long before the lease's 600 s ttl, and finishes the run from the last saved
state to the same checkpoint bytes as an undisturbed run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.e2e.run_lease.runs import (
    client_env,
    committed_weights,
    hanging_at,
    lease_of,
    raw_lease,
    run_id_of,
    start,
    stepping,
    trained_segments,
    wait_for,
    write_config,
)

pytestmark = [pytest.mark.flow]

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def _final_state(client, flow_run_id, timeout_s: float) -> str:
    def terminal():
        state = client.read_flow_run(flow_run_id).state
        return state.type.value if state is not None and state.type.value in TERMINAL else None

    return wait_for(terminal, timeout_s, f"flow run {flow_run_id} to end", poll_s=1.0)


def test_a_killed_served_run_frees_the_deployment_and_the_next_run_resumes(race, api_url, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter

    config_file = write_config(tmp_path, run={"lease_ttl_s": 600})
    run_id, store_url = run_id_of(config_file), str(tmp_path / "store")
    run_dir = tmp_path / "work" / run_id
    # A yearly cron: no tick fires during the test; the runs are asked for explicitly.
    # The first run hangs in step 1 (certainly mid-segment when killed); the marker lets the next one through.
    marker = tmp_path / "hanging"
    server = start(
        ["serve", str(config_file), "--cron", "0 0 1 1 *", "--name", "crash"],
        {**client_env(api_url, tmp_path / "prefect-home"), **hanging_at(1, marker)},
        tmp_path / "serve",
    )
    try:
        with get_client(sync_client=True) as client:
            deployment = wait_for(
                lambda: next(
                    iter(client.read_deployments(deployment_filter=DeploymentFilter(name={"any_": ["crash"]}))), None
                ),
                180,
                "the served deployment",
            )
            first = client.create_flow_run_from_deployment(deployment.id)
            wait_for(lambda: marker.exists(), 400, "the served run to reach step 1")
            assert stepping(run_dir, 0)
            holder = lease_of(store_url, run_id)
            assert holder is not None and holder.pid not in (server.pid, os.getpid())
            os.kill(holder.pid, signal.SIGKILL)  # the flow run's process, mid-segment
            assert _final_state(client, first.id, 120) == "CRASHED"

            second = client.create_flow_run_from_deployment(deployment.id)
            started = time.time()
            assert _final_state(client, second.id, 600) == "COMPLETED", (tmp_path / "serve" / "stderr.txt").read_text()[
                -4000:
            ]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    taken = raw_lease(store_url, run_id)
    assert taken.generation == holder.generation + 1 and taken.released
    assert taken.acquired_at < holder.expires_at and taken.acquired_at - started < 300  # at once, not after the ttl
    assert trained_segments(run_dir) == [0, 1]  # the killed attempt recorded nothing
    assert committed_weights(store_url, run_id) == committed_weights(race["store_url"], race["run_id"])
