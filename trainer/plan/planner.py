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
(``SHARDED_HOST``; the engine shards it across ranks), its own process and data; on a GPU machine
(already one GPU's share of its host) with that GPU's share, CPU ranks share one host
(:func:`rank_machine`).

Fitting keeps ``DEVICE_MARGIN`` (10%) of the device memory free for the allocator's fragmentation
and kernels' workspaces; the host side needs no margin of its own (``HOST_PROCESS_BYTES`` is the
process's own use). A plan that does not fit lists :attr:`Plan.problems`: the field to change and
the numbers.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from trainer.plan.engine import EngineBytes, engine_bytes
from trainer.plan.gpus import GiB, Machine, format_bytes
from trainer.plan.shapes import Activations, ModelShape, activation_bytes, model_shape
from trainer.plan.speed import StepTime, step_times
from trainer.spec import JobSpec

Mode = Literal["device", "offload", "zenflow"]
MODES: tuple[Mode, ...] = ("device", "offload", "zenflow")
Accumulator = Literal["host", "device"]

__all__ = ["Machine", "Plan", "Problem", "Settings", "plan_job"]

#: Fraction of device memory the plan leaves free.
DEVICE_MARGIN = 0.10
#: ``engine.mode: auto`` runs ``device`` when device mode fits and its optimizer state takes at most this
#: fraction of the usable device memory (the rest stays for activations and larger micro-batches).
DEVICE_ROOM = 1 / 3
#: Device memory outside torch's allocator: the CUDA context and library workspaces.
CUDA_RUNTIME_BYTES = 3 * GiB // 4
#: Host memory of the training process apart from the engine and the data (Python, torch, transformers).
HOST_PROCESS_BYTES = 2 * GiB
#: Largest weight file a checkpoint is sharded into (transformers' default): what loading holds at once.
WEIGHT_SHARD_BYTES = 5 * 10**9
#: Host bytes of one tokenized token (its id and label as Python ints in lists).
DATA_BYTES_PER_TOKEN = 72
#: Examples assumed when the count is unknown (``batch_size: auto`` resolves to its largest, 32).
DEFAULT_NUM_EXAMPLES = 3200
MICRO_BATCH_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


class Problem(NamedTuple):
    """Why the plan does not fit: the field to change (``("engine", "accumulate_on")``) and why."""

    loc: tuple[str, ...]
    message: str


class Settings(BaseModel):
    """The settings a run uses: the job's own values, its ``auto`` ones resolved by the plan."""

    model_config = ConfigDict(frozen=True)

    mode: Mode
    micro_batch_size: int
    gradient_checkpointing: bool
    packing: bool
    accumulate_on: Accumulator
    #: The engine's window: an int, or ``auto`` (the engine's adaptive window; see step time's assumption).
    update_interval: int | Literal["auto"]


class ModeEstimate(BaseModel):
    """One engine mode's best configuration on the machine."""

    model_config = ConfigDict(frozen=True)

    fits: bool
    settings: Settings
    device_bytes: int
    host_bytes: int
    step_seconds: float
    tokens_per_second: float
    gpu_seconds: float
    pcie_seconds: float
    cpu_seconds: float
    bound: str
    #: zenflow: the window length the step time assumes.
    update_interval: int | None = None


class Plan(BaseModel):
    """Whether a job fits a machine, its memory per component, its settings and predicted speed."""

    model_config = ConfigDict(frozen=True)

    fits: bool
    model: str
    machine: Machine
    params: int
    trainable_params: int
    dtype: Literal["float32", "bfloat16"]
    batch_size: int
    max_seq_length: int
    tokens_per_step: int
    settings: Settings
    #: Device memory the plan may use (the GPU's memory less the margin; host memory on a CPU machine).
    device_capacity_bytes: int
    host_capacity_bytes: int
    device_bytes: int
    host_bytes: int
    #: Per component: weights, gradients, optimizer_state, landing_buffers, accumulator, engine_scratch,
    #: activations, runtime (device); engine_state, engine_accumulators, engine_transfer, model_loading,
    #: data, process (host). On a CPU machine the device components are counted in host_bytes too.
    device: dict[str, int]
    host: dict[str, int]
    activations: dict[str, int]
    step_seconds: float
    tokens_per_second: float
    #: Per engine mode: its best configuration, whether it fits, predicted step time.
    modes: dict[Mode, ModeEstimate]
    #: Why these settings (one sentence each).
    reasons: list[str]
    problems: list[Problem]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: problems as ``{"loc": [...], "message": ...}``."""
        d = self.model_dump(mode="json")
        d["problems"] = [{"loc": list(p.loc), "message": p.message} for p in self.problems]
        return d

    def summary(self) -> str:
        """One line for the job's events."""
        s = self.settings
        fit = "fits" if self.fits else "does not fit"
        return (
            f"Plan: {fit} on {self.machine.gpu_name}: {s.mode} mode, micro-batch {s.micro_batch_size}, "
            f"checkpointing {'on' if s.gradient_checkpointing else 'off'}, device {format_bytes(self.device_bytes)} "
            f"of {format_bytes(self.device_capacity_bytes)}, host {format_bytes(self.host_bytes)} of "
            f"{format_bytes(self.host_capacity_bytes)}, ~{self.step_seconds:.3g} s/step"
        )


class _Candidate(NamedTuple):
    settings: Settings
    device: dict[str, int]
    host: dict[str, int]
    activations: Activations
    time: StepTime
    device_total: int
    host_total: int
    fits_device: bool
    fits_host: bool
    fits_locked: bool

    @property
    def fits(self) -> bool:
        # The locked-memory limit (RLIMIT_MEMLOCK) is advisory: CUDA's pinned allocations
        # (cudaHostAlloc) are pinned by the driver, not by mlock, so the limit does not stop them; a
        # plan over it says so in its reasons instead of refusing the job.
        return self.fits_device and self.fits_host


class _Job(NamedTuple):
    spec: JobSpec
    machine: Machine
    shape: ModelShape
    dtype_bytes: int
    #: Examples per optimizer step on one rank (the job's batch split across its ranks).
    batch: int
    seq: int
    num_examples: int
    num_tokens: int | None
    ranks: int = 1


#: Host components of the engine each rank holds only its 1/N shard of (the CPU optimizer state).
SHARDED_HOST = ("engine_state", "engine_accumulators")


def _engine_bytes(job: _Job, mode: Mode, acc: Accumulator) -> EngineBytes:
    """The engine's bytes on one rank with the job's settings in ``mode`` with accumulator ``acc`` (the
    job's own values or another candidate's): with N ranks, its shard of the CPU optimizer state."""
    config = job.spec.engine.engine_config(1.0).model_copy(update={"mode": mode, "accumulate_on": acc})
    eng = engine_bytes(config, job.shape.trainable, job.dtype_bytes, cuda=job.machine.device_type == "cuda")
    if job.ranks == 1:
        return eng
    host = {k: -(-v // job.ranks) if k in SHARDED_HOST else v for k, v in eng.host.items()}
    return EngineBytes(device=eng.device, host=host, host_params=-(-eng.host_params // job.ranks))


def rank_machine(machine: Machine, ranks: int) -> Machine:
    """What one of ``ranks`` ranks of a job has: a GPU machine is already one GPU's share of its host
    (worker.capacity.measure.to_machine); CPU ranks split the host's memory, cores and bandwidth."""
    if ranks == 1 or machine.device_type == "cuda":
        return machine
    return machine.model_copy(
        update={
            "host_memory_bytes": max(1, machine.host_memory_bytes // ranks),
            "cores": max(1, machine.cores // ranks),
            "cpu_adam_gbps": machine.cpu_adam_gbps / ranks,
            "gpu_flops": machine.gpu_flops / ranks,
        }
    )


def _candidate(job: _Job, mode: Mode, mb: int, ckpt: bool, acc: Accumulator) -> _Candidate:
    spec, m, shape, e = job.spec, job.machine, job.shape, job.dtype_bytes
    cuda = m.device_type == "cuda"
    eng = _engine_bytes(job, mode, acc)
    act = activation_bytes(shape, mb, job.seq, e, checkpointing=ckpt)
    device = {
        "weights": shape.params * e,
        "gradients": shape.trainable_params * e,
        **eng.device,
        "activations": act.peak_bytes,
    }
    if cuda:
        device["runtime"] = CUDA_RUNTIME_BYTES
    tokens = job.num_tokens if job.num_tokens is not None else job.num_examples * job.seq // 2
    host = {
        **eng.host,
        "model_loading": min(shape.params * e, WEIGHT_SHARD_BYTES),
        "data": tokens * DATA_BYTES_PER_TOKEN,
        "process": HOST_PROCESS_BYTES,
    }
    dev_total, host_total = sum(device.values()), sum(host.values())
    if cuda:
        fits_device = dev_total <= _device_capacity(m)
        fits_host = host_total <= m.host_memory_bytes
    else:
        fits_device = fits_host = dev_total + host_total <= m.host_memory_bytes
    pinned = eng.host_total if cuda else 0
    fits_locked = m.locked_memory_bytes is None or pinned <= m.locked_memory_bytes
    interval = spec.engine.update_interval
    split = eng.host_params if mode == "zenflow" else _engine_bytes(job, "zenflow", acc).host_params
    times = step_times(
        shape,
        m,
        tokens=job.batch * job.seq,
        micro_tokens=mb * job.seq,
        seq=job.seq,
        checkpointing=ckpt,
        dtype_bytes=e,
        host_params={"offload": shape.trainable_params, "zenflow": split},
        accumulate_on=acc,
        update_interval=None if interval == "auto" else int(interval),
        max_update_interval=spec.engine.max_update_interval,
        cpu_share=spec.engine.cpu_optimizer_cores_ratio,
        overlap_step=spec.engine.overlap_step,
    )
    packing = spec.hyperparameters.packing
    settings = Settings(
        mode=mode,
        micro_batch_size=mb,
        gradient_checkpointing=ckpt,
        packing=packing if isinstance(packing, bool) else False,
        accumulate_on=acc,
        update_interval=interval,
    )
    return _Candidate(
        settings, device, host, act, times[mode], dev_total, host_total, fits_device, fits_host, fits_locked
    )


def _device_capacity(m: Machine) -> int:
    if m.device_type == "cpu":
        return m.host_memory_bytes
    return int(m.gpu_memory_bytes * (1 - DEVICE_MARGIN))


def _options(job: _Job, mode: Mode) -> list[tuple[int, bool, Accumulator]]:
    mb = job.spec.hyperparameters.micro_batch_size
    mbs = (
        [min(mb, job.batch)]
        if isinstance(mb, int)
        else sorted({min(c, job.batch) for c in MICRO_BATCH_CANDIDATES if c <= job.batch} | {job.batch})
    )
    gc = job.spec.hyperparameters.gradient_checkpointing
    ckpts = [gc] if isinstance(gc, bool) else [False, True]
    acc = job.spec.engine.accumulate_on
    accs: list[Accumulator]
    if acc in ("host", "device"):
        accs = [acc]
    else:  # on a CPU machine both accumulators are host memory: keep the worker doing the adds
        accs = ["host", "device"] if mode == "zenflow" and job.machine.device_type == "cuda" else ["host"]
    return list(itertools.product(mbs, ckpts, accs))


def _best(cands: list[_Candidate]) -> _Candidate:
    """The fastest that fits (ties: the least memory); when none does, the fastest of those that fit
    the device (the host side is then what to change), else the one needing the least device memory."""
    for good in ([c for c in cands if c.fits], [c for c in cands if c.fits_device]):
        if good:
            return min(good, key=lambda c: (round(c.time.step_seconds, 9), c.device_total + c.host_total))
    return min(cands, key=lambda c: (c.device_total, c.time.step_seconds))


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
    job = _Job(
        spec, machine, shape, 2 if dtype == "bfloat16" else 4, -(-batch // ranks), seq, n, num_tokens, ranks
    )
    best = {mode: _best([_candidate(job, mode, *o) for o in _options(job, mode)]) for mode in MODES}
    reasons: list[str] = []
    if ranks > 1:
        reasons.append(
            f"resources.gpus {ranks}: per rank {job.batch} of the {batch} examples of a step and "
            f"1/{ranks} of the CPU optimizer state; the figures are one rank's"
        )
    mode = spec.engine.mode
    if mode == "auto":
        dev = best["device"]
        room = dev.device["optimizer_state"] <= DEVICE_ROOM * _device_capacity(machine)
        if dev.fits and room:
            mode = "device"
            reasons.append(
                f"engine.mode auto -> device: the optimizer state ({format_bytes(dev.device['optimizer_state'])}) fits the "
                f"device beside the model ({format_bytes(dev.device_total)} of {format_bytes(_device_capacity(machine))})"
            )
        else:
            mode = "zenflow"
            why = (
                (
                    f"its optimizer state ({format_bytes(dev.device['optimizer_state'])}) would take over "
                    f"{DEVICE_ROOM:.0%} of the usable {format_bytes(_device_capacity(machine))}"
                )
                if dev.fits
                else (
                    f"device mode needs {format_bytes(dev.device_total)} of device memory, {format_bytes(_device_capacity(machine))} "
                    "is usable"
                )
            )
            if best["zenflow"].fits or not best["offload"].fits:
                reasons.append(
                    f"engine.mode auto -> zenflow: {why}; zenflow keeps the optimizer state on the host"
                )
            else:  # zenflow's device-side columns and buffers do not fit; offload keeps only the model
                mode = "offload"
                reasons.append(
                    f"engine.mode auto -> offload: {why}, and zenflow needs {format_bytes(best['zenflow'].device_total)} "
                    "(its selected columns' state and landing buffers); offload keeps all optimizer state on the host"
                )
    chosen = best[mode]
    reasons += _setting_reasons(spec, chosen)
    if mode == "zenflow" and spec.engine.accumulate_on != "auto" and machine.device_type == "cuda":
        reasons += _accumulator_hint(job, chosen)
    if not chosen.fits_locked:
        reasons.append(_locked_memory_note(chosen, machine))
    modes = {k: _estimate(c) for k, c in best.items()}
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
        device_capacity_bytes=_device_capacity(machine),
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
        problems=[] if chosen.fits else _problems(job, chosen, offload_fits=best["offload"].fits),
    )


def _estimate(c: _Candidate) -> ModeEstimate:
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


def _setting_reasons(spec: JobSpec, c: _Candidate) -> list[str]:
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


def _accumulator_hint(job: _Job, c: _Candidate) -> list[str]:
    """A faster ``accumulate_on`` than the job's own, when one fits (the job's value is kept)."""
    other: Accumulator = "device" if c.settings.accumulate_on == "host" else "host"
    alt = _best([_candidate(job, "zenflow", mb, ckpt, other) for mb, ckpt, _ in _options(job, "zenflow")])
    if not alt.fits or alt.time.step_seconds > 0.9 * c.time.step_seconds:
        return []
    return [
        f"engine.accumulate_on {other} would fit and run {c.time.step_seconds / alt.time.step_seconds:.1f}x "
        f"faster here ({alt.time.step_seconds:.3g} s/step; set it, or auto)"
    ]


def _problems(job: _Job, c: _Candidate, *, offload_fits: bool) -> list[Problem]:
    spec, m = job.spec, job.machine
    out: list[Problem] = []
    loc: tuple[str, ...]
    if not c.fits_device:
        need, have = format_bytes(c.device_total), format_bytes(_device_capacity(m))
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


def _locked_memory_note(c: _Candidate, m: Machine) -> str:
    pinned = sum(v for k, v in c.host.items() if k.startswith("engine"))
    return (
        f"note: the engine pins {format_bytes(pinned)} of host memory, over the worker's locked-memory limit "
        f"({format_bytes(m.locked_memory_bytes or 0)}); CUDA's pinned allocations do not count against it, "
        "but other page-locking (RDMA, mlock) on this host does: consider raising it (ulimit -l)"
    )
