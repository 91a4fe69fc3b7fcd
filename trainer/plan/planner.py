"""The plan: before a job runs, whether it fits a machine, how fast it will run, and the settings
its ``auto`` values resolve to.

:func:`plan_job` reads the model's config alone (parameters counted on torch's meta device, no
weights loaded: :mod:`trainer.plan.shapes`), the job's hyperparameters and engine settings, and a
:class:`~trainer.plan.gpus.Machine`, and returns a :class:`Plan`:

- device bytes: weights, gradients, the engine's device optimizer state and transfer buffers
  (:mod:`trainer.plan.engine`), activations of one micro-batch (with or without checkpointing), and
  the CUDA runtime; host bytes: the engine's pinned state, one weight shard while loading, the
  tokenized data and the process itself;
- predicted step time and tokens/s per engine mode (:mod:`trainer.plan.speed`);
- for every ``auto``: the engine mode (the fastest that fits by the plan's prediction, device mode
  unless another is ``AUTO_MIN_GAIN`` faster: :func:`auto_mode`), micro-batch
  size, activation checkpointing and ``accumulate_on``, chosen among the candidates that fit to run
  fastest (ties: the least memory). ``update_interval: auto`` stays the engine's own (windows end by
  gradient mass); the plan assumes the shortest window that hides the CPU work. ``packing: auto``
  stays off (the runtime default; the plan's bound on a micro-batch is the same either way).

A job on N ranks (``resources.gpus``) is planned for one rank: ``batch_size / N`` examples per step (its
activations and micro-batches), a full model replica on its device, 1/N of the CPU optimizer state
(``SHARDED_HOST``, :mod:`trainer.plan.candidates`; the engine shards it across ranks), its own process and data; on a GPU machine
(already one GPU's share of its host) with that GPU's share, CPU ranks share one host
(:func:`rank_machine`). ``engine.shard_params`` (true, or ``auto`` when the replicated plan does not fit)
plans sharded weights instead of replicas (:mod:`trainer.plan.sharding`: 1/N of the weights, gradients and
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
    DEFAULT_NUM_EXAMPLES,
    Candidate,
    JobShape,
    best,
    candidate,
    device_capacity,
    host_capacity,
    host_reserve,
    options,
    rank_machine,
)
from trainer.plan.gpus import Machine, format_bytes
from trainer.plan.records import MODES, Mode, ModeEstimate, Plan, Problem, Settings
from trainer.plan.shapes import model_shape
from trainer.spec import JobSpec

__all__ = ["Machine", "Plan", "Problem", "Settings", "plan_job"]


def plan_job(
    spec: JobSpec,
    machine: Machine,
    *,
    num_examples: int | None = None,
    num_tokens: int | None = None,
    advise: bool = True,
) -> Plan:
    """The plan of ``spec`` on ``machine`` (see the module doc). ``num_examples`` / ``num_tokens``:
    the training file's counts when known (batch size ``auto`` and the data's host memory depend on
    them). ``advise``: when the job does not fit, plan the single changes that could make it fit
    (:func:`trainer.plan.advice.planned_fixes`) and name those that do in its problems. Raises
    UnknownModelError or ValueError when the model's config cannot be built."""
    box = machine
    shape = model_shape(spec.model, spec.lora)
    dtype = (
        spec.dtype if spec.dtype != "auto" else ("bfloat16" if machine.device_type == "cuda" else "float32")
    )
    n = num_examples or DEFAULT_NUM_EXAMPLES
    try:
        hp = spec.resolve(n)
        batch, seq = hp.batch_size, hp.max_seq_length
    except ValueError:  # too many steps: limit_errors reports it; plan one step's memory anyway
        batch = (
            min(n, 32) if spec.hyperparameters.batch_size == "auto" else int(spec.hyperparameters.batch_size)
        )
        seq = (
            spec.hyperparameters.max_seq_length
            if isinstance(spec.hyperparameters.max_seq_length, int)
            else 2048
        )
    ranks = spec.resources.world_size
    machine = rank_machine(machine, ranks)
    job = JobShape(
        spec, machine, shape, 2 if dtype == "bfloat16" else 4, -(-batch // ranks), seq, n, num_tokens, ranks
    )
    replicated = _choose(job)
    requested = spec.engine.shard_params
    only_sharded = False
    if requested is True or (requested == "auto" and ranks > 1 and not replicated[2].fits):
        sharded = _choose(job._replace(shard=True))
        only_sharded = sharded[2].fits and not replicated[2].fits
        job, (best_by_mode, why, chosen) = job._replace(shard=True), sharded
    else:
        best_by_mode, why, chosen = replicated
    mode = chosen.settings.mode
    reasons: list[str] = []
    if ranks > 1:
        what = "of the weights, gradients and optimizer state" if job.shard else "of the CPU optimizer state"
        reasons.append(
            f"resources.gpus {ranks}: per rank {job.batch} of the {batch} examples of a step and "
            f"1/{ranks} {what}; the figures are one rank's, host_bytes_all_ranks the host's"
        )
    reasons += shard_reasons(spec, job, replicated[2], chosen)
    if why:
        reasons.append(why)
    reasons += setting_reasons(spec, chosen)
    auto_fallback = spec.engine.mode == "auto" and mode == "offload"
    if (
        (mode == "zenflow" or auto_fallback)
        and spec.engine.accumulate_on != "auto"
        and machine.device_type == "cuda"
    ):
        reasons += accumulator_hint(job, chosen)
    if not chosen.fits_locked:
        reasons.append(locked_memory_note(chosen, machine))
    modes = {k: _estimate(c) for k, c in best_by_mode.items()}
    host_bytes = chosen.host_total + (chosen.device_total if machine.device_type == "cpu" else 0)
    return Plan(
        fits=chosen.fits,
        model=spec.model,
        machine=machine,
        params=shape.params,
        trainable_params=shape.trainable_params,
        dtype=dtype,
        batch_size=batch,
        max_seq_length=seq,
        tokens_per_step=batch * seq,
        settings=chosen.settings,
        device_capacity_bytes=device_capacity(machine),
        host_capacity_bytes=host_capacity(machine),
        device_reserve_bytes=(machine.gpu_memory_bytes - device_capacity(machine))
        if machine.device_type == "cuda"
        else 0,
        host_reserve_bytes=host_reserve(machine),
        device_bytes=chosen.device_total,
        host_bytes=host_bytes,
        ranks=ranks,
        host_bytes_all_ranks=ranks * host_bytes,
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
        modes=modes,
        reasons=reasons,
        problems=[] if chosen.fits else _problems(job, chosen, best_by_mode, box, advise),
    )


def _choose(job: JobShape) -> tuple[dict[Mode, Candidate], str, Candidate]:
    """Each mode's best candidate for ``job``, why the mode (``engine.mode: auto``) and the chosen one."""
    by_mode = {mode: best([candidate(job, mode, *o) for o in options(job, mode)]) for mode in MODES}
    mode = job.spec.engine.mode
    why = ""
    if mode == "auto":
        mode, why = auto_mode(by_mode, job.machine)
    return by_mode, why, by_mode[mode]


def _problems(
    job: JobShape, chosen: Candidate, by_mode: dict[Mode, Candidate], box: Machine, advise: bool
) -> list[Problem]:
    found = problems(job, chosen, offload_fits=by_mode["offload"].fits)
    if not advise:
        return found

    def replan(spec: JobSpec) -> Plan:
        return plan_job(spec, box, num_examples=job.num_examples, num_tokens=job.num_tokens, advise=False)

    fitting, failed = planned_fixes(job.spec, job.seq, replan)
    return with_fixes(found, fitting, failed)


#: ``engine.mode: auto`` takes an engine mode other than ``device`` only when it is predicted at least
#: this much faster: the step times are estimates (a few percent apart is no evidence), and device mode
#: is exact AdamW every step with no host state or windows to go wrong.
AUTO_MIN_GAIN = 0.05


def auto_mode(best_by_mode: dict[Mode, Candidate], machine: Machine) -> tuple[Mode, str]:
    """``engine.mode: auto``: the fastest mode that fits by the plan's own prediction (device unless
    another is ``AUTO_MIN_GAIN`` faster), and why; when none fits, the one closest to fitting."""
    times = ", ".join(
        f"{m} {c.time.step_seconds:.3g}{'' if c.fits else ' (does not fit)'}" for m, c in best_by_mode.items()
    )
    fitting = [m for m in MODES if best_by_mode[m].fits]
    if fitting:

        def key(m: Mode) -> float:
            t = best_by_mode[m].time.step_seconds
            return t if m == "device" else t / (1 - AUTO_MIN_GAIN)

        mode = min(fitting, key=key)
        dev, zen = best_by_mode["device"], best_by_mode["zenflow"]
        if mode == "device":
            note = "" if len(fitting) == 1 else f"; others count only when {AUTO_MIN_GAIN:.0%} faster"
            return (
                mode,
                f"engine.mode auto -> device: the fastest that fits (predicted s/step: {times}){note}",
            )
        why = (
            f"device mode needs {format_bytes(dev.device_total)} of device memory, {format_bytes(device_capacity(machine))} is usable"
            if not dev.fits
            else "it is predicted faster"
        )
        what = {
            "zenflow": "zenflow keeps the optimizer state of the split weights on the host",
            "offload": "offload keeps all optimizer state on the host"
            + (
                " (zenflow's selected columns and landing buffers do not fit the device)"
                if not zen.fits_device
                else f" (zenflow needs {format_bytes(zen.host_total)} of host memory, {format_bytes(host_capacity(machine))} is usable)"
                if not zen.fits_host
                else ""
            ),
        }[mode]
        return (
            mode,
            f"engine.mode auto -> {mode}: the fastest that fits; {why} (predicted s/step: {times}); {what}",
        )
    mode = (
        "zenflow"
        if best_by_mode["zenflow"].fits_device or not best_by_mode["offload"].fits_device
        else "offload"
    )
    return (
        mode,
        f"engine.mode auto -> {mode}: no mode fits (predicted s/step: {times}); the problems say what to change",
    )


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
    )
