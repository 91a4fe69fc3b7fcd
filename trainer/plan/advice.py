"""What the plan tells the user beside its numbers: why it chose each setting it was left to choose, a
faster accumulator when one fits, the problems of a job that does not fit (what does not fit, with the
numbers), the fixes (:func:`planned_fixes`: each single change is planned before it is offered, and
only those that fit are, in the order of what the user loses least -- more GPUs (their weights sharded
when replicas do not fit), LoRA, sharded weights, checkpointing and the other memory settings (a
micro-batch of 1, the accumulator, another engine mode), shorter sequences; or the plan says that no
single setting fits this box and why), whether the weights are sharded and why (:func:`shard_reasons`),
and the locked-memory note."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from contract.engine import ENGINE_MODES, Accumulator
from contract.lora import LoraSpec
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
from trainer.plan.query import PlanQuery
from trainer.plan.records import Plan, Problem


def setting_reasons(q: PlanQuery, c: Candidate) -> list[str]:
    """Why the settings the plan chose (the micro-batch and checkpointing, the accumulator, the window)."""
    s, out = c.settings, []
    if q.micro_batch_size is None or q.gradient_checkpointing is None:
        how = "the fastest that fits" if c.fits_device else "the least device memory"
        out.append(
            f"micro_batch_size {s.micro_batch_size}, gradient_checkpointing "
            f"{'on' if s.gradient_checkpointing else 'off'}: {how} "
            f"(activations {format_bytes(c.activations.peak_bytes)} at the peak)"
        )
    if s.mode == "zenflow" and q.accumulate_on is None:
        out.append(f"engine.accumulate_on auto -> {s.accumulate_on}")
    if s.mode == "zenflow" and not s.landing_buffers and q.landing_buffers is None:
        out.append("zenflow's landing buffers dropped: the job fits only without them")
    if s.mode == "zenflow" and s.update_interval == "adaptive" and c.time.update_interval:
        out.append(
            f"engine.update_interval adaptive: the engine sizes its windows; the step time assumes "
            f"{c.time.update_interval} steps (the shortest that hides the CPU work)"
        )
    return out


def shard_reasons(q: PlanQuery, job: JobShape, replicated: Candidate, chosen: Candidate) -> list[str]:
    """Why the weights are (not) sharded: ``replicated`` is the best candidate with whole replicas."""
    if job.ranks == 1 and not job.shard:
        return []
    head = (
        f"engine.shard_params auto -> {str(job.shard).lower()}"
        if q.shard_params is None
        else f"engine.shard_params {str(q.shard_params).lower()}"
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
    kept); ``c`` is the chosen candidate (zenflow, or the mode the plan fell back to)."""
    other: Accumulator = "device" if job.query.accumulate_on == "host" else "host"
    alt = best([candidate(job, "zenflow", mb, ckpt, other) for mb, ckpt, _ in options(job, "zenflow")])
    if not alt.fits or alt.time.step_seconds > 0.9 * c.time.step_seconds:
        return []
    what = "" if c.settings.mode == "zenflow" else f" in zenflow mode (vs {c.settings.mode})"
    return [
        f"engine.accumulate_on {other} would fit and run {c.time.step_seconds / alt.time.step_seconds:.1f}x "
        f"faster here{what} ({alt.time.step_seconds:.3g} s/step; set it, or auto)"
    ]


def _parts(components: dict[str, int]) -> str:
    return ", ".join(
        f"{k} {format_bytes(v)}" for k, v in sorted(components.items(), key=lambda kv: -kv[1]) if v
    )


def _device_loc(q: PlanQuery, c: Candidate, m: Machine, offload_fits: bool) -> tuple[str, ...]:
    """The job's own setting that most likely keeps it off the device."""
    if q.micro_batch_size is not None and c.settings.micro_batch_size > 1:
        return ("hyperparameters", "micro_batch_size")
    if q.gradient_checkpointing is False:
        return ("hyperparameters", "gradient_checkpointing")
    if q.mode is not None and m.device_type == "cuda" and (q.mode == "device" or offload_fits):
        return ("engine", "mode")
    if q.lora is None:
        return ("hyperparameters", "lora")
    return ("model",)


def _host_loc(job: JobShape, c: Candidate) -> tuple[str, ...]:
    """The job's own setting that most likely overfills the host: the host accumulator only when
    accumulating on the device would bring the host within its memory (the accumulators are rarely
    what fills it: a full fine-tune's optimizer state is), LoRA only for a job without it."""
    q, s = job.query, c.settings
    if s.mode == "zenflow" and q.accumulate_on == "host":
        on_device = candidate(job, "zenflow", s.micro_batch_size, s.gradient_checkpointing, "device")
        if on_device.fits_host:
            return ("engine", "accumulate_on")
    if q.mode in ("offload", "zenflow"):
        return ("engine", "mode")
    if q.lora is None:
        return ("hyperparameters", "lora")
    return ("model",)


