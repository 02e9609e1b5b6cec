"""A real browser on the Prefect UI: progress, metrics, checkpoint and failure artifacts render.

    python -m tests.e2e.ui.ui_smoke [--work-dir DIR] [--keep-screenshots-in DIR]

Starts `rankflow ui` on a free port (its own PREFECT_HOME), runs the tiny job
against it twice with `rankflow run`, and drives Debian's headless Chromium
(playwright, `executable_path=/usr/bin/chromium`):

1. a run whose rank 1 is stopped (SIGSTOP) at step 4: while the watchdog
   waits, the flow run is Running with its progress and metrics artifacts
   filled in mid-segment, and is screenshotted so; the watchdog then ends the
   launch, the segment is retried and the run completes with its checkpoint
   and loss curve;
2. a run with a code error at step 4, started once the first is stalled (it
   trains while the first waits for its watchdog): the flow run fails, not
   retried, and its failure report names rank 1 and `code_error`.

Screenshots go to WORK_DIR/screenshots (and, with --keep-screenshots-in, are
copied there). Exit status 0 when every check passed. `tests/e2e/ui/test_ui_smoke.py`
runs this as a pytest test marked `ui`, skipped when Chromium is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _api(api_url: str, path: str, body: dict | None = None):
    request = urllib.request.Request(
        f"{api_url}{path}",
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _write_config(work: Path, name: str, fault_steps: int) -> Path:
    tree = {
        "run": {"name": name, "seed": 7, "work_dir": str(work / "runs")},
        "model": {"config": str(EXAMPLES / "tiny" / "model_config.json")},
        "tokenizer": {"path": str(EXAMPLES / "tiny" / "tokenizer.json")},
        "data": {"path": str(EXAMPLES / "tiny" / "sft.jsonl"), "max_seq_len": 128},
        "train": {
            "steps": fault_steps,
            "steps_per_segment": 3,
            "global_batch_size": 8,
            "learning_rate": 3e-3,
            "logical_dp": 2,
            "nproc_per_node": 2,
            "stall_timeout_s": 40,
        },
        "storage": {"url": str(work / "store")},
    }
    path = work / f"{name}.toml"
    path.write_text(
        "\n".join(
            f"[{section}]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in values.items())
            for section, values in tree.items()
        )
    )
    return path


class Smoke:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.shots = work / "screenshots"
        self.shots.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.ui_url = f"http://127.0.0.1:{self.port}"
        self.api_url = f"{self.ui_url}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(work / "prefect-home"),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_UI_URL": self.ui_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        self.checks: list[str] = []

    def check(self, condition: bool, what: str) -> None:
        if not condition:
            raise AssertionError(f"UI smoke check failed: {what}")
        self.checks.append(what)
        print(f"ok: {what}", flush=True)

    def start_ui(self) -> subprocess.Popen:
        server = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "ui", "--port", str(self.port), "--log", str(self.work / "server.log")],
            env={k: v for k, v in self.env.items() if k != "PREFECT_API_URL"},
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        for line in server.stdout:  # `rankflow ui` prints the UI address once the server is healthy
            if line.startswith("Prefect UI:"):
                return server
        raise RuntimeError(f"rankflow ui did not start; see {self.work / 'server.log'}")

    def start_run(self, config: Path, fault: str | None) -> subprocess.Popen:
        env = dict(self.env)
        if fault:
            env.update(RANKFLOW_FAULT_ONCE=f"4:1:{self.work / ('fault-' + config.stem)}", RANKFLOW_FAULT_KIND=fault)
        log = (self.work / f"{config.stem}.out").open("w")
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", str(config)], env=env, stdout=log, stderr=subprocess.STDOUT
        )

    def flow_run(self, name: str) -> dict | None:
        runs = _api(self.api_url, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}})
        return runs[0] if runs else None

    def artifacts(self, flow_run_id: str) -> dict[str, dict]:
        found = _api(self.api_url, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
        return {a["key"]: a for a in sorted(found, key=lambda a: a["created"])}

    def wait_for(self, what: str, probe, timeout_s: float = 240.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = probe()
            if value:
                return value
            time.sleep(1.0)
        raise AssertionError(f"UI smoke: timed out waiting for {what}")

    def shoot(self, page, url: str, name: str, expect_text: list[str], tab: str | None = None) -> None:
        page.goto(url, wait_until="networkidle")
        try:
            if tab:
                page.get_by_text(tab, exact=True).first.click()
            for text in expect_text:
                page.get_by_text(text, exact=False).first.wait_for(timeout=30_000)
        finally:  # a failed check keeps its screenshot, to see what the page showed
            page.screenshot(path=str(self.shots / f"{name}.png"), full_page=True)
        self.check(True, f"{name}: page shows {expect_text}")


def run_smoke(work: Path) -> Smoke:
    from playwright.sync_api import sync_playwright

    smoke = Smoke(work)
    server = smoke.start_ui()
    runs: list[subprocess.Popen] = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            # 1. A run stalled mid-segment (rank 1 stopped), then retried to completion.
            runs.append(smoke.start_run(_write_config(work, "smoke", 6), fault="stop"))
            stalled = smoke.wait_for("the stalled segment's live metrics", lambda: _live_metrics(smoke))
            run, artifacts = stalled
            # 2. starts now: it trains while the first waits out its watchdog, idle.
            runs.append(smoke.start_run(_write_config(work, "smoke-failed", 6), fault="code"))
            smoke.check(run["state_type"] == "RUNNING", "the flow run is running while the segment is stalled")
            smoke.check(
                0 < artifacts["progress"]["data"] < 100, f"progress is partial: {artifacts['progress']['data']}%"
            )
            run_id = run["name"]
            smoke.shoot(
                page,
                f"{smoke.ui_url}/runs/flow-run/{run['id']}",
                "running-flow-run",
                [run_id, f"{run_id}-progress", f"{run_id}-metrics"],
                tab="Artifacts",
            )
            smoke.shoot(
                page,
                f"{smoke.ui_url}/artifacts/artifact/{artifacts['metrics']['id']}",
                "running-metrics",
                ["loss", "grad_norm", "tokens_per_s"],
            )
            smoke.check(runs[0].wait(timeout=300) == 0, "the stalled run was retried and completed")
            done = smoke.artifacts(run["id"])
            checkpoint = done[f"{run_id}-checkpoint"]
            smoke.check(
                "data:image/png;base64," in checkpoint["data"], "the checkpoint artifact carries the loss curve"
            )
            smoke.shoot(
                page,
                f"{smoke.ui_url}/runs/flow-run/{run['id']}",
                "completed-flow-run",
                [f"{run_id}-checkpoint", f"{run_id}-failure"],
                tab="Artifacts",
            )
            smoke.shoot(
                page,
                f"{smoke.ui_url}/artifacts/artifact/{checkpoint['id']}",
                "checkpoint-artifact",
                ["newest committed checkpoint", "ledger", "loss curve"],
            )
            image = page.locator("img[alt^='loss curve']").first
            smoke.check(image.evaluate("img => img.complete && img.naturalWidth > 0"), "the loss curve image renders")
            # 2. A run that fails with a code error: not retried, the report names the rank and the cause.
            smoke.check(runs[1].wait(timeout=300) == 1, "the failing run exits 1")
            failed_run = smoke.wait_for("the failed flow run", lambda: _failed_run(smoke))
            report = smoke.artifacts(failed_run["id"])[f"{failed_run['name']}-failure"]
            smoke.check("code_error" in report["data"], "the failure report names the cause class")
            smoke.shoot(
                page,
                f"{smoke.ui_url}/runs/flow-run/{failed_run['id']}",
                "failed-flow-run",
                [failed_run["name"], "Failed", f"{failed_run['name']}-failure"],
                tab="Artifacts",
            )
            smoke.shoot(
                page,
                f"{smoke.ui_url}/artifacts/artifact/{report['id']}",
                "failure-report",
                ["code_error", "first failing rank", "Last lines of rank 1"],
            )
            browser.close()
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
        server.terminate()
        server.wait(timeout=60)
    return smoke


def _live_metrics(smoke: Smoke):
    """The smoke run and its live artifacts, once the metrics table has rows and the run is renamed."""
    runs = _api(smoke.api_url, "/flow_runs/filter", {"flow_runs": {"name": {"like_": "smoke-"}}})
    for run in runs:
        if (
            run["name"].startswith("smoke-")
            and "(planning)" not in run["name"]
            and not run["name"].startswith("smoke-failed")
        ):
            artifacts = smoke.artifacts(run["id"])
            metrics = artifacts.get(f"{run['name']}-metrics")
            progress = artifacts.get(f"{run['name']}-progress")
            rows = (
                json.loads(metrics["data"])
                if metrics and isinstance(metrics["data"], str)
                else (metrics or {}).get("data")
            )
            if rows and rows[0].get("step") is not None and progress and progress["data"] > 50:
                return run, {"metrics": metrics, "progress": progress}
    return None


def _failed_run(smoke: Smoke) -> dict | None:
    runs = _api(smoke.api_url, "/flow_runs/filter", {"flow_runs": {"state": {"type": {"any_": ["FAILED"]}}}})
    return runs[0] if runs else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=None, help="where runs, the server log and screenshots go")
    parser.add_argument("--keep-screenshots-in", type=Path, default=None, help="also copy the screenshots here")
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rankflow-ui-smoke-"))
    smoke = run_smoke(work.resolve())
    if args.keep_screenshots_in:
        args.keep_screenshots_in.mkdir(parents=True, exist_ok=True)
        for shot in smoke.shots.glob("*.png"):
            shutil.copy2(shot, args.keep_screenshots_in / shot.name)
    print(json.dumps({"ui_smoke": "passed", "checks": len(smoke.checks), "screenshots": str(smoke.shots)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
