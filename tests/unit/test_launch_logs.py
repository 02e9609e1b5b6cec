"""A launch's logs go to the store beside the run, byte for byte, and never from a run that lost its run lease.

References: the files on disk (the stored objects' bytes) and the store's listing (nothing under the run's
logs/ prefix when the lease was lost: another run of the run id owns that prefix now, and may have logs of
the same attempt names there).
"""

from __future__ import annotations

from pathlib import Path

from infra.store import open_store
from infra.store.objects import list_files
from tasks.launch_logs import store_launch_logs
from tasks.outcomes import PlannedRun
from trainer_core.config import StorageSection, TrainSection

RUN = "run-0123456789ab"


def _planned(tmp_path: Path, lease_token: str | None) -> PlannedRun:
    return PlannedRun(
        run_id=RUN,
        digest="d",
        run_dir=str(tmp_path / "run"),
        segment_steps=[(0, 2)],
        train=TrainSection(nproc_per_node=1, logical_dp=1),
        storage=StorageSection(url=str(tmp_path / "store")),
        lease_token=lease_token,
    )


def _logs(planned: PlannedRun) -> dict[str, bytes]:
    log_dir = Path(planned.run_dir) / "logs" / "segment-0000" / "attempt-1"
    files = {"rank-0.stdout": b"step 0 loss 6.99\n", "rank-0.stderr": b"", "torchrun.log": b"started\n"}
    for name, data in files.items():
        (log_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (log_dir / name).write_bytes(data)
    return {f"logs/segment-0000/attempt-1/{name}": data for name, data in files.items()}


def test_the_logs_are_stored_byte_for_byte(tmp_path):
    planned = _planned(tmp_path, lease_token=None)  # driven directly: not fenced
    written = _logs(planned)
    assert store_launch_logs(planned, Path(planned.run_dir), Path(planned.run_dir) / "logs" / "segment-0000") == 3
    store = open_store(planned.storage)
    stored = {rel: store.fs.cat_file(f"{store.path(RUN)}/{rel}") for rel in list_files(store, store.path(RUN))}
    assert stored == written


def test_a_run_that_lost_its_lease_stores_no_logs(tmp_path):
    planned = _planned(tmp_path, lease_token="a-lease-this-run-no-longer-holds")
    _logs(planned)
    assert store_launch_logs(planned, Path(planned.run_dir), Path(planned.run_dir) / "logs" / "segment-0000") == 0
    store = open_store(planned.storage)
    assert list_files(store, store.path(RUN)) == {}
