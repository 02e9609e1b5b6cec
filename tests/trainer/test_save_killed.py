"""A process killed while it writes a state straight to the disk leaves no state, no record and nothing a resume
would take; the next save of the same weights is whole and restores them bitwise (the in-memory model is the
reference)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import torch

from tests.trainer.models import tiny_qwen3
from tests.waits import GENEROUS_S
from trainer_core.run.state import has_state, load_training_state, save_training_state
from trainer_core.run.state_record import LocalState, record_path
from trainer_core.training import Trainer

REPO = Path(__file__).resolve().parents[2]
WRITER = """
import os, sys, time
from pathlib import Path
from tests.trainer.models import tiny_qwen3
from trainer_core import direct_write
from trainer_core.run.state import save_training_state
from trainer_core.training import Trainer

direct_write.CHUNK_BYTES = 4096  # many writes, each slowed: the kill lands mid-file
real_pwrite = os.pwrite

def slow(fd, data, offset):
    if offset == 3 * 4096:
        print("writing", flush=True)
    time.sleep(0.01)
    return real_pwrite(fd, data, offset)

os.pwrite = slow
trainer = Trainer(tiny_qwen3(seed=3))
trainer.add_base_checkpoint("base")
save_training_state(Path(sys.argv[1]), trainer.checkpoints, {"next_step": 1})
print("saved", flush=True)
"""


def trainer_from(seed: int) -> Trainer:
    trainer = Trainer(tiny_qwen3(seed=seed))
    trainer.add_base_checkpoint("base")
    return trainer


def test_a_save_killed_mid_write_leaves_nothing_a_resume_takes_and_the_next_save_is_whole(tmp_path):
    state_dir = tmp_path / "state" / "segment-0000"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(state_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "writing"
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.wait(timeout=GENEROUS_S)
    assert writer.returncode == -signal.SIGKILL
    partial = list(state_dir.with_name(state_dir.name + ".tmp").rglob("*.safetensors"))
    assert partial, "the kill did not land during the write"
    assert not state_dir.exists() and not has_state(state_dir) and not record_path(state_dir).exists()
    assert LocalState.load(state_dir) is None

    saved = trainer_from(seed=3)
    save_training_state(state_dir, saved.checkpoints, {"next_step": 1})
    assert has_state(state_dir) and not state_dir.with_name(state_dir.name + ".tmp").exists()
    local = LocalState.load(state_dir)
    assert local is not None
    local.check()  # the record describes the files in place
    restored = trainer_from(seed=4)
    assert load_training_state(state_dir, restored.checkpoints) == {"next_step": 1}
    expected = dict(saved.model.named_parameters())
    for name, param in restored.model.named_parameters():
        assert torch.equal(param, expected[name]), name
