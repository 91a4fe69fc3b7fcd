"""bench.gpu_report and bench.gpu_util: the GPU check's report and its NVML sampler, without a GPU."""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpu_report
from bench.gpu_util import UtilSampler, cuda_index


def _engine_doc(variants: dict[str, float]) -> dict[str, Any]:
    results = {
        name: {
            "steps": 4,
            "steps_per_s": sps,
            "stall_fraction": 0.1,
            "gpu_util_percent": 80.0,
            "final_loss": 2.0,
            "peak_device_memory_gib": 1.5,
        }
        for name, sps in variants.items()
    }
    return {
        "env": {"model_size": "1b", "params": 1.1e9, "dtype": "bfloat16", "device_name": "GPU"},
        "results": results,
        "ratios": {"zenflow_speedup_vs_offload": variants.get("zenflow", 0) / variants.get("offload", 1)},
        "targets": {},
    }


def test_summary_merges_the_extra_variants_and_names_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "gpu_check.json").write_text(json.dumps(_engine_doc({"zenflow": 3.0, "offload": 1.0})))
    (tmp_path / "gpu_check_extra.json").write_text(json.dumps(_engine_doc({"zenflow-dacc": 2.5})))
    (tmp_path / "cpu_adam.json").write_text(json.dumps({"ratio": 1.0}))
    (tmp_path / "memory_run.log").write_text("Traceback ...\nAttributeError: no such thing\n\n")
    assert gpu_report.main(["--out", str(tmp_path), "--quiet", "--no-chart"]) == 0
    doc = json.loads((tmp_path / "gpu_check_summary.json").read_text())
    assert [r["variant"] for r in doc["headline"]["rows"]] == ["zenflow", "offload", "zenflow-dacc"]
    assert doc["headline"]["ratios"]["zenflow_speedup_vs_offload"] == 3.0
    assert doc["sections"]["cpu_adam"] == {
        "what": doc["sections"]["cpu_adam"]["what"],
        "status": "ok",
        "data": {"ratio": 1.0},
    }
    assert doc["sections"]["memory_run"]["status"] == "missing"
    assert doc["sections"]["memory_run"]["log_tail"] == "AttributeError: no such thing"
    assert doc["chart"].startswith("none:")


def test_headline_table_prints_every_variant_and_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "gpu_check.json").write_text(json.dumps(_engine_doc({"zenflow": 3.0, "offload": 1.0})))
    assert gpu_report.main(["--out", str(tmp_path), "--headline"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("HEADLINE: 1b Llama (1.10B params, bfloat16) on GPU")
    assert (
        "zenflow" in text
        and "offload" in text
        and "80%" in text
        and "zenflow_speedup_vs_offload: 3.000" in text
    )


def test_headline_without_a_document_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gpu_check.log").write_text("RuntimeError: CUDA out of memory\n")
    assert gpu_report.main(["--out", str(tmp_path), "--headline"]) == 1
    assert "CUDA out of memory" in capsys.readouterr().out


def test_sampler_off_cuda_reports_none_and_why() -> None:
    with UtilSampler(cuda_index(torch.device("cpu"))) as s:
        pass
    assert s.mean is None and s.reason == "not a CUDA run"


def test_sampler_averages_nvml_readings_and_shuts_nvml_down(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    readings = iter([40.0, 60.0] + [50.0] * 10_000)
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(f"handle {i}") or object(),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=next(readings)),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = UtilSampler(3, interval=0.001)
    with s:
        deadline = time.monotonic() + 30  # what it waits for: two samples
        while len(s.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
    s.__exit__(None, None, None)  # idempotent: the bench may stop it twice
    assert s.samples[:2] == [40.0, 60.0] and 40.0 <= (s.mean or 0) <= 60.0
    assert calls == ["init", "handle 3", "shutdown"]


def test_cuda_index_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2")
    assert cuda_index(torch.device("cuda", 1)) == 2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda_index(torch.device("cuda", 1)) == 1
