"""torchrun launches: rank failures and timeouts surface as errors and leave no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from infra.launch.launcher import LaunchError, launch, launch_or_raise
from infra.launch.processes import wait_gone

pytestmark = pytest.mark.distributed


def write_module(tmp_path, name, body):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_a_failing_rank_fails_the_launch_with_its_rank_named(tmp_path):
    env = write_module(
        tmp_path,
        "failing_rank",
        """
        import os, sys, time
        from trainer_core.run.distributed import run_rank_main
        def main():
            if os.environ["RANK"] == "1":
                raise ValueError("bad shard on purpose")
            time.sleep(60)  # rank 0 would wait for its peer forever
        run_rank_main(main)
    """,
    )
    lines = []
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"\[rank 1\] ERROR ValueError: bad shard on purpose"):
        launch_or_raise("failing_rank", [], nproc_per_node=2, timeout_s=120, env=env, on_line=lines.append)
    assert time.monotonic() - started < 50  # torchrun stopped rank 0 instead of waiting for it


def test_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "pids"
    env = write_module(
        tmp_path,
        "sleeping_rank",
        f"""
        import os, time
        with open({str(pid_file)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep(600)
    """,
    )
    # 20 s: both ranks must have started (torchrun's agent imports torch first: 5-15 s under load) before it ends them.
    result = launch("sleeping_rank", [], nproc_per_node=2, timeout_s=20, env=env, on_line=lambda _: None)
    assert result.timed_out  # its ranks are gone (below): the launch ended them, however long the machine took
    assert len(pid_file.read_text().split()) == 2
    for pid in map(int, pid_file.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_lines_of_several_ranks_never_merge(tmp_path):
    # print() writes the text and the newline separately; 3 ranks print as fast as they can.
    env = write_module(
        tmp_path,
        "chatty_rank",
        """
        import os, sys
        rank = os.environ["RANK"]
        for i in range(400):
            print(f"rank {rank} line {i} " + "x" * (i % 97))
            sys.stderr.write(f"rank {rank} err {i}")
            sys.stderr.write("\\n")
    """,
    )
    lines = []
    result = launch("chatty_rank", [], nproc_per_node=3, timeout_s=120, env=env, on_line=lines.append)
    assert result.returncode == 0
    for rank in range(3):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        expected_out = [f"[rank {rank}] rank {rank} line {i} " + "x" * (i % 97) for i in range(400)]
        expected_err = [f"[rank {rank}] rank {rank} err {i}" for i in range(400)]
        assert [line for line in mine if " line " in line] == expected_out
        assert [line for line in mine if " err " in line] == expected_err
    assert not [line for line in lines if line.count("rank ") > 2]  # no line holds two ranks' text


def _listening_sockets(pids) -> list[str]:
    """Local addresses of listening TCP sockets (IPv4 and IPv6) the given processes own."""
    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            connections = getattr(process, "net_connections", None) or process.connections  # psutil < 6: connections
            found.extend(c.laddr.ip for c in connections(kind="tcp") if c.status == psutil.CONN_LISTEN)
        except psutil.Error:
            continue  # exited while we looked
    return found


def test_a_single_node_launch_listens_on_loopback_only(tmp_path):
    env = write_module(
        tmp_path,
        "listening_rank",
        """
        import time, torch.distributed as dist
        from datetime import timedelta
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        dist.barrier()
        time.sleep(6)
        dist.destroy_process_group()
    """,
    )
    from infra.launch.processes import descendant_pids

    seen: list[str] = []

    def look() -> None:
        seen.extend(_listening_sockets([os.getpid(), *descendant_pids(os.getpid())]))

    result = launch(
        "listening_rank", [], nproc_per_node=2, timeout_s=120, env=env, on_line=lambda _: None, monitor=look
    )
    assert result.returncode == 0
    assert seen, "no listening socket seen during the launch"
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    assert set(seen) <= loopback, f"a socket listens beyond loopback: {set(seen) - loopback}"


def test_killing_the_parent_leaves_no_launch_process(tmp_path):
    pid_file = tmp_path / "pids"
    env = write_module(
        tmp_path,
        "long_rank",
        f"""
        import os, time
        from trainer_core.run.distributed import run_rank_main
        def main():
            with open({str(pid_file)!r}, "a") as f:
                f.write(f"{{os.getpid()}} {{os.getppid()}}\\n")
            time.sleep(600)
        run_rank_main(main)
    """,
    )
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from infra.launch.launcher import launch; "
            "launch('long_rank', [], nproc_per_node=2, timeout_s=600, on_line=lambda _: None)",
        ],
        env={**os.environ, **env},
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while (not pid_file.is_file() or len(pid_file.read_text().split("\n")) < 3) and time.monotonic() < deadline:
        time.sleep(0.2)
    pairs = [tuple(map(int, line.split())) for line in pid_file.read_text().splitlines()]
    assert len(pairs) == 2, "the ranks did not start"
    launch_pids = [pid for pair in pairs for pid in pair]  # the ranks and torchrun
    os.killpg(parent.pid, signal.SIGKILL)  # the whole process group of the parent, as a user's kill would
    parent.wait()
    assert wait_gone(launch_pids, timeout_s=10) == [], "torchrun or a rank outlived its killed parent"
