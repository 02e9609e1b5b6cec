"""The UI smoke test (`python -m tests.e2e.ui.ui_smoke`) as a pytest test, marked `ui`.

Skipped, saying why, when Debian's Chromium or playwright is not installed
(`.ci/run` installs both). Screenshots stay under the test's tmp_path.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.e2e.ui.ui_smoke import CHROMIUM, run_smoke

pytestmark = [pytest.mark.ui, pytest.mark.flow, pytest.mark.distributed]


@pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason=f"no Chromium at {CHROMIUM}: apt-get install -y chromium")
@pytest.mark.skipif(
    importlib.util.find_spec("playwright") is None, reason="playwright is not installed: pip install -e '.[dev]'"
)
def test_progress_metrics_checkpoint_and_failure_render_in_a_real_browser(tmp_path):
    smoke = run_smoke(tmp_path)
    names = {p.name for p in smoke.shots.glob("*.png")}
    assert {
        "running-flow-run.png",
        "running-metrics.png",
        "checkpoint-artifact.png",
        "failed-flow-run.png",
        "failure-report.png",
    } <= names
    assert len(smoke.checks) >= 13
