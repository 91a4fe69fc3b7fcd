"""The plan inside a run: planned on the machine the job runs on, recorded in the job's events, and
its choices handed to the hyperparameters' and the engine's ``auto`` values.

A plan that cannot be made (a config the plan cannot read) is a warning, not a failure: the run
goes on with the defaults (``trainer.runtime``'s, and zenflow / host accumulation for the engine).
A plan that does not fit is a warning here too; refusing such a job is admission's (the API and the
worker check it before the run starts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from offload.config import EngineMode
from trainer.events import Event, LogEvent
from trainer.plan.gpus import Machine
from trainer.plan.planner import Plan, plan_job
from trainer.runtime import RuntimeChoices
from trainer.spec import JobSpec


def plan_for_run(
    spec: JobSpec,
    device_type: str,
    *,
    num_examples: int,
    num_tokens: int | None,
    emit: Callable[[Event], None],
) -> Plan | None:
    """Plan ``spec`` on this process's machine (``device_type``: the run's torch device type) and emit it (``data["plan"]``: :meth:`Plan.as_dict`)."""
    try:
        machine = Machine.detect("cuda" if device_type == "cuda" else "cpu")
        plan = plan_job(spec, machine, num_examples=num_examples, num_tokens=num_tokens)
    except Exception as exc:  # the plan advises a run: a model it cannot build must not stop the run
        emit(
            LogEvent(
                f"No memory and speed plan ({type(exc).__name__}: {exc}); auto settings take their defaults",
                level="warning",
            )
        )
        return None
    text = plan.summary() + "".join(f". {r}" for r in plan.reasons)
    if not plan.fits:
        text += "".join(f". {'.'.join(p.loc)}: {p.message}" for p in plan.problems)
    emit(LogEvent(text, level="info" if plan.fits else "warning", data={"plan": plan.as_dict()}))
    return plan


def planned_runtime(plan: Plan | None) -> RuntimeChoices | None:
    """The plan's micro-batch, checkpointing and packing for the hyperparameters' ``auto`` values."""
    if plan is None:
        return None
    s = plan.settings
    return RuntimeChoices(
        micro_batch_size=s.micro_batch_size,
        gradient_checkpointing=s.gradient_checkpointing,
        packing=s.packing,
    )


def engine_choices(plan: Plan | None, resumed: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments of :meth:`trainer.spec.EngineSettings.engine_config` for its ``auto`` values:
    the plan's mode and accumulator; a resumed run keeps its checkpoint's mode, and its accumulator when
    the checkpoint holds a window's gradients (``resumed``: the engine's ``state_dict()``), whatever this
    machine's plan says."""
    out: dict[str, Any] = {}
    if plan is not None:
        out = {"mode": plan.settings.mode, "accumulate_on": plan.settings.accumulate_on}
    if resumed is None:
        return out
    mode: EngineMode | None = resumed.get("mode")
    if mode is not None:
        out["mode"] = mode
    state = resumed.get("mode_state") or {}
    if state.get("device_acc"):
        out["accumulate_on"] = "device"
    elif any(h.get("acc_index") is not None for h in state.get("host") or []):
        out["accumulate_on"] = "host"
    return out
