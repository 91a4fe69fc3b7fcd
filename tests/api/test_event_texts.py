"""Texts a user reads (issue 27 item 5): a queued job's planned step count, upload errors said once,
the engine's host memory when it holds none, the queue event on a CPU box."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from api.core.errors import APIError
from api.jobs import checks
from api.jobs.views import job_hyperparameters, planned_total_steps, queued_message
from trainer.resolve import Counts, resolve
from trainer.run.setup import engine_memory_text
from trainer.spec import JobSpec
from worker.capacity.measure import WorkerCapacity


def _job(total_steps: int | None, resolved: bool) -> tuple[SimpleNamespace, dict[str, object]]:
    spec = JobSpec(
        model="tiny-llama", training_file="t.jsonl", hyperparameters={"n_epochs": 3, "batch_size": 8}
    )
    request = checks.job_request(spec, model="tiny-llama", training_file="file-1", validation_file=None)
    current = resolve(spec, None, Counts(400), at="create", reason="t")[0] if resolved else None
    return SimpleNamespace(total_steps=total_steps), job_hyperparameters(request, current)


def test_a_queued_job_shows_the_resolved_total_steps() -> None:
    assert planned_total_steps(*_job(None, True)) == 150
    assert planned_total_steps(*_job(192, True)) == 192  # the run's own count once it has started
    assert planned_total_steps(*_job(None, False)) is None


@pytest.mark.parametrize(
    "line",
    [
        '{"messages": "hello"}',
        '{"messages": {"role": "user"}}',
        '{"messages": ["x"]}',
        '{"prompt": "x"}',
    ],
)
def test_upload_errors_say_each_problem_once(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(APIError) as err:
        checks.validate_dataset(path)
    body = err.value.extra or {}
    (first,) = body["errors"]
    assert first["line"] == 1 and first["message"].startswith("line 1: ")
    problem = first["message"].split(": ")[-1]
    # a client showing message and detail (the console did: "message (detail)") no longer repeats it
    shown = f"{first['message']} ({first['detail']})" if first.get("detail") else first["message"]
    assert shown.count(problem) == 1, shown
    assert err.value.message.count(problem) == 1, err.value.message


def test_public_errors_keep_a_detail_that_adds_something() -> None:
    errors: list[dict[str, object]] = [
        {"line": 2, "field": "messages", "message": "line 2: messages: empty list", "detail": "empty list"},
        {"line": 3, "field": None, "message": "line 3: bad", "detail": "more context here"},
    ]
    assert checks.public_errors(errors) == [
        {"line": 2, "field": "messages", "message": "line 2: messages: empty list"},
        errors[1],
    ]


def test_engine_memory_text_when_the_host_holds_nothing() -> None:
    text = engine_memory_text(0, 124_736, 0)
    assert text == "Engine memory: host none, device state none"
    assert "0.00 GiB" not in text and "B/param" not in text
    small = engine_memory_text(2_482_000, 124_736, 0)
    assert small == "Engine memory: host 2.4 MiB (19.9 B/param), device state none"
    big = engine_memory_text(3 * 2**30, 2**28, 2**30)
    assert big == "Engine memory: host 3.0 GiB (12.0 B/param), device state 1.0 GiB"


def _cap(device: str) -> WorkerCapacity:
    if device == "cpu":
        return WorkerCapacity(device_type="cpu", host_memory_bytes=2**34, cores=2)
    return WorkerCapacity(
        device_type="cuda",
        gpu_name="NVIDIA H100",
        gpu_memory_bytes=80 * 2**30,
        host_memory_bytes=2**37,
        cores=16,
    )


def test_the_queue_event_on_a_cpu_box_says_it_trains_on_the_cpu() -> None:
    on_cpu = queued_message("gpu-default", [_cap("cpu")])
    assert on_cpu.startswith("Job queued on gpu-default") and "no GPU" in on_cpu and "CPU" in on_cpu
    assert queued_message("gpu-default", [_cap("cuda")]) == "Job queued on gpu-default"
    assert queued_message("gpu-default", [_cap("cuda"), _cap("cpu")]) == "Job queued on gpu-default"
    assert queued_message("gpu-default", []) == "Job queued on gpu-default"
