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
- for every ``auto``: the engine mode (``device`` when device mode fits and its optimizer state takes
  at most ``DEVICE_ROOM`` of the usable device memory, as LoRA's does, else ``zenflow``), micro-batch
  size, activation checkpointing and ``accumulate_on``, chosen among the candidates that fit to run
  fastest (ties: the least memory). ``update_interval: auto`` stays the engine's own (windows end by
  gradient mass); the plan assumes the shortest window that hides the CPU work. ``packing: auto``
  stays off (the runtime default; the plan's bound on a micro-batch is the same either way).

A job on N ranks (``resources.gpus``) is planned for one rank: ``batch_size / N`` examples per step (its
activations and micro-batches), a full model replica on its device, 1/N of the CPU optimizer state
(``SHARDED_HOST``, :mod:`trainer.plan.candidates`; the engine shards it across ranks), its own process and data; on a GPU machine
(already one GPU's share of its host) with that GPU's share, CPU ranks share one host
(:func:`rank_machine`).

The candidates and the constants they count with are :mod:`trainer.plan.candidates`, the reasons and
problems :mod:`trainer.plan.advice`, the returned records :mod:`trainer.plan.records`. Fitting keeps
``DEVICE_MARGIN`` (10%) of the device memory free for the allocator's fragmentation
and kernels' workspaces; the host side needs no margin of its own (``HOST_PROCESS_BYTES`` is the
process's own use). A plan that does not fit lists :attr:`Plan.problems`: the field to change and
the numbers.
"""

from __future__ import annotations

from trainer.plan.advice import accumulator_hint, locked_memory_note, problems, setting_reasons
from trainer.plan.candidates import (
    DEFAULT_NUM_EXAMPLES,
    DEVICE_ROOM,
    Candidate,
    JobShape,
    best,
    candidate,
    device_capacity,
    options,
    rank_machine,
)
from trainer.plan.gpus import Machine, format_bytes
from trainer.plan.records import MODES, ModeEstimate, Plan, Problem, Settings
from trainer.plan.shapes import model_shape
from trainer.spec import JobSpec

__all__ = ["Machine", "Plan", "Problem", "Settings", "plan_job"]


def plan_job(
    spec: JobSpec, machine: Machine, *, num_examples: int | None = None, num_tokens: int | None = None
) -> Plan:
    """The plan of ``spec`` on ``machine`` (see the module doc). ``num_examples`` / ``num_tokens``:
    the training file's counts when known (batch size ``auto`` and the data's host memory depend on
    them). Raises UnknownModelError or ValueError when the model's config cannot be built."""
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
    ranks = spec.resources.gpus
    machine = rank_machine(machine, ranks)
    job = JobShape(
        spec, machine, shape, 2 if dtype == "bfloat16" else 4, -(-batch // ranks), seq, n, num_tokens, ranks
    )
    best_by_mode = {mode: best([candidate(job, mode, *o) for o in options(job, mode)]) for mode in MODES}
    reasons: list[str] = []
    if ranks > 1:
        reasons.append(
            f"resources.gpus {ranks}: per rank {job.batch} of the {batch} examples of a step and "
            f"1/{ranks} of the CPU optimizer state; the figures are one rank's"
        )
    mode = spec.engine.mode
    if mode == "auto":
        dev = best_by_mode["device"]
        room = dev.device["optimizer_state"] <= DEVICE_ROOM * device_capacity(machine)
        if dev.fits and room:
            mode = "device"
            reasons.append(
                f"engine.mode auto -> device: the optimizer state ({format_bytes(dev.device['optimizer_state'])}) fits the "
                f"device beside the model ({format_bytes(dev.device_total)} of {format_bytes(device_capacity(machine))})"
            )
        else:
            mode = "zenflow"
            why = (
                (
                    f"its optimizer state ({format_bytes(dev.device['optimizer_state'])}) would take over "
                    f"{DEVICE_ROOM:.0%} of the usable {format_bytes(device_capacity(machine))}"
                )
                if dev.fits
                else (
                    f"device mode needs {format_bytes(dev.device_total)} of device memory, {format_bytes(device_capacity(machine))} "
                    "is usable"
                )
            )
            if best_by_mode["zenflow"].fits or not best_by_mode["offload"].fits:
                reasons.append(
                    f"engine.mode auto -> zenflow: {why}; zenflow keeps the optimizer state on the host"
                )
            else:  # zenflow's device-side columns and buffers do not fit; offload keeps only the model
                mode = "offload"
                reasons.append(
                    f"engine.mode auto -> offload: {why}, and zenflow needs {format_bytes(best_by_mode['zenflow'].device_total)} "
                    "(its selected columns' state and landing buffers); offload keeps all optimizer state on the host"
                )
    chosen = best_by_mode[mode]
    reasons += setting_reasons(spec, chosen)
    if mode == "zenflow" and spec.engine.accumulate_on != "auto" and machine.device_type == "cuda":
        reasons += accumulator_hint(job, chosen)
    if not chosen.fits_locked:
        reasons.append(locked_memory_note(chosen, machine))
    modes = {k: _estimate(c) for k, c in best_by_mode.items()}
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
        host_capacity_bytes=machine.host_memory_bytes,
        device_bytes=chosen.device_total,
        host_bytes=chosen.host_total + (chosen.device_total if machine.device_type == "cpu" else 0),
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
        problems=[] if chosen.fits else problems(job, chosen, offload_fits=best_by_mode["offload"].fits),
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
        pcie_seconds=t.pcie_seconds,
        cpu_seconds=t.cpu_seconds,
        bound=t.bound,
        update_interval=t.update_interval,
    )
