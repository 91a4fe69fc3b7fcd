"""The ZenFlow engine: replaces ``optimizer.step()`` in a training loop, in one of three modes.

Use::

    engine = ZenFlowEngine(model, EngineConfig(mode="zenflow", lr=2e-5))
    with engine:
        for batch in data:
            loss = model(**batch).loss
            engine.scale_loss(loss).backward()  # the loss itself unless fp16 loss scaling is on
            metrics = engine.step()        # clip + update (per mode); returns a StepMetrics
            engine.zero_grad()             # set_to_none=True by default
            engine.set_lr(schedule(step))  # optional, per step
        engine.flush()                     # apply the pending CPU update before saving the model
        weights = engine.consolidated_state_dict()

Modes: :mod:`offload.device_mode`, :mod:`offload.offload_mode`, :mod:`offload.zenflow` (each
docstring gives its exact semantics). The engine owns the parameters with
``requires_grad``; they must all live on one device (CPU or one CUDA device) and may be fp32, bf16
or fp16. Clipping (:mod:`offload.clipping`) is global over all of them and happens before any part
is updated, in every mode.

Bad gradients (:mod:`offload.guard`): a step whose global gradient norm is not finite is skipped in
every mode and part (``StepMetrics.skipped``) and training continues. fp16 parameters get dynamic
loss scaling (``EngineConfig.loss_scaling``): backpropagate ``engine.scale_loss(loss)``; the scale
is part of ``state_dict()``. Neither needs a host sync: the verdict is applied on the device and read
by the host from a copy that has landed by the time it is needed.

Timing (:class:`~offload.step_metrics.StepMetrics`): ``wall_seconds`` runs from the end of the previous
``step()`` (the engine's construction for the first) to the end of this one; ``compute_seconds`` is
``wall - stall``. ``stall_seconds``: on a CPU-only run, the time ``step()`` spent blocked on the CPU
optimizer or on transfers; on CUDA, the time the device waited, from CUDA timing events
(:mod:`offload.timing`): the gap from the end of the previous step's queued work to the start of this
step's (``begin_step()``: a forward pre-hook on a module given to the engine, or the training loop),
plus every section where ``step()`` blocks the training thread. No plain ``step()`` synchronizes
the device: its one host read, the gradient norm and verdict, waits at most for the backward pass
and clipping while the mode's kernels are queued behind them. Idle time is read once its closing
event has run, never waited for (an interval still in flight is counted in the next step; a step's
stall is capped at its wall time and the excess carried on, so a run's sum is exact).

CPU cores (:mod:`offload.cores`): of the ``cpu_threads`` (default: the cores this process may use)
the CPU optimizer thread gets ``round(cpu_optimizer_cores_ratio * n)`` (at least 1, and at most
``n - 1`` when ``n > 1``); ``cpu_split`` reports ``(training, optimizer)``. The engine does not change the training
thread's torch thread count: on a CPU-only run call ``torch.set_num_threads(engine.cpu_split[0])``.
The synchronous ``offload`` mode uses all ``n`` cores for its CPU step.

Process groups (:mod:`offload.collectives`): ``ZenFlowEngine(model, config, process_group=group)`` on
every rank of a torch.distributed group (NCCL on CUDA, gloo on CPU) over identical replicas makes the
engine data parallel, ZeRO-2 style. ``step()`` averages the gradients across ranks (all-reduce;
``offload`` mode: reduce-scatter), so clipping, the non-finite skip and zenflow's column selection
see the same reduced gradient everywhere and the device part is updated identically on every rank.
Each rank owns a contiguous 1/N shard of every host store (fp32 master, moments, accumulators) and
runs the CPU AdamW on it alone; the new values are all-gathered into every replica (zenflow: by the
CPU thread on a second group, overlapped with the next window as the single-GPU prefetch is).
``step()``, ``flush()`` and ``load_state_dict()`` are collective. ``state_dict()`` is this rank's
shard; ``load_state_dict`` takes it back on the same rank of a group of the same size, or the list of
every rank's states of a group of any size (re-cut). ``consolidated_state_dict()`` reads the rank's
full replica; with NCCL (zenflow) it first completes a pending all-gather, so it is collective there
unless ``state_dict()`` ran first. ``StepMetrics`` reports ``world_size``, ``rank``, ``bytes_reduced`` and
``bytes_gathered`` (what the rank sent, ring algorithms); host bytes are the rank's own. zenflow with
host accumulation reduce-scatters the split weights' gradients and all-reduces only their selected
columns (:mod:`offload.zenflow.reduction`).

FSDP2 (``shard_params=True``, :mod:`offload.fsdp`): a model after ``fully_shard`` (no ``process_group``):
every mode trains each rank's rows of the reduce-scattered gradient as one process would; the clipping
norm and zenflow's column scores are summed over the mesh's group. ``state_dict()`` is the rank's rows.

Core placement (``bind_worker_cores``, on by default; :mod:`offload.placement`): where the host
allows it, the split is made of whole physical cores from the sysfs topology, the CPU thread is
pinned to the optimizer's and every other thread of the process to the training's, torch's intra-op
thread count capped at the training CPUs (all restored at ``close()``), and on a multi-GPU host the
process first takes its GPU's NUMA-local share of the cores (all modes). ``placement`` describes
what was done, or why nothing was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from offload.clipping import clip_, clip_reduced_
from offload.collectives import EngineGroup, fill_missing_gradients
from offload.config import EngineConfig
from offload.cores import Cores
from offload.cpu_thread import CPUThreadError
from offload.device import DeviceOps, Landing
from offload.device_mode import DeviceMode
from offload.engine_state import STATE_VERSION, recut_mode_state, states_to_load
from offload.fsdp import RowShards, clip_rows_
from offload.guard import Gate, LossScaler
from offload.memory import EngineMemory
from offload.mode_base import Mode, NamedParams
from offload.offload_mode import OffloadMode
from offload.placement import Placement
from offload.step_metrics import StepMetrics
from offload.timing import IdleClock, StepStats, TimingEvent, begin_step_hook
from offload.zenflow.mode import ZenFlowMode

__all__ = ["CPUThreadError", "ZenFlowEngine"]


class ZenFlowEngine:
    """Optimizer engine over a model's trainable parameters (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module | NamedParams,
        config: EngineConfig | None = None,
        *,
        process_group: Any = None,
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        named = list(model.named_parameters()) if isinstance(model, torch.nn.Module) else list(model)
        named = [(n, p) for n, p in named if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameters with requires_grad=True")
        #: FSDP2 row shards (offload.fsdp): the modes train each parameter's local rows, as in one process.
        self._rows = RowShards.of(named, self.config.shard_params, process_group)
        named = self._rows.named_local if self._rows is not None else named
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(
                f"all trainable parameters must be on one device, got {sorted(map(str, devices))}"
            )
        self.device = next(iter(devices))
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device type {self.device.type!r} (cpu or cuda)")
        for n, p in named:
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise TypeError(f"{n}: unsupported parameter dtype {p.dtype} (fp32, bf16 or fp16)")
        self._named = named
        self._params = [p for _, p in named]
        #: The process group (see the module docstring); created collectively, so every rank builds its engine.
        self._ranks = EngineGroup.of(process_group)
        #: The CPU cores' division between training and the CPU optimizer, and their placement.
        self._cores = Cores(self.config, self.device)
        self.cpu_split = self._cores.split
        self._ops = DeviceOps(self.device)
        self._lr = float(self.config.lr)
        self._step = 0
        self._closed = False
        self.last_metrics: StepMetrics | None = None
        cfg = self.config
        fp16 = any(p.dtype == torch.float16 for p in self._params)
        self._scaler: LossScaler | None = None
        if cfg.loss_scaling == "dynamic" or (cfg.loss_scaling == "auto" and fp16):
            self._scaler = LossScaler(
                self.device,
                init_scale=cfg.loss_scale_init,
                growth_factor=cfg.loss_scale_growth_factor,
                backoff_factor=cfg.loss_scale_backoff_factor,
                growth_interval=cfg.loss_scale_growth_interval,
            )
        self._mode: Mode = self._build_mode()
        self._mode.row_group = self._rows.group if self._rows is not None else None
        #: Host bytes the mode allocated (fixed for the engine's life; reported in every StepMetrics).
        self._host_bytes = self._mode.memory().host_bytes
        self._cores.pin(self._mode.cpu_thread)
        #: CUDA stall accounting: the device's idle intervals, the end of the last step's queued work,
        #: idle time beyond a step's wall carried to the next.
        self._idle = IdleClock()
        self._end_ev: TimingEvent | None = None
        self._carry = 0.0
        self._hook: Any = None
        if self._ops.is_cuda and isinstance(model, torch.nn.Module):
            self._hook = model.register_forward_pre_hook(begin_step_hook(self))
        self._t_last = time.perf_counter()

    @property
    def placement(self) -> Placement:
        """Where the training thread and the CPU optimizer run, or why they are not placed."""
        return self._cores.placement

    def _build_mode(self) -> Mode:
        cfg, ops, ranks, cores = self.config, self._ops, self._ranks, self._cores
        if cfg.mode == "device":
            return DeviceMode(self._named, cfg, ops, ranks)
        if cfg.mode == "offload":
            return OffloadMode(self._named, cfg, ops, ranks, threads=cores.total)
        return ZenFlowMode(
            self._named, cfg, ops, ranks, threads=self.cpu_split[1], optimizer_cores=cores.optimizer_cores
        )

    # --- the training-loop API ------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def world_size(self) -> int:
        """EngineGroup in the engine's process group, or sharing the parameters' rows (1 without either)."""
        return self._rows.world if self._rows is not None else self._ranks.world

    @property
    def rank(self) -> int:
        return self._rows.rank if self._rows is not None else self._ranks.rank

    @property
    def lr(self) -> float:
        return self._lr

    def set_lr(self, lr: float) -> None:
        lr = float(lr)
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        self._lr = lr

    @property
    def global_step(self) -> int:
        return self._step

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: times the loss scale with fp16 loss scaling, else ``loss`` itself."""
        return loss if self._scaler is None else self._scaler.scale_loss(loss)

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale (None without loss scaling); reading it waits for the device."""
        return None if self._scaler is None else float(self._scaler.scale)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def begin_step(self) -> None:
        """Mark the start of a training step's device work: call before queuing its first device work
        (forward pass, input copies). Only stall accounting on CUDA uses it (the device's idle gap since
        the last ``step()``); idempotent within a step, and called by the model's forward pre-hook when
        the engine was built from a module."""
        if self._end_ev is None or self._closed:
            return
        start = self._ops.timing_event()
        if start is not None:
            self._idle.add(self._end_ev, start)
        self._end_ev = None

    def step(self) -> StepMetrics:
        """Clip and update after ``loss.backward()``; zeroes nothing. Returns this step's metrics."""
        self._check_open()
        self._mode.check()
        self._end_ev = None  # begin_step() was not called: this step's leading gap is not measured
        stats = StepStats(mark=self._ops.timing_event)  # CUDA; on CPU it marks nothing
        ranks = self._ranks
        if ranks.distributed:
            fill_missing_gradients(self._params, ranks)
        if self._rows is not None:
            self._rows.bind_grads()
        grads = [p.grad for p in self._params if p.grad is not None]
        scaler = self._scaler
        # fp16 gradients stay loss-scaled (offload.guard): `inv` folds into the norm and the factor
        inv = scaler.unscale_(grads) if scaler is not None else None
        total_norm, coef, sharded = self._clip(stats, grads, inv)
        gate, landing = self._gate(total_norm, coef, inv)
        self._mode.step(stats, self._lr, gate)
        if scaler is not None:
            scaler.update(gate)
        self._step += 1
        vals = landing.values()
        grad_norm = vals[0] if grads or sharded else None
        wall, stall = self._wall_and_stall(stats)
        m = self._metrics(stats, gate, wall, stall, grad_norm, vals[2] if scaler is not None else None)
        self.last_metrics = m
        return m

    def _clip(
        self, stats: StepStats, grads: list[torch.Tensor], inv: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The global gradient norm and clip coefficient, the gradients clipped; whether the mode's
        reduction left this rank a shard (data parallel: the mean over ranks first, as far as the mode
        needs it; offload: its shard)."""
        if self._ranks.distributed:
            reduced = self._mode.reduce(stats)
            total_norm, coef = clip_reduced_(
                reduced, self.config.max_grad_norm, self.device, self._ranks, inv=inv
            )
            return total_norm, coef, bool(reduced.shards)
        if self._rows is not None:
            total_norm, coef = clip_rows_(
                grads, self.config.max_grad_norm, self.device, self._rows.group, inv=inv
            )
        else:
            total_norm, coef = clip_(grads, self.config.max_grad_norm, self.device, inv=inv)
        return total_norm, coef, False

    def _gate(
        self, total_norm: torch.Tensor, coef: torch.Tensor, inv: torch.Tensor | None
    ) -> tuple[Gate, Landing]:
        """This step's verdict (finite norm) and, with loss scaling, the gradient factor; the norm, the
        verdict (and the scale and factor) on their way to the host."""
        scaler = self._scaler
        ok = torch.isfinite(total_norm)
        # The verdict and the norm leave the device now, before the mode queues its kernels, so reading
        # them once those are queued waits for nothing.
        scalars = [total_norm, ok]
        factor = None
        if scaler is not None and inv is not None:
            factor = scaler.grad_factor(coef, inv, ok)
            scalars += [scaler.scale, factor]
        landing = self._ops.read_later(scalars)
        return Gate(ok, landing, at=1, grad_factor=factor, factor_at=3), landing

    def _wall_and_stall(self, stats: StepStats) -> tuple[float, float]:
        """Wall seconds since the last step, and how many of them the device stood idle (CUDA: timing
        events, the excess carried to the next step; CPU: the stalls the mode counted)."""
        for a, b in stats.marks:
            self._idle.add(a, b)
        self._end_ev = self._ops.timing_event()
        end = time.perf_counter()
        wall = end - self._t_last
        self._t_last = end
        if self._end_ev is not None:  # device idle time from timing events (CUDA)
            idle = self._carry + self._idle.harvest()
            stall = min(idle, wall)
            self._carry = idle - stall
        else:
            stall = min(stats.stall_seconds, wall)
        return wall, stall

    def _metrics(
        self,
        stats: StepStats,
        gate: Gate,
        wall: float,
        stall: float,
        grad_norm: float | None,
        loss_scale: float | None,
    ) -> StepMetrics:
        return StepMetrics(
            step=self._step,
            wall_seconds=wall,
            compute_seconds=wall - stall,
            stall_seconds=stall,
            cpu_optimizer_seconds=stats.cpu_optimizer_seconds,
            bytes_device_to_host=stats.bytes_d2h,
            bytes_host_to_device=stats.bytes_h2d,
            device_optimizer_state_bytes=self._mode.state_bytes(),
            applied_cpu_update=stats.applied_cpu_update,
            grad_norm=grad_norm,
            lr=self._lr,
            mode=self.config.mode,
            device_buffer_bytes=self._mode.buffer_bytes(),
            synchronous=stats.synchronous,
            skipped=not gate.finite(),
            loss_scale=loss_scale,
            host_bytes=self._host_bytes,
            world_size=self.world_size,
            rank=self.rank,
            bytes_reduced=stats.bytes_reduced,
            bytes_gathered=stats.bytes_gathered,
            sharded=self._rows is not None,
            param_bytes=sum(p.numel() * p.element_size() for p in self._params),
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients. In-place zeroing first orders the device after the last gradient copy."""
        if set_to_none:
            for p in self._params:
                p.grad = None
            if self._rows is not None:
                self._rows.clear_grads()
            return
        self._mode.before_zero_grad()
        self._ops.wait_last_d2h()
        for p in self._params:
            if p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    def new_epoch(self) -> None:
        """Signal an epoch boundary (``select_interval="epoch"`` reselects at the next window end)."""
        self._mode.new_epoch()

    def flush(self) -> None:
        """Wait for in-flight CPU work and apply everything pending to the model now.

        In zenflow mode this ends the current window early (its accumulated gradient is applied too);
        training may continue afterwards. The time spent is not part of any step's metrics.
        """
        self._check_open()
        self._mode.check()
        self._ops.sync_compute()
        self._mode.flush(StepStats(), self._lr)
        self._after_pause()

    def _after_pause(self) -> None:
        """After work outside any step (flush, load): the device idle gap until the next step's work
        is not a step's stall; intervals of the last step still in flight go to the next one."""
        self._end_ev = None
        self._carry += self._idle.harvest()
        self._t_last = time.perf_counter()

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Newest weights by parameter name, on CPU, in the parameters' dtypes.

        zenflow: the device values, with the pending CPU result merged in for the columns where it
        applies; waits for the CPU work in flight but changes nothing, so training continues as if
        this had not been called. Parameters without ``requires_grad`` are not included.
        """
        self._check_open()
        self._mode.check()
        return self._mode.consolidated()

    def state_dict(self) -> dict[str, Any]:
        """Everything for an identical continuation (waits for the CPU work in flight).

        Includes the raw device values of the trainable parameters, so ``load_state_dict`` restores
        the model's trainable weights too. All tensors are CPU copies; the dict is ``torch.save``-able.
        """
        self._check_open()
        self._mode.check()
        return self._state(self._mode.state_dict())

    def _state(self, mode_state: dict[str, Any]) -> dict[str, Any]:
        """The engine's state around its mode's (the one layout ``state_dict`` and ``state_views`` share)."""
        sd = {
            "version": STATE_VERSION,
            "mode": self.config.mode,
            "step": self._step,
            "lr": self._lr,
            "mode_state": mode_state,
            "shard": {
                "rank": self.rank,
                "world_size": self.world_size,
                "row_sharded": self._rows is not None,
            },
        }
        if self._scaler is not None:
            sd["loss_scale"] = self._scaler.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Restore a state saved by ``state_dict()`` of an engine with the same model and mode.

        In a process group: the state this rank saved in a group of the same size, or a list of the
        states of every rank of the saving group (any size, in rank order; a single process's state
        is a list of one), whose optimizer shards are then re-cut for this group.
        """
        self._check_open()
        rank, world = self.rank, self.world_size
        states, recut = states_to_load(sd, self.config.mode, rank, world, row_sharded=self._rows is not None)
        if recut and (self._rows is not None or states[0]["shard"].get("row_sharded", False)):
            self._mode.load_shards([recut_mode_state(states, rank, world, self._mode, self._rows)])
        elif recut:
            self._mode.load_shards([st["mode_state"] for st in states])
        else:
            self._mode.load_state_dict(states[rank if isinstance(sd, list) else 0]["mode_state"])
        first = states[0]
        if self._scaler is not None and "loss_scale" in first:  # states saved without it: the initial scale
            self._scaler.load_state_dict(first["loss_scale"])
        self._step = int(first["step"])
        self._lr = float(first["lr"])
        self._after_pause()

    # --- inspection -----------------------------------------------------------------------------
    @property
    def device_optimizer_state_bytes(self) -> int:
        return self._mode.state_bytes()

    def memory(self) -> EngineMemory:
        """What the engine holds now, measured from its tensors: host bytes (page-locked on CUDA) and
        device optimizer state and buffers, by component; :func:`offload.memory.engine_memory` gives
        the same from parameter shapes alone (device state and buffers at their steady-state size)."""
        return self._mode.memory()

    def counters(self) -> dict[str, float]:
        """Running totals (benchmarks): ``host_syncs``, the engine's deliberate blocking reads of device
        data (at most one per reselection); ``host_waits``, reads of a step's landed scalars that had
        to wait for the copy (on CUDA typically the step's verdict, once per step: it waits for the
        backward pass and clipping, with the mode's kernels queued behind, so the device stays busy);
        ``reselections`` (zenflow, after the first selection) and ``windows``
        (zenflow: windows ended); ``worker_busy_seconds`` and ``worker_gil_seconds``, the CPU optimizer
        thread's time running tasks and, of that, outside GIL-free calls (an upper bound of its GIL
        hold; the names predate the thread's rename, benchmarks read them)."""
        thread = self._mode.cpu_thread
        return {
            "host_syncs": self._ops.host_syncs,
            "host_waits": self._ops.host_waits,
            "reselections": getattr(self._mode, "reselections", 0),
            "windows": getattr(self._mode, "window", 0),
            "worker_busy_seconds": thread.busy_seconds if thread is not None else 0.0,
            "worker_gil_seconds": thread.gil_seconds if thread is not None else 0.0,
        }

    def is_host_memory(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is host memory as the engine sees it: on CUDA any CPU tensor; on a CPU-only
        run (device and host the same memory) a host buffer the engine allocated (benchmarks use this
        to tell a read of landed host data from a read of device data)."""
        if self._ops.is_cuda:
            return t.device.type == "cpu"
        return self._ops.host.owns(t)

    def selection(self) -> dict[str, torch.Tensor]:
        """zenflow: the selected columns of each split 2-D weight (empty in the other modes)."""
        return self._mode.selection() if isinstance(self._mode, ZenFlowMode) else {}

    # --- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the CPU optimizer thread, release pinned host memory, unpin; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        self._idle.clear()
        self._mode.close()
        self._cores.restore()

    def __enter__(self) -> ZenFlowEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

    # --- streamed checkpoints (offload.state_io) --------------------------------------------------
    def state_views(self) -> tuple[dict[str, Any], Callable[[str], torch.Tensor]]:
        """For a checkpoint written without a copy of the state: :meth:`state_dict` holding the
        engine's own tensors (host buffers, device tensors) where it holds CPU copies, and
        :meth:`consolidated_state_dict`'s value of one parameter by name (a CPU copy of it alone). Waits for the CPU
        work in flight; both are valid until the next ``step()``/``flush()``/``load_state_dict()``."""
        self._check_open()
        self._mode.check()
        mode_state = self._mode.state_dict(copy=False)  # drains the CPU thread
        # every stream's work done (transfers into the host buffers too): the writer reads them as they are
        self._ops.synchronize()
        return self._state(mode_state), self._mode.consolidated_one
