"""The plan: before a job runs, whether it fits a machine, how fast it will run, and the settings
its ``auto`` values resolve to.

:func:`plan_job` reads the model's config alone (parameters counted on torch's meta device, no
weights loaded: :mod:`trainer.plan.shapes`), a :class:`~trainer.plan.query.PlanQuery` (the job's values
and the choices it leaves to the plan; :mod:`trainer.resolve` makes it from a job's request) and a
:class:`~trainer.plan.gpus.Machine`, and returns a :class:`Plan`:

- device bytes: weights, gradients, the engine's device optimizer state and transfer buffers
  (:mod:`trainer.plan.engine`), activations of one micro-batch (with or without checkpointing), and
  the CUDA runtime; host bytes: the engine's pinned state, one weight shard while loading, the
  tokenized data and the process itself;
- predicted step time and tokens/s per engine mode (:mod:`trainer.plan.speed`);
- for every choice left to it: the engine mode (the fastest that fits by the plan's prediction, device
  mode unless another is ``MODE_MIN_GAIN`` faster: :func:`pick_mode`), micro-batch size, activation
  checkpointing, ``accumulate_on``, sharded weights and zenflow's landing buffers, chosen among the
  candidates that fit to run fastest (ties: the least memory). ``update_interval: adaptive`` is the
  engine's own (windows end by gradient mass); the plan assumes the shortest window that hides the CPU
  work.

A job on N ranks (``resources``) is planned for one rank: ``batch_size / N`` examples per step (its
activations and micro-batches), a full model replica on its device, 1/N of the CPU optimizer state
(``SHARDED_HOST``, :mod:`trainer.plan.candidates`; the engine shards it across ranks), its own process and data; on a GPU machine
(already one GPU's share of its host) with that GPU's share, CPU ranks share one host
(:func:`rank_machine`). ``shard_params`` (true, or when left to the plan and the replicated plan does not fit)
plans sharded weights instead of replicas (:mod:`trainer.plan.shards`: 1/N of the weights, gradients and
optimizer state, FSDP's gather buffers, the collectives' traffic); :attr:`Plan.fits_only_sharded` says
when replicas would not fit.

The candidates and the constants they count with are :mod:`trainer.plan.candidates`, the reasons and
problems :mod:`trainer.plan.advice`, the returned records :mod:`trainer.plan.records`. Fitting keeps
``DEVICE_MARGIN`` (10%) of the device memory free for the allocator's fragmentation
and kernels' workspaces, and a host reserve (``HOST_RESERVE_*``: 5%, at least 2 GiB) for the OS, the
driver and the page cache; both are in the plan (``*_reserve_bytes``). A plan that does not fit lists
:attr:`Plan.problems`: what does not fit, the fixes that were planned and fit, and
the numbers.
"""

from __future__ import annotations

from trainer.plan.advice import (
    accumulator_hint,
    locked_memory_note,
    planned_fixes,
    problems,
    setting_reasons,
    shard_reasons,
    with_fixes,
)
from trainer.plan.candidates import (
    Candidate,
    JobShape,
    best,
    candidate,
    device_capacity,
    host_capacity,
    host_reserve,
    landing_optional,
    landings,
    options,
    rank_machine,
)
from trainer.plan.gpus import Machine, format_bytes
from trainer.plan.query import PlanQuery
from trainer.plan.records import ENGINE_MODES, EngineMode, ModeEstimate, Plan, PlanChoices, Problem
from trainer.plan.rollout import rollout_bytes
from trainer.plan.shapes import model_shape

__all__ = ["Machine", "Plan", "PlanChoices", "PlanQuery", "Problem", "plan_job"]


