"""Run under torchrun by test_export_prepare: rank 1 fails each phase of export preparation in turn."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from tests.conftest import tiny_tree
from trainer_core.config import config_from_dict
from trainer_core.model import build_trainer
from trainer_core.run.distributed import init_distributed, log, run_rank_process
from trainer_core.run.export_prepare import ExportPreparationError, prepare_export
from trainer_core.run.manifest import verify_staged


def main(workdir: Path) -> None:
    topology = init_distributed(logical_dp=2, timeout_s=60)
    config = config_from_dict(tiny_tree(workdir, export={"max_shard_size": "20KB"}), config_dir=workdir)
    trainer = build_trainer(config)
    out_dir = workdir / "export" / "step-00000003"
    provenance = {"run_id": "r", "step": 3, "world_size": topology.world_size}
    for phase in ("weights", "write", "verify", "manifest"):

        def fail_rank_1(rank: int, at: str, phase=phase) -> None:
            if rank == 1 and at == phase:
                raise OSError(f"disk full during {at}")

        try:
            prepare_export(topology, config, trainer, out_dir, provenance, fail_rank_1)
        except ExportPreparationError as error:
            assert "failed on rank 1" in str(error) and f"disk full during {phase}" in str(error), error
        else:
            raise AssertionError(f"rank {topology.rank}: preparation succeeded although rank 1 failed at {phase}")
        dist.barrier()
        leftovers = sorted(p.name for p in (workdir / "export").glob("*")) if (workdir / "export").exists() else []
        assert leftovers == [], f"phase {phase}: temporary files left: {leftovers}"
        log(f"ABORTED {phase} rank {topology.rank}")
    prepared = prepare_export(topology, config, trainer, out_dir, provenance)
    dist.barrier()
    manifest = verify_staged(out_dir)
    assert manifest is not None and manifest["world_size"] == 2 and not prepared["reused"]
    assert len([f for f in manifest["files"] if f["path"].endswith(".safetensors")]) >= 2  # shards split over ranks
    again = prepare_export(topology, config, trainer, out_dir, provenance)
    assert again["reused"]
    log(f"OK rank {topology.rank}")


if __name__ == "__main__":
    run_rank_process(lambda: main(Path(sys.argv[1])))
