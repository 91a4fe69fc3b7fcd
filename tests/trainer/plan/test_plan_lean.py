"""The plan counts lean host moments (``engine.host_moments: bf16``, issue 36 item 2): 8 instead of 12
host bytes of optimizer state per offloaded parameter, and 20 instead of 28 bytes of CPU AdamW traffic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from contract.engine import EngineRequest
from tests.trainer.plan.test_plan import LLAMA3_8B, _model_dir, _spec
from trainer.plan.gpus import GiB, Machine
from trainer.plan.speed import ADAM_BYTES_PER_PARAM, adam_bytes_per_param
from trainer.resolve import Counts, plan_spec, resolve
from trainer.spec import JobSpec


def test_adam_bytes_per_param() -> None:
    assert adam_bytes_per_param("fp32") == ADAM_BYTES_PER_PARAM == 28
    assert adam_bytes_per_param("bf16") == 20


def test_llama3_8b_lean_moments_take_8_bytes_of_host_state_per_split_param(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    hp = {"batch_size": 8, "max_seq_length": 2048}
    box = Machine.for_gpu("h200", host_memory_bytes=128 * GiB)
    fp32 = plan_spec(_spec(d, hyperparameters=hp, engine={"mode": "zenflow"}), box, num_examples=1000)
    lean = plan_spec(
        _spec(d, hyperparameters=hp, engine={"mode": "zenflow", "host_moments": "bf16"}),
        box,
        num_examples=1000,
    )
    split = lean.params - 65 * 4096  # every 2-D weight is split; the norms stay on the device
    assert fp32.host["engine_state"] == 12 * split and lean.host["engine_state"] == 8 * split
    assert fp32.host_bytes - lean.host_bytes == 4 * split
    # fewer bytes for the CPU AdamW: the CPU part of zenflow's step is shorter
    assert lean.modes["zenflow"].step_seconds <= fp32.modes["zenflow"].step_seconds


def test_a_jobs_host_moments_are_resolved_with_their_source() -> None:
    machine = Machine.for_cpu(host_memory_bytes=16 * GiB, cores=2)
    asked = JobSpec(model="tiny-llama", training_file="t.jsonl", engine={"host_moments": "bf16"})
    job = resolve(asked, machine, Counts(100), at="create", reason="t")[0].job
    assert job.engine.host_moments == "bf16" and job.sources["engine.host_moments"] == "request"
    plain = resolve(
        JobSpec(model="tiny-llama", training_file="t.jsonl"), machine, Counts(100), at="create", reason="t"
    )
    assert (
        plain[0].job.engine.host_moments == "fp32"
        and plain[0].job.sources["engine.host_moments"] == "default"
    )
    with pytest.raises(ValidationError, match="host_moments"):
        EngineRequest(host_moments="fp16")  # type: ignore[arg-type]


def test_the_plan_offers_lean_moments_then_the_device_accumulator_for_llama3_8b(tmp_path: Path) -> None:
    """Llama-3-8B full fine-tune in zenflow mode on an h200 with 128 GiB of host memory: with fp32 moments
    it does not fit the host, and the plan offers ``engine.host_moments bf16`` among the changes that fit;
    with them it fits, and the plan says the device accumulator would fit and run faster; with both, it
    fits within 1.1x device mode's predicted step (which does not fit the device) and 12 host bytes per
    parameter."""
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    hp = {"batch_size": 8, "max_seq_length": 2048}
    box = Machine.for_gpu("h200", host_memory_bytes=128 * GiB)

    def plan(**engine: str) -> Any:
        return plan_spec(
            _spec(d, hyperparameters=hp, engine={"mode": "zenflow", **engine}), box, num_examples=1000
        )

    fp32 = plan()
    assert (
        not fp32.fits
        and "set engine.host_moments bf16 (planned: fits in zenflow mode" in fp32.problems[0].message
    )
    lean = plan(host_moments="bf16")
    assert lean.fits and any("engine.accumulate_on device would fit and run" in r for r in lean.reasons)
    both = plan(host_moments="bf16", accumulate_on="device")
    assert both.fits and not both.modes["device"].fits
    assert both.modes["zenflow"].step_seconds <= 1.1 * both.modes["device"].step_seconds
    assert both.host_bytes <= 12 * both.params  # issue 36: the whole host, checkpoint streamed
    print(
        f"zenflow bf16 moments, device accumulator: {both.modes['zenflow'].step_seconds:.2f} s/step, device "
        f"{both.modes['device'].step_seconds:.2f}; host {both.host_bytes / GiB:.1f} GiB "
        f"({both.host_bytes / both.params:.1f} B/param)"
    )
