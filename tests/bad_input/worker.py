"""Run bad-input cases through the real CLI in one fresh process: `python -m tests.bad_input.worker OUT ROOT [NAME...]`.

Each case runs in ROOT/NAME; the costly inputs (a saved tiny model) are made once beside OUT, so several workers can
share ROOT. Writes OUT (JSON): each case's outcome, and which Prefect modules were
imported after the `run` cases (none: bad input never starts Prefect) — the
`serve` cases run last, since checking a schedule uses Prefect's own models.
The flow and the deployment are replaced by stand-ins that fail at once, so a
case that is not rejected shows up as a failure, not as a training run.
"""

from __future__ import annotations

import json
import sys
import time
import types
from dataclasses import asdict
from pathlib import Path

from .corpus import BY_NAME
from .harness import Assets, run_case


class ReachedTheFlow(RuntimeError):
    """A case passed every check: the CLI would have started training or serving."""


def _guard_the_flow() -> None:
    """Stand-ins for the flow and the deployment, so a case that is not bad input fails fast instead of training."""
    for module_name, function in (("flows.pipeline", "train_flow"), ("flows.deployment", "serve_deployment")):
        stub = types.ModuleType(module_name)

        def reached(*_args, _what=function, **_kwargs):
            raise ReachedTheFlow(f"{_what} was called: the input passed every check")

        setattr(stub, function, reached)
        sys.modules[module_name] = stub


def main(out: Path, root: Path, names: list[str]) -> None:
    _guard_the_flow()
    assets_root = out.with_name(f"{out.stem}-assets")
    assets_root.mkdir(parents=True, exist_ok=True)
    assets = Assets(assets_root)
    names = sorted(names or BY_NAME, key=lambda name: (BY_NAME[name].command == "serve", name))
    results: dict = {"cases": {}, "prefect_modules_after_run_cases": None}
    started = time.perf_counter()
    for name in names:
        case = BY_NAME[name]
        if case.command == "serve" and results["prefect_modules_after_run_cases"] is None:
            results["prefect_modules_after_run_cases"] = sorted(m for m in sys.modules if m.split(".")[0] == "prefect")
        case_started = time.perf_counter()
        outcome = run_case(case, root / name, assets)
        results["cases"][name] = {**asdict(outcome), "wall_s": round(time.perf_counter() - case_started, 3)}
    if results["prefect_modules_after_run_cases"] is None:
        results["prefect_modules_after_run_cases"] = sorted(m for m in sys.modules if m.split(".")[0] == "prefect")
    results["wall_s"] = round(time.perf_counter() - started, 3)
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
