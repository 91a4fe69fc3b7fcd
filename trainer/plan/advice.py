"""What the plan tells the user beside its numbers: why it chose each ``auto`` setting, a faster
accumulator when one fits, the problems of a job that does not fit (what does not fit, with the
numbers), the fixes (:func:`planned_fixes`: each single change is planned before it is offered, and
only those that fit are, in the order of what the user loses least -- more GPUs (their weights sharded
when replicas do not fit), LoRA, sharded weights, checkpointing and the other memory settings (a
micro-batch of 1, the accumulator, landing buffers, another engine mode), shorter sequences; or the plan
says that no single setting fits this box and why), whether the weights are sharded and why
(:func:`shard_reasons`), and the locked-memory note."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from trainer.method import LoraSpec
from trainer.plan.candidates import (
    Candidate,
    JobShape,
    best,
    candidate,
    device_capacity,
    host_capacity,
    host_reserve,
    options,
)
from trainer.plan.gpus import Machine, format_bytes
from trainer.plan.records import MODES, Accumulator, Plan, Problem
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


def shard_reasons(spec: JobSpec, job: JobShape, replicated: Candidate, chosen: Candidate) -> list[str]:
    """Why the weights are (not) sharded: ``replicated`` is the best candidate with whole replicas."""
    if job.ranks == 1 and not job.shard:
        return []
    setting = spec.engine.shard_params
    head = f"engine.shard_params {str(setting).lower()}" + (
        f" -> {str(job.shard).lower()}" if setting == "auto" else ""
    )
    cap = format_bytes(device_capacity(job.machine))
    if not job.shard:
        return [
            f"{head}: replicated weights fit ({format_bytes(replicated.device_total)} of {cap} per device)"
        ]
    t = chosen.time
    traffic = (
        f"FSDP's all-gathers and reduce-scatters take ~{t.interconnect_seconds:.3g} s per step over the "
        f"{job.machine.interconnect_gbps:g} GB/s GPU interconnect, overlapped with the compute"
    )
    if replicated.fits:
        return [f"{head}: as set; replicated weights would fit too; {traffic}"]
    return [
        f"{head}: replicated weights do not fit ({format_bytes(replicated.device_total)} of device memory "
        f"per rank, {cap} usable); sharded {format_bytes(chosen.device_total)}; {traffic}"
    ]


def accumulator_hint(job: JobShape, c: Candidate) -> list[str]:
    """A faster ``accumulate_on`` than the job's own, when zenflow with it fits (the job's value is
    kept); ``c`` is the chosen candidate (zenflow, or the mode ``auto`` fell back to)."""
    other: Accumulator = "device" if job.spec.engine.accumulate_on == "host" else "host"
    alt = best([candidate(job, "zenflow", mb, ckpt, other) for mb, ckpt, _ in options(job, "zenflow")])
    if not alt.fits or alt.time.step_seconds > 0.9 * c.time.step_seconds:
        return []
    what = "" if c.settings.mode == "zenflow" else f" in zenflow mode (vs {c.settings.mode})"
    return [
        f"engine.accumulate_on {other} would fit and run {c.time.step_seconds / alt.time.step_seconds:.1f}x "
        f"faster here{what} ({alt.time.step_seconds:.3g} s/step; set it, or auto)"
    ]


def problems(job: JobShape, c: Candidate, *, offload_fits: bool) -> list[Problem]:
    """What does not fit, with the numbers; the field is the job's own setting that most likely
    causes it (:func:`with_fixes` replaces it by the first planned fix that fits)."""
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
            loc = ("hyperparameters", "micro_batch_size")
        elif spec.hyperparameters.gradient_checkpointing is False:
            loc = ("hyperparameters", "gradient_checkpointing")
        elif (
            spec.engine.mode != "auto"
            and m.device_type == "cuda"
            and (spec.engine.mode == "device" or offload_fits)
        ):
            loc = ("engine", "mode")
        elif spec.lora is None:
            loc = ("hyperparameters", "lora")
        else:
            loc = ("model",)
        reserve = (
            f" (after a {format_bytes(m.gpu_memory_bytes - device_capacity(m))} reserve)"
            if m.device_type == "cuda"
            else ""
        )
        out.append(
            Problem(
                loc, f"needs {need} of {where} memory ({parts}), the {m.gpu_name} has {have} usable{reserve}"
            )
        )
    if not c.fits_host and m.device_type == "cuda":
        parts = ", ".join(
            f"{k} {format_bytes(v)}" for k, v in sorted(c.host.items(), key=lambda kv: -kv[1]) if v
        )
        if c.settings.mode == "zenflow" and spec.engine.accumulate_on == "host":
            loc = ("engine", "accumulate_on")
        elif spec.engine.mode in ("offload", "zenflow"):
            loc = ("engine", "mode")
        else:
            loc = ("hyperparameters", "lora")
        out.append(
            Problem(
                loc,
                f"needs {format_bytes(c.host_total)} of host memory ({parts}), the machine has "
                f"{format_bytes(m.host_memory_bytes)}, {format_bytes(host_capacity(m))} usable after a "
                f"{format_bytes(host_reserve(m))} reserve for the OS, driver and page cache",
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


class Fix(NamedTuple):
    """One change to a job that does not fit: the field, the change in words, the changed spec."""

    loc: tuple[str, ...]
    change: str
    spec: JobSpec


#: LoRA rank a fix proposes (peft's usual; the adapters' size hardly matters to the plan).
FIX_LORA_RANK = 16
#: Most ranks a fix proposes, and the shortest sequence.
FIX_MAX_GPUS = 8
FIX_MIN_SEQ = 256


def _hp(spec: JobSpec, **update: object) -> JobSpec:
    return spec.model_copy(update={"hyperparameters": spec.hyperparameters.model_copy(update=update)})


def _engine(spec: JobSpec, **update: object) -> JobSpec:
    return spec.model_copy(update={"engine": spec.engine.model_copy(update=update)})


def fix_groups(spec: JobSpec, seq: int) -> list[list[Fix]]:
    """Single changes that may make ``spec`` fit, in the order they are offered (what the user loses
    least first: more GPUs, LoRA, sharded weights, checkpointing and the other memory settings, shorter
    sequences); within a group the first that fits is enough (more GPUs, shorter sequences: the least
    change)."""
    hp, eng = spec.hyperparameters, spec.engine
    groups: list[list[Fix]] = []
    n = spec.resources.gpus
    gpus = [g for g in (2, 4, 8) if n < g <= FIX_MAX_GPUS]
    if gpus:
        groups.append(
            [
                Fix(
                    ("resources", "gpus"),
                    f"set resources.gpus {g}",
                    spec.model_copy(update={"resources": spec.resources.model_copy(update={"gpus": g})}),
                )
                for g in gpus
            ]
        )
    if spec.lora is None:
        groups.append(
            [
                Fix(
                    ("hyperparameters", "lora"),
                    f"use LoRA (hyperparameters.lora: {{r: {FIX_LORA_RANK}}})",
                    _hp(spec, lora=LoraSpec(r=FIX_LORA_RANK)),
                )
            ]
        )
    if eng.shard_params is False and n > 1:
        groups.append(
            [
                Fix(
                    ("engine", "shard_params"),
                    "set engine.shard_params auto",
                    _engine(spec, shard_params="auto"),
                )
            ]
        )
    if hp.gradient_checkpointing is False:
        groups.append(
            [
                Fix(
                    ("hyperparameters", "gradient_checkpointing"),
                    "set gradient_checkpointing true",
                    _hp(spec, gradient_checkpointing=True),
                )
            ]
        )
    if isinstance(hp.micro_batch_size, int) and hp.micro_batch_size > 1:
        groups.append(
            [
                Fix(
                    ("hyperparameters", "micro_batch_size"),
                    "set micro_batch_size 1",
                    _hp(spec, micro_batch_size=1),
                )
            ]
        )
    if eng.accumulate_on == "host":
        groups.append(
            [
                Fix(
                    ("engine", "accumulate_on"),
                    "set engine.accumulate_on device",
                    _engine(spec, accumulate_on="device"),
                )
            ]
        )
    optional = spec.resources.world_size == 1 or eng.shard_params is not False  # replicas need the replica
    if eng.landing_buffers and eng.mode in ("zenflow", "auto") and optional:
        # zenflow's device copy of the split weights (offload.config.EngineConfig.landing_buffers); with
        # sharded weights a copy of the rank's rows, planned (the fix is kept only if it makes the job fit)
        groups.append(
            [
                Fix(
                    ("engine", "landing_buffers"),
                    "set engine.landing_buffers false",
                    _engine(spec, landing_buffers=False),
                )
            ]
        )
    if eng.mode != "auto":
        groups += [
            [Fix(("engine", "mode"), f"set engine.mode {m}", _engine(spec, mode=m))]
            for m in MODES
            if m != eng.mode
        ]
    seqs = []
    s = seq // 2
    while s >= FIX_MIN_SEQ:
        seqs.append(s)
        s //= 2
    if seqs:
        groups.append(
            [
                Fix(
                    ("hyperparameters", "max_seq_length"),
                    f"set max_seq_length {s}",
                    _hp(spec, max_seq_length=s),
                )
                for s in seqs
            ]
        )
    return groups


def planned_fixes(
    spec: JobSpec, seq: int, replan: Callable[[JobSpec], Plan]
) -> tuple[list[tuple[Fix, Plan]], list[str]]:
    """Each fix of :func:`fix_groups` planned with ``replan``: those that fit (with their plans) and,
    for the groups where none did, why not (one line each)."""
    fitting: list[tuple[Fix, Plan]] = []
    failed: list[str] = []
    for group in fix_groups(spec, seq):
        last: tuple[Fix, Plan] | None = None
        for fix in group:
            try:
                plan = replan(fix.spec)
            except ValueError:
                continue
            last = (fix, plan)
            if plan.fits:
                fitting.append(last)
                break
        else:
            if last is not None:
                fix, plan = last
                failed.append(f"{fix.change}: {_shortfall(plan)}")
    return fitting, failed


def _shortfall(p: Plan) -> str:
    parts = []
    if p.device_bytes > p.device_capacity_bytes:
        parts.append(f"device {format_bytes(p.device_bytes)} of {format_bytes(p.device_capacity_bytes)}")
    if p.host_bytes > p.host_capacity_bytes:
        parts.append(f"host {format_bytes(p.host_bytes)} of {format_bytes(p.host_capacity_bytes)}")
    return "still needs " + (", ".join(parts) or "more memory")


def describe_fix(fix: Fix, p: Plan) -> str:
    return (
        f"{fix.change} (planned: fits in {p.settings.mode} mode, device {format_bytes(p.device_bytes)} of "
        f"{format_bytes(p.device_capacity_bytes)}, host {format_bytes(p.host_bytes)} of "
        f"{format_bytes(p.host_capacity_bytes)}, ~{p.step_seconds:.3g} s/step)"
    )


def with_fixes(problems: list[Problem], fitting: list[tuple[Fix, Plan]], failed: list[str]) -> list[Problem]:
    """``problems`` with what to change: the first problem names the first fix that fits as its field and
    lists every fix that fits, planned; when none does, it says so and why each was not enough."""
    if not problems:
        return problems
    first, rest = problems[0], problems[1:]
    if fitting:
        loc = fitting[0][0].loc
        text = "; ".join(describe_fix(f, p) for f, p in fitting)
        head = Problem(loc, f"{first.message}; fits with one change: {text}")
    else:
        why = "; ".join(failed) if failed else "none to try"
        head = Problem(first.loc, f"{first.message}; no single setting fits this box: {why}")
    rest_loc = fitting[0][0].loc if fitting else None
    return [
        head,
        *(Problem(rest_loc or p.loc, f"{p.message} (see the first problem for what fits)") for p in rest),
    ]
