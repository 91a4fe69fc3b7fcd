"""bench/distributed.py end to end on the CPU: 2 gloo ranks against one process, quick preset.

The benchmark is what a multi-GPU host runs once (bench/gpu_check.sh); here its plumbing (env://
ranks on a free port, per-rank results, the single-process baseline, the JSON) runs on the CPU. No
speed is asserted: the sharded host state must be about half per rank and the 2-rank fp32 weights
must equal the single process's to rounding.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIELDS = (
    "steps",
    "steps_per_s",
    "single_steps_per_s",
    "speedup_vs_single",
    "stall_fraction",
    "host_bytes_per_rank",
    "host_bytes_by_rank",
    "single_host_bytes",
    "host_bytes_per_rank_ratio",
    "bytes_reduced_per_step",
    "bytes_gathered_per_step",
    "max_rel_diff_vs_single",
    "replicas_identical",
    "grad_norm_max_rel_diff_vs_single",
    "metrics_world_size",
)

#: The benchmark's own bound (each of its processes) and, a minute later, the test's: they catch a hang,
#: not a slow run. Six processes each importing torch and transformers take 200 s and more on a 2-core
#: AVX2 box beside the suite's other modules and a CPU hog.
DEADLINE = 900
pytestmark = pytest.mark.timeout(DEADLINE + 120)


@pytest.mark.slow
def test_quick_two_rank_run_matches_one_process_with_half_the_host_state() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.distributed",
            "--nproc",
            "2",
            "--quick",
            "--json",
            "--device",
            "cpu",
            "--timeout",
            str(DEADLINE),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=DEADLINE + 60,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    env = doc["env"]
    assert env["nproc"] == 2 and env["backend"] == "gloo" and env["dtype"] == "float32" and env["params"] > 0
    assert list(doc["results"]) == ["zenflow", "offload", "device"]
    for mode, r in doc["results"].items():
        assert set(FIELDS) <= set(r), (mode, sorted(set(FIELDS) - set(r)))
        assert r["steps"] == 3 and r["metrics_world_size"] == 2, mode
        assert r["steps_per_s"] > 0 and r["single_steps_per_s"] > 0, mode
        assert 0.0 <= r["stall_fraction"] < 1.0, mode
        assert r["replicas_identical"] is True, mode
        assert r["max_rel_diff_vs_single"] is not None and r["max_rel_diff_vs_single"] < 1e-4, (mode, r)
        # the clipping norm is one process's to fp32 rounding (a mis-scaled reduction would be >= 1e-3 off)
        assert r["grad_norm_max_rel_diff_vs_single"] < 1e-5, (mode, r)
        assert r["bytes_reduced_per_step"] > 0, mode  # every mode reduces its gradients across ranks
        assert len(r["host_bytes_by_rank"]) == 2
        assert f"{mode}_host_bytes_per_rank_ratio" in doc["ratios"]
    zf, off = doc["results"]["zenflow"], doc["results"]["offload"]
    assert zf["host_bytes_per_rank_ratio"] < 0.75, zf
    assert off["host_bytes_per_rank_ratio"] < 0.75, off
    assert off["bytes_gathered_per_step"] > 0  # the updated shards come back to every replica
    assert math.isfinite(zf["speedup_vs_single"])
