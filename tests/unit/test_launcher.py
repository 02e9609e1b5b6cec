"""torchrun launches: rank failures and timeouts surface as errors and leave no process behind."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from infra.launcher import LaunchError, launch, launch_or_raise

pytestmark = pytest.mark.distributed


def write_module(tmp_path, name, body):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_a_failing_rank_fails_the_launch_with_its_rank_named(tmp_path):
    env = write_module(tmp_path, "failing_rank", """
        import os, sys, time
        from trainer_core.distributed import run_rank_main
        def main():
            if os.environ["RANK"] == "1":
                raise ValueError("bad shard on purpose")
            time.sleep(60)  # rank 0 would wait for its peer forever
        run_rank_main(main)
    """)
    lines = []
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"\[rank 1\] ERROR ValueError: bad shard on purpose"):
        launch_or_raise("failing_rank", [], nproc_per_node=2, timeout_s=120, env=env, on_line=lines.append)
    assert time.monotonic() - started < 50  # torchrun stopped rank 0 instead of waiting for it


def test_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "pids"
    env = write_module(tmp_path, "sleeping_rank", f"""
        import os, time
        with open({str(pid_file)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep(600)
    """)
    result = launch("sleeping_rank", [], nproc_per_node=2, timeout_s=8, env=env, on_line=lambda _: None)
    assert result.timed_out and result.wall_s < 40
    for pid in map(int, pid_file.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
