"""What the plan tells the user beside its numbers: why it chose each ``auto`` setting, a faster
accumulator when one fits, the problems of a job that does not fit (the field to change and the
numbers), and the locked-memory note."""

from __future__ import annotations

from trainer.plan.candidates import Candidate, JobShape, best, candidate, device_capacity, options
from trainer.plan.gpus import Machine, format_bytes
from trainer.plan.records import Accumulator, Problem
from trainer.spec import JobSpec


def setting_reasons(spec: JobSpec, c: Candidate) -> list[str]:
    s, out = c.settings, []
    if (
        spec.hyperparameters.micro_batch_size == "auto"
        or spec.hyperparameters.gradient_checkpointing == "auto"
    ):
        how = "the fastest that fits" if c.fits_device else "the least device memory"
        out.append(
            f"micro_batch_size {s.micro_batch_size}, gradient_checkpointing "
            f"{'on' if s.gradient_checkpointing else 'off'}: {how} "
            f"(activations {format_bytes(c.activations.peak_bytes)} at the peak)"
        )
    if s.mode == "zenflow" and spec.engine.accumulate_on == "auto":
        out.append(f"engine.accumulate_on auto -> {s.accumulate_on}")
    if s.mode == "zenflow" and s.update_interval == "auto" and c.time.update_interval:
        out.append(
            f"engine.update_interval auto: the engine sizes its windows; the step time assumes "
            f"{c.time.update_interval} steps (the shortest that hides the CPU work)"
        )
    return out


def accumulator_hint(job: JobShape, c: Candidate) -> list[str]:
    """A faster ``accumulate_on`` than the job's own, when one fits (the job's value is kept)."""
    other: Accumulator = "device" if c.settings.accumulate_on == "host" else "host"
    alt = best([candidate(job, "zenflow", mb, ckpt, other) for mb, ckpt, _ in options(job, "zenflow")])
    if not alt.fits or alt.time.step_seconds > 0.9 * c.time.step_seconds:
        return []
    return [
        f"engine.accumulate_on {other} would fit and run {c.time.step_seconds / alt.time.step_seconds:.1f}x "
        f"faster here ({alt.time.step_seconds:.3g} s/step; set it, or auto)"
    ]


def problems(job: JobShape, c: Candidate, *, offload_fits: bool) -> list[Problem]:
    spec, m = job.spec, job.machine
    out: list[Problem] = []
    loc: tuple[str, ...]
    if not c.fits_device:
        need, have = format_bytes(c.device_total), format_bytes(device_capacity(m))
        where = "device" if m.device_type == "cuda" else "host"
        parts = ", ".join(
            f"{k} {format_bytes(v)}" for k, v in sorted(c.device.items(), key=lambda kv: -kv[1]) if v
        )
        if isinstance(spec.hyperparameters.micro_batch_size, int) and c.settings.micro_batch_size > 1:
            loc, fix = ("hyperparameters", "micro_batch_size"), "set a smaller micro_batch_size"
        elif spec.hyperparameters.gradient_checkpointing is False:
            loc, fix = (
                ("hyperparameters", "gradient_checkpointing"),
                "set gradient_checkpointing true or auto",
            )
        elif spec.engine.mode == "device" and m.device_type == "cuda":
            loc, fix = ("engine", "mode"), "set engine.mode zenflow (optimizer state on the host)"
        elif c.settings.mode == "zenflow" and m.device_type == "cuda" and offload_fits:
            loc, fix = (
                ("engine", "mode"),
                (
                    "set engine.mode offload (zenflow's selected columns and landing "
                    "buffers do not fit beside the model; offload mode does)"
                ),
            )
        elif isinstance(spec.hyperparameters.max_seq_length, int):
            loc, fix = (
                ("hyperparameters", "max_seq_length"),
                "set a shorter max_seq_length or a smaller model",
            )
        else:
            loc, fix = ("model",), "use LoRA or a smaller model"
        out.append(
            Problem(
                loc, f"needs {need} of {where} memory ({parts}), the {m.gpu_name} has {have} usable; {fix}"
            )
        )
    if not c.fits_host and m.device_type == "cuda":
        parts = ", ".join(
            f"{k} {format_bytes(v)}" for k, v in sorted(c.host.items(), key=lambda kv: -kv[1]) if v
        )
        if c.settings.mode == "zenflow" and spec.engine.accumulate_on == "host":
            loc, fix = ("engine", "accumulate_on"), "set engine.accumulate_on device or a smaller model"
        elif spec.engine.mode in ("offload", "zenflow"):
            loc, fix = ("engine", "mode"), "set engine.mode auto or a smaller model"
        else:
            loc, fix = ("model",), "use LoRA or a smaller model"
        out.append(
            Problem(
                loc,
                f"needs {format_bytes(c.host_total)} of host memory ({parts}), the machine has "
                f"{format_bytes(m.host_memory_bytes)}; {fix}",
            )
        )
    return out


def locked_memory_note(c: Candidate, m: Machine) -> str:
    pinned = sum(v for k, v in c.host.items() if k.startswith("engine"))
    return (
        f"note: the engine pins {format_bytes(pinned)} of host memory, over the worker's locked-memory limit "
        f"({format_bytes(m.locked_memory_bytes or 0)}); CUDA's pinned allocations do not count against it, "
        "but other page-locking (RDMA, mlock) on this host does: consider raising it (ulimit -l)"
    )
