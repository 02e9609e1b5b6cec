"""`python -m bench.boundary`'s pure parts: the model per state size, the boundary from progress records, the fit.

The parameter count is checked against transformers' own Qwen3 built on the meta device; the measured part
(launches, SeaweedFS) runs as `python -m bench.boundary --quick`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench import boundary

EXAMPLE_CONFIG = Path(boundary.EXAMPLES) / "tiny" / "model_config.json"


@pytest.mark.parametrize("gigabytes", [0.02, 0.1, 0.5, 2.0])
def test_the_model_per_size_has_the_counted_parameters_and_about_the_state_asked(gigabytes):
    overrides = boundary.model_for(gigabytes)
    config = AutoConfig.for_model(**(json.loads(EXAMPLE_CONFIG.read_text()) | overrides))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == boundary.qwen3_params(overrides["hidden_size"], overrides["num_hidden_layers"])
    assert boundary.state_gb(overrides) == counted * 12 / 1e9
    if gigabytes >= 0.1:
        assert abs(boundary.state_gb(overrides) / gigabytes - 1) < 0.1


def test_the_boundary_is_the_last_step_of_one_segment_to_the_first_of_the_next():
    before = [{"event": "ready", "time": 1.0}, {"event": "step", "time": 2.0}, {"event": "step", "time": 3.5}]
    after = [{"event": "ready", "time": 9.0}, {"event": "step", "time": 10.25}, {"event": "step", "time": 11.0}]
    assert boundary.boundary_s(before + [{"event": "saved", "time": 4.0}], after) == 6.75


def test_the_critical_path_is_the_wait_for_ready_and_what_the_first_step_takes_beyond_a_step():
    before = [{"event": "ready", "time": 1.0}, {"event": "step", "time": 2.0}, {"event": "step", "time": 3.5}]
    after = [{"event": "ready", "time": 9.0}, {"event": "step", "time": 10.25}, {"event": "step", "time": 11.0}]
    assert boundary.critical_path_s(before, after) == 5.5 + 0.5  # ready 5.5 s after; first step 1.25 vs 0.75
    faster_first = [{"event": "ready", "time": 9.0}, {"event": "step", "time": 9.5}, {"event": "step", "time": 10.5}]
    assert boundary.critical_path_s(before, faster_first) == 5.5
    quiet_before = [{"event": "ready", "time": 1.0}, {"event": "step", "time": 2.0}, {"event": "step", "time": 2.5}]
    upload_beside = [
        {"event": "ready", "time": 9.0},
        {"event": "step", "time": 10.25},
        {"event": "step", "time": 12.25},
    ]
    # K+1's second step (2 s) ran beside the upload: the quiet step (0.5 s) is what the first is measured against.
    assert boundary.critical_path_s(quiet_before, upload_beside) == 6.5 + 0.75


def test_the_fit_recovers_a_line_and_one_point_is_all_per_gb():
    fixed, per_gb = boundary.linear_fit([0.1, 0.5, 2.0], [7.2 + 6.8 * x for x in (0.1, 0.5, 2.0)])
    assert fixed == pytest.approx(7.2) and per_gb == pytest.approx(6.8)
    assert boundary.linear_fit([2.0], [5.0]) == (0.0, 2.5)


def test_medians_are_taken_per_figure():
    runs = [{"boundary_s": 3.0, "save_s": 1.0}, {"boundary_s": 1.0, "save_s": 5.0}, {"boundary_s": 2.0, "save_s": 2.0}]
    assert boundary.medians(runs) == {"boundary_s": 2.0, "save_s": 2.0}


def test_bad_arguments_exit_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exited:
        boundary.main(["--sizes-gb", "0"])
    assert exited.value.code == 2 and "--sizes-gb must be positive" in capsys.readouterr().err
