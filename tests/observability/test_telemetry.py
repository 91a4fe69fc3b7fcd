"""Worker telemetry: exact sample values from StepMetrics, job lifecycle, multiprocess serving."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from offload.step_metrics import StepMetrics
from worker.metrics import nvml, telemetry
from worker.metrics import server as metrics_server
from worker.metrics.server import HardwareCollector, WorkerCollector
from worker.metrics.telemetry import WorkerTelemetry

ROOT = Path(__file__).resolve().parents[2]
L = {"worker": "w1", "hostname": "h1", "gpu": "0", "base_model": "tiny", "mode": "zenflow"}


def _step(step: int = 1, **kw) -> StepMetrics:
    d = dict(
        step=step,
        wall_seconds=0.5,
        compute_seconds=0.4,
        stall_seconds=0.1,
        cpu_optimizer_seconds=0.2,
        bytes_device_to_host=1000,
        bytes_host_to_device=600,
        device_optimizer_state_bytes=4096,
    )
    d.update(kw)
    return StepMetrics(**d)


@pytest.fixture
def tel() -> tuple[WorkerTelemetry, CollectorRegistry]:
    reg = CollectorRegistry()
    return WorkerTelemetry("w1", 0, registry=reg, hostname="h1"), reg


def test_observe_step_exact_values(tel) -> None:
    t, reg = tel
    t.job_started("ftjob-1", base_model="tiny", mode="zenflow")
    t.observe_step(_step(1), tokens=256, loss=2.5, base_model="tiny", mode="zenflow")
    t.observe_step(
        _step(2, wall_seconds=1.0, stall_seconds=0.0, cpu_optimizer_seconds=0.0),
        tokens=128,
        loss=2.0,
        base_model="tiny",
        mode="zenflow",
    )
    g = reg.get_sample_value
    assert g("zenflow_step_seconds_count", L) == 2
    assert g("zenflow_step_seconds_sum", L) == pytest.approx(1.5)
    assert g("zenflow_step_seconds_bucket", {**L, "le": "0.5"}) == 1
    assert g("zenflow_step_seconds_bucket", {**L, "le": "1.0"}) == 2
    assert g("zenflow_step_stall_seconds_count", L) == 2
    assert g("zenflow_step_stall_seconds_sum", L) == pytest.approx(0.1)
    assert g("zenflow_step_stall_seconds_bucket", {**L, "le": "0.0"}) == 1  # the stall-free step
    assert g("zenflow_stall_seconds_total", L) == pytest.approx(0.1)
    # the CPU optimizer is observed only at steps where it ran
    assert g("zenflow_cpu_optimizer_step_seconds_count", L) == 1
    assert g("zenflow_cpu_optimizer_step_seconds_sum", L) == pytest.approx(0.2)
    assert g("zenflow_offload_transfer_bytes_total", {**L, "direction": "device_to_host"}) == 2000
    assert g("zenflow_offload_transfer_bytes_total", {**L, "direction": "host_to_device"}) == 1200
    assert g("zenflow_tokens_total", L) == 384
    assert g("zenflow_train_loss", L) == 2.0
    assert g("zenflow_gpu_utilization_ratio", L) == 1.0  # the last step did not stall
    base = {k: L[k] for k in ("worker", "hostname", "gpu")}
    assert g("zenflow_device_memory_bytes", {**base, "kind": "optimizer_state"}) == 4096
    cur = {**base, "job_id": "ftjob-1", "base_model": "tiny", "mode": "zenflow"}
    assert g("zenflow_worker_current_job", cur) == 1


def test_utilization_is_compute_over_wall_and_stall_is_clamped(tel) -> None:
    t, reg = tel
    t.observe_step(
        _step(1, wall_seconds=2.0, stall_seconds=0.5), tokens=1, loss=None, base_model="tiny", mode="zenflow"
    )
    assert reg.get_sample_value("zenflow_gpu_utilization_ratio", L) == pytest.approx(0.75)
    assert reg.get_sample_value("zenflow_train_loss", L) is None  # no loss reported: no series
    # a stall reported longer than the step (clock skew) counts as the whole step, never more
    t.observe_step(
        _step(2, wall_seconds=1.0, stall_seconds=3.0),
        tokens=1,
        loss=float("nan"),
        base_model="tiny",
        mode="zenflow",
    )
    assert reg.get_sample_value("zenflow_stall_seconds_total", L) == pytest.approx(1.5)
    assert reg.get_sample_value("zenflow_gpu_utilization_ratio", L) == 0.0
    assert reg.get_sample_value("zenflow_train_loss", L) is None  # NaN is not published


def test_job_finished_removes_job_series_keeps_totals(tel) -> None:
    t, reg = tel
    t.job_started("ftjob-1", base_model="tiny", mode="zenflow")
    t.observe_step(_step(1), tokens=10, loss=1.0, base_model="tiny", mode="zenflow")
    t.job_finished("succeeded")
    base = {"worker": "w1", "hostname": "h1", "gpu": "0"}
    cur = {**base, "job_id": "ftjob-1", "base_model": "tiny", "mode": "zenflow"}
    assert reg.get_sample_value("zenflow_worker_current_job", cur) is None
    assert reg.get_sample_value("zenflow_train_loss", L) is None
    assert reg.get_sample_value("zenflow_gpu_utilization_ratio", L) is None
    assert reg.get_sample_value("zenflow_device_memory_bytes", {**base, "kind": "optimizer_state"}) is None
    assert reg.get_sample_value("zenflow_tokens_total", L) == 10
    assert reg.get_sample_value("zenflow_worker_jobs_total", {**base, "status": "succeeded"}) == 1
    # a second job replaces the first in the info gauge; no job label anywhere else
    t.job_started("ftjob-2", base_model="tiny", mode="offload")
    t.job_started("ftjob-3", base_model="tiny", mode="offload")
    series = [s for m in reg.collect() for s in m.samples]
    assert {s.labels.get("job_id") for s in series if "job_id" in s.labels} == {"ftjob-3"}
    assert all("job_id" not in s.labels for s in series if s.name != "zenflow_worker_current_job")


class FakeNvml(nvml.Nvml):
    def __init__(self, ok: bool = True) -> None:
        super().__init__()
        self._ok = ok

    def available(self) -> bool:
        return bool(self._ok)

    def index_of_uuid(self, uuid: str) -> int | None:
        return 3 if uuid == "GPU-abc" else None

    def uuid(self, index: int) -> str | None:
        return f"GPU-uuid-{index}" if self._ok else None

    def sample(self, index: int):
        return (0.42, 1 << 30, 80 << 30) if self._ok else None


def test_hardware_collector_nvml_and_info() -> None:
    reg = CollectorRegistry()
    reg.register(HardwareCollector("w1", "0", "h1", FakeNvml(), nvml_index=0))
    base = {"worker": "w1", "hostname": "h1", "gpu": "0"}
    assert reg.get_sample_value("zenflow_nvml_gpu_utilization_ratio", base) == pytest.approx(0.42)
    assert reg.get_sample_value("zenflow_device_memory_bytes", {**base, "kind": "used"}) == 1 << 30
    assert reg.get_sample_value("zenflow_device_memory_bytes", {**base, "kind": "total"}) == 80 << 30
    assert (
        reg.get_sample_value(
            "zenflow_worker_info", {**base, "gpu_uuid": "GPU-uuid-0", "version": metrics_server._version()}
        )
        == 1
    )
    # without a GPU: only the info series, no error
    reg2 = CollectorRegistry()
    reg2.register(HardwareCollector("w1", "none", "h1", FakeNvml(ok=False), nvml_index=None))
    assert [m.name for m in reg2.collect()] == ["zenflow_worker_info"]


def test_real_nvml_is_guarded() -> None:
    n = nvml.Nvml()
    n.available()  # never raises, GPU or not
    if not n.available():
        assert n.sample(0) is None


@pytest.mark.parametrize(
    ("cvd", "nvml_ok", "want"),
    [
        ("2,3", True, "2"),
        ("GPU-abc", True, "3"),
        ("GPU-zzz", True, "none"),
        ("", True, "none"),
        ("-1", True, "none"),
        (None, True, "0"),
        (None, False, "none"),
    ],
)
def test_detect_gpu(monkeypatch, cvd, nvml_ok, want) -> None:
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    if cvd is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    assert nvml.detect_gpu(FakeNvml(nvml_ok)) == want


def test_detect_gpu_in_a_container_uses_the_host_index(monkeypatch) -> None:
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "3")  # the container's only GPU is NVML index 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml.detect_gpu(FakeNvml()) == "3"
    assert nvml.nvml_index(FakeNvml()) == 0
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    assert nvml.detect_gpu(FakeNvml()) == "0"


def test_track_job_statuses(tel) -> None:
    from trainer.events import ErrorEvent, RunFinished

    t, reg = tel
    base = {"worker": "w1", "hostname": "h1", "gpu": "0"}
    cur = {**base, "job_id": "ftjob-t", "base_model": "ckpt-7b", "mode": "zenflow"}
    seen = []
    with telemetry.track_job("ftjob-t", base_model="/models/ckpt-7b/", mode="zenflow", telemetry=t) as tj:
        assert reg.get_sample_value("zenflow_worker_current_job", cur) == 1
        cb = tj.wrap(seen.append)
        cb(
            RunFinished(
                steps=1,
                cancelled=False,
                final_model_dir=None,
                train_loss=1.0,
                valid_loss=None,
                trained_tokens=1,
            )
        )
    assert len(seen) == 1
    assert reg.get_sample_value("zenflow_worker_current_job", cur) is None
    assert reg.get_sample_value("zenflow_worker_jobs_total", {**base, "status": "succeeded"}) == 1
    with pytest.raises(RuntimeError), telemetry.track_job("j2", base_model="m", mode="zenflow", telemetry=t):
        raise RuntimeError("boom")
    with telemetry.track_job("j3", base_model="m", mode="zenflow", telemetry=t) as tj:
        tj.wrap()(ErrorEvent(message="x", error_type="ValueError"))
    with telemetry.track_job("j4", base_model="m", mode="zenflow", telemetry=t):
        pass  # stopped without run_finished: preempted
    assert reg.get_sample_value("zenflow_worker_jobs_total", {**base, "status": "failed"}) == 2
    assert reg.get_sample_value("zenflow_worker_jobs_total", {**base, "status": "interrupted"}) == 1


CHILD = textwrap.dedent(
    """
    import os, sys
    from offload.step_metrics import StepMetrics
    from worker.metrics.telemetry import WorkerTelemetry
    t = WorkerTelemetry("w1", "0", hostname="h1")
    t.job_started(sys.argv[1], base_model="tiny", mode="zenflow")
    m = StepMetrics(step=1, wall_seconds=0.5, compute_seconds=0.4, stall_seconds=0.1,
                    cpu_optimizer_seconds=0.2, bytes_device_to_host=1000, bytes_host_to_device=600,
                    device_optimizer_state_bytes=4096)
    for _ in range(int(sys.argv[2])):
        t.observe_step(m, tokens=100, loss=1.5, base_model="tiny", mode="zenflow")
    if sys.argv[3] == "finish":
        t.job_finished("succeeded")
    print(os.getpid(), flush=True)
    """
)


def _child(mp: Path, job: str, steps: int, finish: bool) -> int:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, job, str(steps), "finish" if finish else "die"],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return int(out.stdout.strip())


def _samples(collector) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value for m in collector.collect() for s in m.samples
    }


def _get(samples, name, labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_multiprocess_job_process_and_reaping(tmp_path: Path) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    col = WorkerCollector([HardwareCollector("w1", "none", "h1", FakeNvml(ok=False))], str(mp))
    pid1 = _child(mp, "ftjob-a", 3, finish=False)  # exits without job_finished, like a SIGKILLed runner
    s = _samples(col)
    cur = {
        "worker": "w1",
        "hostname": "h1",
        "gpu": "0",
        "job_id": "ftjob-a",
        "base_model": "tiny",
        "mode": "zenflow",
    }
    assert _get(s, "zenflow_worker_current_job", cur) == 1
    assert _get(s, "zenflow_tokens_total", L) == 300
    assert _get(s, "zenflow_train_loss", L) == 1.5
    assert _get(s, "zenflow_step_seconds_count", L) == 3
    metrics_server.job_process_exited(pid1, str(mp))
    s = _samples(col)
    assert _get(s, "zenflow_worker_current_job", cur) is None  # live gauges of the dead pid are gone
    assert _get(s, "zenflow_train_loss", L) is None
    assert _get(s, "zenflow_tokens_total", L) == 300  # totals survive, folded into the archive
    assert not list(mp.glob(f"*_{pid1}.db"))
    pid2 = _child(mp, "ftjob-b", 2, finish=True)
    metrics_server.job_process_exited(pid2, str(mp))
    s = _samples(col)
    assert _get(s, "zenflow_tokens_total", L) == 500
    assert _get(s, "zenflow_step_seconds_count", L) == 5
    assert _get(s, "zenflow_step_seconds_bucket", {**L, "le": "0.5"}) == 5
    assert (
        _get(
            s,
            "zenflow_worker_jobs_total",
            {"worker": "w1", "hostname": "h1", "gpu": "0", "status": "succeeded"},
        )
        == 1
    )
    assert sorted(p.name for p in mp.glob("*.db")) == ["counter_archive.db", "histogram_archive.db"]


def test_serve_worker_metrics_http(tmp_path: Path, monkeypatch) -> None:
    from trainer.run.launch import free_port

    port = free_port()
    mp = tmp_path / "mp"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp))
    monkeypatch.setattr(metrics_server, "_SERVER", None)
    mp.mkdir()
    (mp / "counter_99999.db").write_bytes(b"")  # a previous run's file is wiped at start
    srv = metrics_server.serve_worker_metrics(
        port, addr="127.0.0.1", worker="w1", gpu="none", nvml=FakeNvml(ok=False)
    )
    try:
        assert srv is not None and metrics_server.serve_worker_metrics(port) is srv
        assert not (mp / "counter_99999.db").exists()
        _child(mp, "ftjob-c", 1, finish=True)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(body)}
        assert "zenflow_worker_info" in fams
        assert fams["zenflow_tokens"].samples[0].value == 100
        names = [line.split()[2] for line in body.splitlines() if line.startswith("# TYPE")]
        assert len(names) == len(set(names)), "one family per metric name"
    finally:
        srv.close()
    assert metrics_server.serve_worker_metrics(0) is None


def test_on_event_from_trainer_events(tel) -> None:
    from trainer.events import LogEvent, RunStarted, StepEvent

    t, reg = tel
    t.job_started("ftjob-e", base_model="tiny", mode="zenflow")
    t.on_event(
        RunStarted(
            total_steps=2,
            start_step=0,
            hyperparameters={},
            device="cpu",
            dtype="float32",
            mode="offload",
            num_parameters=1,
            trainable_parameters=1,
            num_examples=1,
            num_validation_examples=0,
        )
    )
    ev = StepEvent(
        step=1,
        total_steps=2,
        epoch=0,
        loss=3.0,
        lr=1e-3,
        tokens=64,
        tokens_per_second=128.0,
        step_seconds=0.5,
        stall_seconds=0.1,
        stall_fraction=0.2,
        engine=_step(1),
    )
    t.on_event(ev)
    t.on_event(LogEvent(message="hello"))
    t.on_event(
        StepEvent(
            step=2,
            total_steps=2,
            epoch=0,
            loss=2.0,
            lr=1e-3,
            tokens=64,
            tokens_per_second=1.0,
            step_seconds=0.25,
            stall_seconds=0.0,
            stall_fraction=0.0,
            engine=_step(
                2,
                wall_seconds=0.25,
                compute_seconds=0.25,
                stall_seconds=0.0,
                cpu_optimizer_seconds=0.0,
                bytes_device_to_host=0,
                bytes_host_to_device=0,
                device_optimizer_state_bytes=0,
            ),
            rank_tokens=24,  # a rank of a multi-GPU job counts its own share of the step's 64 tokens
        )
    )
    lo = {**L, "mode": "offload"}
    assert reg.get_sample_value("zenflow_tokens_total", lo) == 64 + 24
    assert reg.get_sample_value("zenflow_step_seconds_sum", lo) == pytest.approx(0.75)
    assert (
        reg.get_sample_value("zenflow_offload_transfer_bytes_total", {**lo, "direction": "device_to_host"})
        == 1000
    )
    assert reg.get_sample_value("zenflow_train_loss", lo) == 2.0
    cur = {"worker": "w1", "hostname": "h1", "gpu": "0", "job_id": "ftjob-e", "base_model": "tiny"}
    assert reg.get_sample_value("zenflow_worker_current_job", {**cur, "mode": "offload"}) == 1
    assert reg.get_sample_value("zenflow_worker_current_job", {**cur, "mode": "zenflow"}) is None
    t.on_event(object())  # never raises


def test_dpo_step_and_validation_gauges(tel) -> None:
    from trainer.events import EvalEvent, PreferenceMetrics, StepEvent

    t, reg = tel
    t.job_started("ftjob-d", base_model="tiny", mode="zenflow")
    pref = PreferenceMetrics(chosen_reward=0.5, rejected_reward=-0.25, reward_margin=0.75, accuracy=0.875)
    t.on_event(
        StepEvent(
            step=1,
            total_steps=2,
            epoch=0,
            loss=0.4,
            lr=1e-3,
            tokens=64,
            tokens_per_second=1.0,
            step_seconds=0.5,
            stall_seconds=0.1,
            stall_fraction=0.2,
            engine=_step(1),
            preference=pref,
        )
    )
    t.on_event(
        EvalEvent(step=1, valid_loss=0.5, valid_tokens=10, preference=dataclasses.replace(pref, accuracy=0.5))
    )
    assert reg.get_sample_value("zenflow_dpo_reward_margin", L) == 0.75
    assert reg.get_sample_value("zenflow_dpo_chosen_reward", L) == 0.5
    assert reg.get_sample_value("zenflow_dpo_rejected_reward", L) == -0.25
    assert reg.get_sample_value("zenflow_dpo_preference_accuracy_ratio", L) == 0.875
    assert reg.get_sample_value("zenflow_dpo_valid_preference_accuracy_ratio", L) == 0.5
    t.job_finished("succeeded")  # the job's series go with it
    assert reg.get_sample_value("zenflow_dpo_reward_margin", L) is None


def test_rft_step_and_validation_metrics(tel) -> None:
    """A reinforcement step's rewards and lengths are gauges, its grader errors and sampling and grading
    times counters; the evaluation's mean reward a gauge; labels are the bounded step labels only."""
    from tests.trainer.rewards import reward_eval, reward_step

    t, reg = tel
    t.job_started("ftjob-r", base_model="tiny", mode="zenflow")
    t.on_event(reward_step())
    t.on_event(reward_step(step=21))
    t.on_event(reward_eval())
    assert reg.get_sample_value("zenflow_rft_reward_mean", L) == 0.41
    assert reg.get_sample_value("zenflow_rft_reward_min", L) == 0.0
    assert reg.get_sample_value("zenflow_rft_reward_max", L) == 1.0
    assert reg.get_sample_value("zenflow_rft_completion_tokens_mean", L) == 12.5
    assert reg.get_sample_value("zenflow_rft_valid_reward_mean", L) == 0.44
    assert reg.get_sample_value("zenflow_rft_grader_errors_total", L) == 4
    assert reg.get_sample_value("zenflow_rft_generation_seconds_total", L) == 3.0
    assert reg.get_sample_value("zenflow_rft_grading_seconds_total", L) == 0.5
    labels = {
        k for m in reg.collect() if m.name.startswith("zenflow_rft") for s in m.samples for k in s.labels
    }
    assert labels == set(L)
    t.job_finished("succeeded")  # the gauges go with the job, the totals stay
    assert reg.get_sample_value("zenflow_rft_reward_mean", L) is None
    assert reg.get_sample_value("zenflow_rft_grader_errors_total", L) == 4
