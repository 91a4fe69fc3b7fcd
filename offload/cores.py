"""The engine's CPU cores: how many go to the training thread and how many to the CPU optimizer, on
which cores (:mod:`offload.placement` plans that from the sysfs topology), and pinning the process's
threads to them until the engine closes.

Of the ``cpu_threads`` (default: the cores this process may use) the CPU optimizer gets
``round(cpu_optimizer_cores_ratio * n)`` (at least 1, and at most ``n - 1`` when ``n > 1``):
:func:`cpu_split`. With core placement (``bind_worker_cores``, zenflow) the split is made of whole
physical cores instead, the CPU thread pins itself to the optimizer's (:mod:`offload.cpu_thread`) and
:meth:`Cores.pin` pins every other thread of the process to the training's, capping torch's intra-op
thread count at the training CPUs; on a multi-GPU host every mode first takes its GPU's NUMA-local
share of the cores. :meth:`Cores.restore` undoes it all.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from offload.config import EngineConfig
from offload.cpu_thread import CPUThread, live_native_ids
from offload.placement import Placement, device_pci_address, plan, read_topology
from offload.placement import apply as apply_placement
from offload.placement import restore as restore_placement


def available_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_split(total: int, ratio: float) -> tuple[int, int]:
    """``(training_threads, optimizer_threads)`` for ``total`` cores."""
    opt = max(1, round(total * ratio))
    if total > 1:
        opt = min(opt, total - 1)
    return max(1, total - opt), opt


class Cores:
    """The core split and placement of one engine (see the module docstring).

    ``split``: ``(training, optimizer)`` thread counts; ``total``: the cores of the process's share
    (the synchronous ``offload`` mode's CPU step uses them all); ``optimizer_cores``: the cores the
    CPU thread pins itself to (None: not placed); ``placement``: what was planned and applied, or why
    nothing was.
    """

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        cores = available_cores()
        self.total = config.cpu_threads or len(cores)
        self.split = cpu_split(self.total, config.cpu_optimizer_cores_ratio)
        self.placement = _plan(config, device, cores)
        self.optimizer_cores: list[int] | None = None
        self._pin_target: tuple[int, ...] = ()
        self._pinned: dict[int, set[int]] = {}
        self._torch_threads = 0  # the training thread's torch thread count before pinning capped it
        pl = self.placement
        if config.mode == "zenflow" and pl.placed:
            self.split = (len(pl.training), len(pl.optimizer))
            self.total, self.optimizer_cores, self._pin_target = (
                len(pl.process),
                list(pl.optimizer),
                pl.training,
            )
        elif pl.gpu_slot is not None and pl.process:  # device/offload on a multi-GPU host: the GPU's share
            self.total, self._pin_target = len(pl.process), pl.process
            self.split = cpu_split(self.total, config.cpu_optimizer_cores_ratio)

    def pin(self, thread: CPUThread | None) -> None:
        """Pin the process's other threads to their cores (``thread``, the CPU optimizer's, pinned
        itself); never fatal: a refusal is noted in ``placement``."""
        if not self._pin_target:
            return
        try:
            if thread is not None and thread.pinned is False:
                raise OSError("the CPU optimizer thread could not be pinned")
            self._pinned = apply_placement(self._pin_target, skip=set(live_native_ids))
        except OSError as exc:
            self.placement = replace(self.placement, applied=False, note=f"affinity refused: {exc}")
            return
        self.placement = replace(self.placement, applied=True)
        # More intra-op threads than pinned CPUs would spin against each other (OpenMP busy-waits)
        if torch.get_num_threads() > len(self._pin_target):
            self._torch_threads = torch.get_num_threads()
            torch.set_num_threads(len(self._pin_target))

    def restore(self) -> None:
        """Every pinned thread's affinity and torch's thread count as they were before :meth:`pin`."""
        if not self._pinned:
            return
        restore_placement(self._pinned, self._pin_target)
        self._pinned = {}
        if self._torch_threads and torch.get_num_threads() == len(self._pin_target):
            torch.set_num_threads(self._torch_threads)


def _plan(cfg: EngineConfig, device: torch.device, cores: list[int]) -> Placement:
    if not cfg.bind_worker_cores:
        return Placement(note="bind_worker_cores is off")
    if not hasattr(os, "sched_setaffinity"):
        return Placement(note="this platform has no CPU affinity")
    if cfg.mode != "zenflow" and device.type != "cuda":
        return Placement(note=f"mode {cfg.mode} on the CPU has no CPU optimizer thread to keep apart")
    allowed = cores[: cfg.cpu_threads] if cfg.cpu_threads else cores
    gpu = device_pci_address(device) if device.type == "cuda" else None
    try:
        topo = read_topology()
    except (OSError, ValueError) as exc:
        return Placement(note=f"no CPU topology: {exc}")
    p = plan(topo, set(allowed), cfg.cpu_optimizer_cores_ratio, gpu)
    if cfg.mode != "zenflow":  # no CPU thread to keep apart; on a multi-GPU host the GPU's share still holds
        share = p.process if p.gpu_slot is not None else ()
        return replace(
            p,
            training=(),
            optimizer=(),
            process=share,
            note=f"mode {cfg.mode} has no CPU optimizer thread to keep apart",
        )
    return p
