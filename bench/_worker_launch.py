"""Launch a benchmark's torchrun worker and read the figures it wrote: the one way bench/ modules do it.

The worker gets `--out FILE` first, then its own arguments; it writes its
figures there as JSON. A failed launch raises with the launch's last lines,
so a benchmark never reports figures a run did not produce.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from infra.launch.launcher import launch

ROOT = Path(__file__).resolve().parent.parent


def worker_figures(module: str, args: list[str], *, world_size: int, echo: bool = False) -> dict:
    """Run `module` on `world_size` gloo/NCCL processes with `--out FILE` + `args`; return the JSON it wrote.

    `echo`: print the worker's lines as they come (a long benchmark shows its progress).
    """
    with tempfile.TemporaryDirectory(prefix="bench-worker-") as tmp:
        out = Path(tmp) / "figures.json"
        lines: list[str] = []

        def on_line(line: str) -> None:
            lines.append(line)
            if echo:
                print(line, flush=True)

        result = launch(
            module,
            ["--out", str(out), *args],
            nproc_per_node=world_size,
            timeout_s=1800,
            env={"PYTHONPATH": str(ROOT)},
            on_line=on_line,
        )
        if result.returncode != 0:
            raise RuntimeError("the benchmark launch failed:\n" + "\n".join(lines[-30:]))
        return json.loads(out.read_text())
