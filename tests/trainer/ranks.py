"""Launch a module on two gloo ranks with torchrun, as the distributed trainer tests do, and return its lines."""

from __future__ import annotations

from pathlib import Path

from infra.launch.launcher import launch

ROOT = Path(__file__).resolve().parents[2]


def launch_two_ranks(module: str, args: list[str] | None = None, env: dict[str, str] | None = None) -> list[str]:
    """Run `module` on 2 ranks; fails the test (with the last lines) unless every rank exits 0."""
    lines: list[str] = []
    result = launch(
        module,
        args or [],
        nproc_per_node=2,
        timeout_s=180,
        env={"PYTHONPATH": str(ROOT), **(env or {})},
        on_line=lines.append,
    )
    assert result.returncode == 0, "\n".join(lines[-40:])
    return lines
