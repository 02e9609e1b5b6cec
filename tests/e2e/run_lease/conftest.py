"""Fixtures of the run lease tests: the session's Prefect API for `rankflow` processes, and one raced run."""

from __future__ import annotations

import pytest

from tests.e2e.run_lease.runs import client_env, finish, lease_of, run_id_of, start, wait_for, write_config


@pytest.fixture(scope="session")
def api_url(prefect_harness) -> str:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


@pytest.fixture(scope="session")
def race(api_url, tmp_path_factory) -> dict:
    """Two runs started at once (no waiting), then a third, willing to wait, once the lease is held.

    Its committed checkpoint is the reference the other runs of the same config must equal.
    """
    root = tmp_path_factory.mktemp("race")
    config_file = write_config(root)
    run_id = run_id_of(config_file)
    store_url = str(root / "store")
    racers = [
        start(["run", str(config_file)], client_env(api_url, root / f"home-{i}"), root / f"racer-{i}") for i in range(2)
    ]
    held = wait_for(lambda: lease_of(store_url, run_id), 300, "a racer to take the run lease")
    waiter = start(
        ["run", str(config_file), "--set", "run.lease_wait_s=900"],
        client_env(api_url, root / "home-w"),
        root / "waiter",
    )
    results = [finish(p, root / f"racer-{i}") for i, p in enumerate(racers)]
    return {
        "root": root,
        "run_id": run_id,
        "store_url": store_url,
        "held": held,
        "racers": racers,
        "results": results,
        "waiter": finish(waiter, root / "waiter"),
    }
