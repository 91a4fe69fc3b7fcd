"""The engine's skipped steps as a training job sees them: a warning event, the counter, and the run goes on."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

import trainer.method.supervised
import trainer.run.loop as loop
from offload.step_metrics import StepMetrics
from trainer.events import Event, LogEvent, StepEvent
from trainer.spec import JobSpec
from worker.metrics.telemetry import WorkerTelemetry

pytestmark = pytest.mark.usefixtures("torch_single_thread")


class _InfGrad(torch.autograd.Function):
    """Identity forward; an infinite gradient backward (a finite loss whose gradients overflow)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * float("inf")


def _spec(out: Path, n: int = 32, *, seed: int = 0, **hp_extra: Any) -> JobSpec:
    """A zenflow job on ``n`` addition examples (data drawn with ``seed``); ``hp_extra``: more
    hyperparameters (e.g. ``micro_batch_size``)."""
    rng = random.Random(seed)
    data = out / "train.jsonl"
    with data.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n")
    hp = {
        "n_epochs": 1,
        "batch_size": 4,
        "max_seq_length": 64,
        "checkpoint_every": 100,
        "seed": 3,
        **hp_extra,
    }
    return JobSpec.model_validate(
        {
            "model": "tiny-llama",
            "training_file": str(data),
            "hyperparameters": hp,
            "output_dir": str(out / "run"),
            "device": "cpu",
            "engine": {"mode": "zenflow", "update_interval": 2},
        }
    )


def _poison_calls(monkeypatch: pytest.MonkeyPatch, bad: set[int]) -> None:
    real = trainer.method.supervised.loss_sum
    calls = {"n": 0}

    def loss_sum(model: Any, batch: Any) -> Any:
        ls, count = real(model, batch)
        calls["n"] += 1
        return (_InfGrad.apply(ls) if calls["n"] in bad else ls), count

    monkeypatch.setattr(trainer.method.supervised, "loss_sum", loss_sum)


def test_a_skipped_step_warns_and_the_run_finishes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _poison_calls(monkeypatch, {3, 4})
    events: list[Event] = []
    res = loop.run_training(_spec(tmp_path), on_event=events.append, progress=False)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert res.steps == 8 and len(steps) == 8
    assert [e.step for e in steps if e.engine.skipped] == [3, 4]
    warnings = [e for e in events if isinstance(e, LogEvent) and e.level == "warning"]
    assert [w.data["step"] for w in warnings] == [3, 4]
    assert "skipped" in warnings[0].message and warnings[0].data["grad_norm"] in ("inf", "nan")
    json.dumps([w.as_dict() for w in warnings], allow_nan=False)  # storable as event rows
    assert res.train_loss is not None and res.final_model_dir is not None


def test_a_run_that_only_skips_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "MAX_SKIPPED_IN_A_ROW", 3)
    _poison_calls(monkeypatch, set(range(2, 100)))
    with pytest.raises(FloatingPointError, match="for 3 steps in a row"):
        loop.run_training(_spec(tmp_path), progress=False)


def test_skipped_steps_are_counted() -> None:
    reg = CollectorRegistry()
    tel = WorkerTelemetry("w1", 0, registry=reg, hostname="h1")
    base = {
        "wall_seconds": 0.5,
        "compute_seconds": 0.5,
        "stall_seconds": 0.0,
        "cpu_optimizer_seconds": 0.0,
        "bytes_device_to_host": 0,
        "bytes_host_to_device": 0,
        "device_optimizer_state_bytes": 0,
    }
    for step, skipped in [(1, False), (2, True), (3, True), (4, False)]:
        tel.observe_step(
            StepMetrics(step=step, skipped=skipped, **base),
            tokens=1,
            loss=1.0,
            base_model="tiny-llama",
            mode="zenflow",
        )
    labels = {"worker": "w1", "hostname": "h1", "gpu": "0", "base_model": "tiny-llama", "mode": "zenflow"}
    assert reg.get_sample_value("zenflow_steps_skipped_total", labels) == 2.0


def test_a_run_leaves_the_process_threads_as_it_found_them(tmp_path: Path) -> None:
    """Core placement pins the process's threads and caps torch's thread count while the engine
    lives; after the run both are back."""
    import os

    mask = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = max(2, len(mask or ()))  # more than the training CPUs: the engine caps it while it runs
    outer = torch.get_num_threads()
    torch.set_num_threads(threads)
    events: list[Event] = []
    try:
        loop.run_training(_spec(tmp_path, n=8), on_event=events.append, progress=False)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(outer)
    if mask is not None:
        assert os.sched_getaffinity(0) == mask
    placed = [e for e in events if isinstance(e, LogEvent) and "placement" in e.message]
    assert len(placed) == 1 and set(placed[0].data) >= {"placed", "training_cpus", "optimizer_cpus", "note"}
