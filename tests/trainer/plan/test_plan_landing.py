"""The plan and zenflow's landing buffers (``landing_buffers``, the plan's to choose): counted when kept,
kept where the job fits with them, dropped (and said) where only that makes it fit, the GPU's wait for
the upload then counted in the step time."""

from __future__ import annotations

from pathlib import Path

from trainer.plan.candidates import DEVICE_MARGIN
from trainer.plan.gpus import Machine
from trainer.plan.planner import plan_job
from trainer.resolve import Counts, plan_query, plan_spec

from .test_plan_box import HP, _spec, models  # noqa: F401  (models: the fixture)


def test_landing_buffers_are_kept_where_they_fit_and_dropped_where_only_that_fits(
    models: dict[str, Path],  # noqa: F811
) -> None:
    big = Machine.for_gpu("h200")
    spec = _spec(models["3b"], hyperparameters=HP, engine={"mode": "zenflow", "accumulate_on": "host"})
    query = plan_query(spec, Counts(1000))
    on = plan_job(query, big)
    off = plan_job(query._replace(landing_buffers=False), big)
    assert on.fits and on.settings.landing_buffers and not off.settings.landing_buffers
    saved = on.modes["zenflow"].device_bytes - off.modes["zenflow"].device_bytes
    assert saved == on.device["landing_buffers"] > 0 and on.host_bytes == off.host_bytes
    assert off.step_seconds > on.step_seconds  # the merge waits for the upload without them
    # a GPU whose usable memory lies between the two: the plan drops them, and says why
    between = (on.modes["zenflow"].device_bytes + off.modes["zenflow"].device_bytes) // 2
    small = Machine.for_gpu("h200", gpu_memory_bytes=int(between / (1 - DEVICE_MARGIN)) + 1)
    tight = plan_spec(spec, small, num_examples=1000)
    assert tight.fits and not tight.settings.landing_buffers
    assert any("landing buffers dropped" in r for r in tight.reasons)
    # asked to keep them (a query that fixes them), it does not fit, and the problem says so
    kept = plan_job(plan_query(spec, Counts(1000))._replace(landing_buffers=True), small, advise=False)
    assert not kept.fits and "landing_buffers" in kept.problems[0].message