def plan_job(q: PlanQuery, machine: Machine, *, advise: bool = True) -> Plan:
    """The plan of ``q`` on ``machine`` (see the module doc). ``advise``: when the job does not fit, plan
    the single changes that could make it fit (:func:`trainer.plan.advice.planned_fixes`) and name those
    that do in its problems. Raises UnknownModelError or ValueError when the model's config cannot be
    built."""
    shape = model_shape(q.model, q.lora)
    dtype = q.dtype_on(machine.device_type)
    ranks = q.resources.world_size
    job = JobShape(
        q,
        rank_machine(machine, ranks),
        shape,
        2 if dtype == "bfloat16" else 4,
        -(-q.batch_size // ranks),
        q.max_seq_length,
        q.num_examples,
        q.num_tokens,
        ranks,
    )
    replicated = _choose(job)
    only_sharded = False
    if ranks > 1 and (q.shard_params is True or (q.shard_params is None and not replicated[2].fits)):
        sharded = _choose(job._replace(shard=True))
        only_sharded = sharded[2].fits and not replicated[2].fits
        job, (best_by_mode, why, chosen) = job._replace(shard=True), sharded
    else:
        best_by_mode, why, chosen = replicated
    problems_found = [] if chosen.fits else _problems(job, chosen, best_by_mode, machine, advise)
    return _plan(
        job, chosen, best_by_mode, _reasons(job, replicated[2], chosen, why), problems_found, only_sharded
    )


def _reasons(job: JobShape, replicated: Candidate, chosen: Candidate, why: str) -> list[str]:
    """Why the plan's settings: the ranks' shares, the sharding, the mode, the other choices, hints."""
    q, machine, ranks = job.query, job.machine, job.ranks
    reasons: list[str] = []
    if ranks > 1:
        what = "of the weights, gradients and optimizer state" if job.shard else "of the CPU optimizer state"
        reasons.append(
            f"resources.gpus {ranks}: per rank {job.batch} of the {q.batch_size} examples of a step and "
            f"1/{ranks} {what}; the figures are one rank's, host_bytes_all_ranks the host's"
        )
    reasons += shard_reasons(q, job, replicated, chosen)
    if why:
        reasons.append(why)
    reasons += setting_reasons(q, chosen)
    mode = chosen.settings.mode
    fallback = q.mode is None and mode == "offload"
    if (mode == "zenflow" or fallback) and q.accumulate_on is not None and machine.device_type == "cuda":
        reasons += accumulator_hint(job, chosen)
    if not chosen.fits_locked:
        reasons.append(locked_memory_note(chosen, machine))
    return reasons


def _plan(
    job: JobShape,
    chosen: Candidate,
    best_by_mode: dict[EngineMode, Candidate],
    reasons: list[str],
    found: list[Problem],
    only_sharded: bool,
) -> Plan:
    machine, shape, q = job.machine, job.shape, job.query
    host_bytes = chosen.host_total + (chosen.device_total if machine.device_type == "cpu" else 0)
    return Plan(
        fits=chosen.fits,
        model=q.model,
        machine=machine,
        params=shape.params,
        trainable_params=shape.trainable_params,
        dtype="bfloat16" if job.dtype_bytes == 2 else "float32",
        batch_size=q.batch_size,
        max_seq_length=job.seq,
        tokens_per_step=q.batch_size * job.seq,
        settings=chosen.settings,
        device_capacity_bytes=device_capacity(machine),
        host_capacity_bytes=host_capacity(machine),
        device_reserve_bytes=(machine.gpu_memory_bytes - device_capacity(machine))
        if machine.device_type == "cuda"
        else 0,
        host_reserve_bytes=host_reserve(machine),
        device_bytes=chosen.device_total,
        host_bytes=host_bytes,
        ranks=job.ranks,
        host_bytes_all_ranks=job.ranks * host_bytes,
        fits_only_sharded=only_sharded,
        device=chosen.device,
        host=chosen.host,
        activations={
            "saved": chosen.activations.saved_bytes,
            "recompute": chosen.activations.recompute_bytes,
            "transient": chosen.activations.transient_bytes,
        },
        step_seconds=chosen.time.step_seconds,
        tokens_per_second=chosen.time.tokens_per_second,
        generation_seconds=chosen.time.generation_seconds,
        rollout_cache_bytes=_rollout_cache(job),
        modes={k: _estimate(c) for k, c in best_by_mode.items()},
        reasons=reasons,
        problems=found,
    )


def _rollout_cache(job: JobShape) -> int:
    """A reinforcement job's sampling cache on one rank (0 for the other methods)."""
    r = job.query.rollout
    return (
        0
        if r is None
        else rollout_bytes(job.shape, job.batch * r.samples_per_prompt, job.seq, job.dtype_bytes)
    )


def _best(job: JobShape, mode: EngineMode) -> Candidate:
    """``mode``'s best candidate; zenflow's landing buffers dropped only when nothing fits with them and
    the plan may drop them."""
    kept = best(
        [candidate(job, mode, *o, landing) for o in options(job, mode) for landing in landings(job, mode)]
    )
    droppable = (
        mode == "zenflow"
        and job.query.landing_buffers is None
        and job.machine.device_type == "cuda"
        and landing_optional(job)
    )
    if kept.fits or not droppable:
        return kept
    dropped = best([candidate(job, mode, *o, False) for o in options(job, mode)])
    return dropped if dropped.fits else kept


def _choose(job: JobShape) -> tuple[dict[EngineMode, Candidate], str, Candidate]:
    """Each mode's best candidate for ``job``, why the mode (when the plan chooses it) and the chosen one."""
    by_mode = {mode: _best(job, mode) for mode in ENGINE_MODES}
    mode = job.query.mode
    why = ""
    if mode is None:
        mode, why = pick_mode(by_mode, job.machine)
    return by_mode, why, by_mode[mode]


def _problems(
    job: JobShape, chosen: Candidate, by_mode: dict[EngineMode, Candidate], box: Machine, advise: bool
) -> list[Problem]:
    found = problems(job, chosen, offload_fits=by_mode["offload"].fits)
    if not advise:
        return found

    def replan(q: PlanQuery) -> Plan:
        return plan_job(q, box, advise=False)

    fitting, failed = planned_fixes(job.query, job.seq, replan)
    return with_fixes(found, fitting, failed)


#: The plan takes an engine mode other than ``device`` only when it is predicted at least this much
#: faster: the step times are estimates (a few percent apart is no evidence), and device mode is exact
#: AdamW every step with no host state or windows to go wrong.
MODE_MIN_GAIN = 0.05


def pick_mode(best_by_mode: dict[EngineMode, Candidate], machine: Machine) -> tuple[EngineMode, str]:
    """The mode the plan chooses: the fastest that fits by its own prediction (device unless another is
    ``MODE_MIN_GAIN`` faster), and why; when none fits, the one closest to fitting."""
    times = ", ".join(
        f"{m} {c.time.step_seconds:.3g}{'' if c.fits else ' (does not fit)'}" for m, c in best_by_mode.items()
    )
    fitting = [m for m in ENGINE_MODES if best_by_mode[m].fits]
    if not fitting:
        mode: EngineMode = (
            "zenflow"
            if best_by_mode["zenflow"].fits_device or not best_by_mode["offload"].fits_device
            else "offload"
        )
        return (
            mode,
            f"engine.mode auto: no mode fits (predicted s/step: {times}); the figures shown are {mode} mode's, "
            "the closest to fitting, not a choice: the problems say what to change",
        )

    def key(m: EngineMode) -> float:
        t = best_by_mode[m].time.step_seconds
        return t if m == "device" else t / (1 - MODE_MIN_GAIN)

    mode = min(fitting, key=key)
    if mode == "device":
        note = "" if len(fitting) == 1 else f"; others count only when {MODE_MIN_GAIN:.0%} faster"
        return mode, f"engine.mode auto -> device: the fastest that fits (predicted s/step: {times}){note}"
    why, what = _why_not_device(best_by_mode, machine, mode)
    return (
        mode,
        f"engine.mode auto -> {mode}: the fastest that fits; {why} (predicted s/step: {times}); {what}",
    )


def _why_not_device(
    best_by_mode: dict[EngineMode, Candidate], machine: Machine, mode: EngineMode
) -> tuple[str, str]:
    """Why not device mode, and what ``mode`` does instead."""
    dev, zen = best_by_mode["device"], best_by_mode["zenflow"]
    why = (
        f"device mode needs {format_bytes(dev.device_total)} of device memory, {format_bytes(device_capacity(machine))} is usable"
        if not dev.fits
        else "it is predicted faster"
    )
    if mode == "zenflow":
        return why, "zenflow keeps the optimizer state of the split weights on the host"
    if not zen.fits_device:
        detail = " (zenflow's selected columns and landing buffers do not fit the device)"
    elif not zen.fits_host:
        detail = f" (zenflow needs {format_bytes(zen.host_total)} of host memory, {format_bytes(host_capacity(machine))} is usable)"
    else:
        detail = ""
    return why, f"offload keeps all optimizer state on the host{detail}"


def _estimate(c: Candidate) -> ModeEstimate:
    t = c.time
    return ModeEstimate(
        fits=c.fits,
        settings=c.settings,
        device_bytes=c.device_total,
        host_bytes=c.host_total,
        step_seconds=t.step_seconds,
        tokens_per_second=t.tokens_per_second,
        gpu_seconds=t.gpu_seconds,
        interconnect_seconds=t.interconnect_seconds,
        pcie_seconds=t.pcie_seconds,
        cpu_seconds=t.cpu_seconds,
        bound=t.bound,
        update_interval=t.update_interval,
        generation_seconds=t.generation_seconds,
    )
