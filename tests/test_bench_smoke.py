"""bench/gpu_check.sh end to end on the CPU, tiny: the one-shot GPU script must not fail on its own logic.

The GPU run is a single short shot on a lent machine, so the script's plumbing (Python discovery, the
C++ build step, the bench's flags, the JSON it leaves behind) is exercised here with DEVICE=cpu. No
speed is asserted: only that every variant ran its steps and the document has what the targets need.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["zenflow-dacc", "zenflow", "device", "offload"]

pytestmark = pytest.mark.timeout(300)


def test_gpu_check_script_runs_on_cpu_and_writes_the_document(tmp_path: Path) -> None:
    env = {**os.environ, "DEVICE": "cpu", "MODEL_SIZE": "tiny", "STEPS": "3", "OFFLOAD_STEPS": "2", "WARMUP": "1",
           "BATCH": "2", "SEQ": "32", "OUT": str(tmp_path), "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== environment" in proc.stdout and "cpu_adam ready" in proc.stdout
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(doc["results"]) == VARIANTS and doc["variants_pending"] == []
    for name, r in doc["results"].items():
        want = 2 if name == "offload" else 3
        assert r["steps"] == want == len(r["per_step"]), name
        assert math.isfinite(r["final_loss"]) and r["steps_per_s"] > 0, name
        assert r["stall_s_on_window_ends"] + r["stall_s_on_other_steps"] == pytest.approx(
            sum(s["stall_s"] for s in r["per_step"]), abs=1e-4)
    for key in ("zenflow_speedup_vs_offload", "zenflow-dacc_speedup_vs_offload", "zenflow_loss_rel_diff_vs_device"):
        assert key in doc["ratios"], key
    assert doc["env"]["device"] == "cpu" and doc["env"]["params"] > 0
    assert (tmp_path / "gpu_check.log").read_text().count("steps/s") >= len(VARIANTS)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU host")
def test_gpu_check_script_says_why_it_cannot_run_without_a_gpu(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "MODEL_SIZE")}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env={**env, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "needs a CUDA machine" in proc.stderr
