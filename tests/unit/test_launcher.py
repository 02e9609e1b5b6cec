"""torchrun launches: rank failures and timeouts surface as errors and leave no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from infra.launch.launcher import LaunchError, launch, launch_or_raise
from infra.launch.processes import wait_gone
from tests.waits import wait_for

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
            time.sleep(600)  # rank 0 would wait for its peer forever
        run_rank_main(main)
    """,
    )
    lines = []
    with pytest.raises(LaunchError, match=r"\[rank 1\] ERROR ValueError: bad shard on purpose") as raised:
        launch_or_raise("failing_rank", [], nproc_per_node=2, timeout_s=600, env=env, on_line=lines.append)
    assert not raised.value.result.timed_out  # torchrun stopped rank 0 instead of waiting for it


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

    def both_ranks_started() -> None:
        # The launch asks its monitor long before its 20 s pass: held here until both ranks run (torchrun's agent
        # imports torch first, a minute on a loaded machine), its timeout then ends ranks that exist.
        wait_for(lambda: pid_file.is_file() and len(pid_file.read_text().split()) == 2, "both ranks to start")

    result = launch(
        "sleeping_rank", [], nproc_per_node=2, timeout_s=20, env=env, on_line=lambda _: None, monitor=both_ranks_started
    )
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
        f"""
        import os, time, torch.distributed as dist
        from datetime import timedelta
        from pathlib import Path
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
        dist.barrier()
        Path({str(tmp_path)!r}, f"ready-{{os.environ['RANK']}}").touch()
        while not Path({str(tmp_path)!r}, "looked").exists():  # every socket stays open until the monitor looked
            time.sleep(0.05)
        dist.destroy_process_group()
    """,
    )
    from infra.launch.processes import descendant_pids

    seen: list[str] = []

    def look() -> None:
        ready = all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1))  # before the look: its sockets are up
        seen.extend(_listening_sockets([os.getpid(), *descendant_pids(os.getpid())]))
        if ready:
            (tmp_path / "looked").touch()

    result = launch(
        "listening_rank", [], nproc_per_node=2, timeout_s=600, env=env, on_line=lambda _: None, monitor=look
    )
    assert (tmp_path / "looked").exists(), "the monitor never looked while both ranks were up"
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
    wait_for(lambda: pid_file.is_file() and len(pid_file.read_text().split("\n")) >= 3, "both ranks to start")
    pairs = [tuple(map(int, line.split())) for line in pid_file.read_text().splitlines()]
    assert len(pairs) == 2, "the ranks did not start"
    launch_pids = [pid for pair in pairs for pid in pair]  # the ranks and torchrun
    os.killpg(parent.pid, signal.SIGKILL)  # the whole process group of the parent, as a user's kill would
    parent.wait()
    assert wait_gone(launch_pids, timeout_s=300) == [], "torchrun or a rank outlived its killed parent"
