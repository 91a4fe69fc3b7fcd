"""The plan and zenflow's landing buffers (``engine.landing_buffers``): counted when kept, offered as
the fix when they are what keeps a job off the device."""

from __future__ import annotations

from pathlib import Path

from trainer.plan.candidates import DEVICE_MARGIN
from trainer.plan.gpus import Machine
from trainer.plan.planner import plan_job

from .test_plan_box import HP, _spec, models  # noqa: F401  (models: the fixture)


def test_landing_buffers_off_is_counted_and_offered_when_they_do_not_fit(models: dict[str, Path]) -> None:  # noqa: F811
    big = Machine.for_gpu("h200")
    engine = {"mode": "zenflow", "accumulate_on": "host"}
    on = plan_job(_spec(models["3b"], hyperparameters=HP, engine=engine), big, num_examples=1000)
    off = plan_job(
        _spec(models["3b"], hyperparameters=HP, engine={**engine, "landing_buffers": False}),
        big,
        num_examples=1000,
    )
    saved = on.modes["zenflow"].device_bytes - off.modes["zenflow"].device_bytes
    assert saved > 0 and on.modes["zenflow"].host_bytes == off.modes["zenflow"].host_bytes
    # a GPU whose usable memory lies between the two: only the job without landing buffers fits
    between = (on.modes["zenflow"].device_bytes + off.modes["zenflow"].device_bytes) // 2
    small = Machine.for_gpu("h200", gpu_memory_bytes=int(between / (1 - DEVICE_MARGIN)) + 1)
    tight = plan_job(_spec(models["3b"], hyperparameters=HP, engine=engine), small, num_examples=1000)
    assert not tight.fits
    assert "set engine.landing_buffers false (planned: fits" in tight.problems[0].message, tight.problems
    fixed = plan_job(
        _spec(models["3b"], hyperparameters=HP, engine={**engine, "landing_buffers": False}),
        small,
        num_examples=1000,
    )
    assert fixed.fits
