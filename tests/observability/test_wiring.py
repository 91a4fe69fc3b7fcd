"""The telemetry is wired into the worker and the job runner (the three one-line hooks)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _calls(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def test_worker_serves_metrics_and_reports_exited_runners() -> None:
    worker = ROOT / "worker"
    assert "serve_worker_metrics" in _calls(worker / "hooks.py"), (
        "worker/hooks.py: call worker.metrics.server.serve_worker_metrics() at worker start"
    )
    assert "job_process_exited" in _calls(worker / "task.py"), (
        "worker/task.py: call worker.metrics.server.job_process_exited(pid) after the runner exits"
    )


def test_job_runner_feeds_the_telemetry() -> None:
    calls = _calls(ROOT / "worker" / "job" / "runner.py")
    assert "track_job" in calls, (
        "worker/job/runner.py: run training inside worker.metrics.telemetry.track_job(...)"
    )