def problems(job: JobShape, c: Candidate, *, offload_fits: bool) -> list[Problem]:
    """What does not fit, with the numbers; the field is the job's own setting that most likely
    causes it (:func:`with_fixes` replaces it by the first planned fix that fits)."""
    q, m = job.query, job.machine
    out: list[Problem] = []
    if not c.fits_device:
        where = "device" if m.device_type == "cuda" else "host"
        reserve = (
            f" (after a {format_bytes(m.gpu_memory_bytes - device_capacity(m))} reserve)"
            if m.device_type == "cuda"
            else ""
        )
        need, have = format_bytes(c.device_total), format_bytes(device_capacity(m))
        out.append(
            Problem(
                _device_loc(q, c, m, offload_fits),
                f"needs {need} of {where} memory ({_parts(c.device)}), the {m.gpu_name} has {have} usable{reserve}",
            )
        )
    if not c.fits_host and m.device_type == "cuda":
        out.append(
            Problem(
                _host_loc(job, c),
                f"needs {format_bytes(c.host_total)} of host memory ({_parts(c.host)}), the machine has "
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
    """One change to a job that does not fit: the field, the change in words, the changed query."""

    loc: tuple[str, ...]
    change: str
    query: PlanQuery


#: LoRA rank a fix proposes (peft's usual; the adapters' size hardly matters to the plan).
FIX_LORA_RANK = 16
#: Most ranks a fix proposes, and the shortest sequence.
FIX_MAX_GPUS = 8
FIX_MIN_SEQ = 256


def _more_gpus(q: PlanQuery) -> list[Fix]:
    gpus = [g for g in (2, 4, 8) if q.resources.gpus < g <= FIX_MAX_GPUS]
    return [
        Fix(
            ("resources", "gpus"),
            f"set resources.gpus {g}",
            q._replace(resources=q.resources.model_copy(update={"gpus": g})),
        )
        for g in gpus
    ]


def _memory_settings(q: PlanQuery) -> list[list[Fix]]:
    """One group each: sharded weights, checkpointing, a micro-batch of 1, the device accumulator, the
    CPU optimizer's bf16 moments (offload and zenflow keep them on the host; the mode the plan chooses
    decides whether they count)."""
    groups: list[list[Fix]] = []
    if q.shard_params is False and q.resources.world_size > 1:
        groups.append(
            [Fix(("engine", "shard_params"), "set engine.shard_params auto", q._replace(shard_params=None))]
        )
    if q.gradient_checkpointing is False:
        fix = q._replace(gradient_checkpointing=True)
        groups.append(
            [Fix(("hyperparameters", "gradient_checkpointing"), "set gradient_checkpointing true", fix)]
        )
    if q.micro_batch_size is not None and q.micro_batch_size > 1:
        fix = q._replace(micro_batch_size=1)
        groups.append([Fix(("hyperparameters", "micro_batch_size"), "set micro_batch_size 1", fix)])
    if q.accumulate_on == "host":
        fix = q._replace(accumulate_on="device")
        groups.append([Fix(("engine", "accumulate_on"), "set engine.accumulate_on device", fix)])
    if q.knobs.host_moments == "fp32" and q.mode != "device":
        fix = q._replace(knobs=q.knobs.model_copy(update={"host_moments": "bf16"}))
        groups.append([Fix(("engine", "host_moments"), "set engine.host_moments bf16", fix)])
    return groups


def _shorter_sequences(q: PlanQuery, seq: int) -> list[Fix]:
    seqs = []
    s = seq // 2
    while s >= FIX_MIN_SEQ:
        seqs.append(s)
        s //= 2
    return [
        Fix(("hyperparameters", "max_seq_length"), f"set max_seq_length {s}", q._replace(max_seq_length=s))
        for s in seqs
    ]


def fix_groups(q: PlanQuery, seq: int) -> list[list[Fix]]:
    """Single changes that may make ``q`` fit, in the order they are offered (what the user loses least
    first: more GPUs, LoRA, sharded weights, checkpointing and the other memory settings, another mode,
    shorter sequences); within a group the first that fits is enough (more GPUs, shorter sequences:
    the least change)."""
    groups = [_more_gpus(q)]
    if q.lora is None:
        lora = q._replace(lora=LoraSpec(r=FIX_LORA_RANK))
        groups.append(
            [
                Fix(
                    ("hyperparameters", "lora"),
                    f"use LoRA (hyperparameters.lora: {{r: {FIX_LORA_RANK}}})",
                    lora,
                )
            ]
        )
    groups += _memory_settings(q)
    if q.mode is not None:
        groups += [
            [Fix(("engine", "mode"), f"set engine.mode {m}", q._replace(mode=m))]
            for m in ENGINE_MODES
            if m != q.mode
        ]
    groups.append(_shorter_sequences(q, seq))
    return [g for g in groups if g]


def planned_fixes(
    q: PlanQuery, seq: int, replan: Callable[[PlanQuery], Plan]
) -> tuple[list[tuple[Fix, Plan]], list[str]]:
    """Each fix of :func:`fix_groups` planned with ``replan``: those that fit (with their plans) and,
    for the groups where none did, why not (one line each)."""
    fitting: list[tuple[Fix, Plan]] = []
    failed: list[str] = []
    for group in fix_groups(q, seq):
        last: tuple[Fix, Plan] | None = None
        for fix in group:
            try:
                plan = replan(fix.query)
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
    else:  # the job's settings are not what to change (none of them alone fits): the model, or the box
        why = "; ".join(failed) if failed else "none to try"
        head = Problem(("model",), f"{first.message}; no single setting fits this box: {why}")
    # the others point where the first does: the fix that fits, or (none fits) the model, never a
    # setting no planned change of which is enough (a host shortfall labelled engine.accumulate_on)
    rest_loc = fitting[0][0].loc if fitting else ("model",)
    note = (
        "see the first problem for what fits" if fitting else "no single setting fits: see the first problem"
    )
    return [head, *(Problem(rest_loc, f"{p.message} ({note})") for p in rest)]
