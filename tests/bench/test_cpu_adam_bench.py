"""bench/cpu_adam.py's window-accumulation table, as ``bench/gpu_check.sh`` calls it (``--quick
--json``), on a tiny size: one row per (gradient dtype -> accumulator dtype) pair and step, the ratio
being torch's time over C++'s. No speed is asserted."""

from __future__ import annotations

import json
from types import ModuleType

import pytest

from bench import cpu_adam as bench
from tests.support import cpu_adam_extension

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", autouse=True)
def ext() -> ModuleType:
    return cpu_adam_extension()


def test_quick_json_has_every_pair_and_step(capsys: pytest.CaptureFixture[str]) -> None:
    res = bench.main(["--quick", "--params", "5000", "--threads", "1", "--steps", "2", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(res))
    rows = res["accumulate"]
    assert [(r["grad"], r["acc"], r["step"]) for r in rows] == [
        (g, a, s) for g, a in bench.ACC_PAIRS for s in ("first", "add")
    ]
    for r in rows:
        assert r["cpp_ms"] > 0 and r["torch_ms"] > 0
        assert r["ratio"] == pytest.approx(r["torch_ms"] / r["cpp_ms"])
    assert res["accumulate_min_ratio"] == min(r["ratio"] for r in rows)
    assert res["ours_ms"] > 0 and res["torch_foreach_ms"] is None  # --quick skips torch foreach


def test_table_prints_the_ratio_per_pair(capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--no-adam", "--params", "3000", "--threads", "1", "--steps", "1", "--warmup", "0"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("window accumulation: ")
    body = [line.split() for line in out[2:-1]]
    assert [(b[0], b[2], b[3]) for b in body] == [
        (g, a, s) for g, a in bench.ACC_PAIRS for s in ("first", "add")
    ]
    assert all(b[-1].endswith("x") and float(b[-1][:-1]) > 0 for b in body)
    assert out[-1].startswith("  lowest C++/torch ratio: ")


def test_lean_moments_row_has_its_bytes_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    res = bench.main(
        ["--params", "5000", "--threads", "1", "--steps", "2", "--warmup", "0", "--no-accumulate", "--json"]
    )
    lean = res["lean"]
    assert lean["bytes_per_param"] == 20 and res["bytes_per_param"] == 28  # fp32 grads
    assert lean["host_state_bytes_per_param"] == 8 and lean["ms"] > 0
    for k in ("ours_fp32", "torch_fused", "torch_foreach"):
        assert lean[f"speedup_vs_{k}"] > 0
    bench.main(["--params", "5000", "--threads", "1", "--steps", "1", "--warmup", "0", "--no-accumulate"])
    assert "ours_lean (bf16 moments, 8 B/param of state, 20 B/param moved)" in capsys.readouterr().out
