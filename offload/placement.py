"""CPU core placement: the training thread and the CPU optimizer thread on disjoint physical cores.

The plan is computed from the Linux sysfs topology (:func:`read_topology`: logical CPUs grouped into
physical cores by ``thread_siblings_list``, NUMA nodes, NVIDIA GPUs and their ``numa_node``) and the
CPUs this process may use (:func:`plan`):

1. Per GPU process. On a host with several GPUs where this process may use every online CPU (nobody
   partitioned the host already), each GPU gets a disjoint share of the physical cores, from its own
   NUMA node when sysfs knows it (a node's cores are split evenly among the node's GPUs, in PCI bus
   order, the order of NVML and of ``CUDA_DEVICE_ORDER=PCI_BUS_ID``): every per-GPU worker process
   computes the same host-wide plan and takes its GPU's share, so the shares are disjoint without any
   coordination. A process whose affinity is already narrower keeps it as its share.
2. Inside the share, the physical cores are split by ``cpu_optimizer_cores_ratio``: the last ones
   (at least one, and at least one left) go to the CPU optimizer thread, the rest to the training
   thread; hyperthread siblings always stay together on one side.

:func:`apply` pins the CPU optimizer thread (:mod:`offload.cpu_thread`) and every other thread of
the process (the training thread, its intra-op pool) and :func:`restore` undoes it; nothing here is
fatal: where the host does not allow a placement (not Linux, one physical core, affinity calls
refused) the plan says why and the engine runs unplaced.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_NVIDIA = "0x10de"


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def format_cpulist(cpus: list[int] | tuple[int, ...]) -> str:
    """The inverse of :func:`parse_cpulist` (ranges collapsed)."""
    s = sorted(set(cpus))
    parts, i = [], 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        parts.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class Topology:
    """Physical cores (sibling groups of logical CPUs, in node then CPU order), NUMA nodes, GPUs."""

    cores: tuple[tuple[int, ...], ...]
    node_of: dict[int, int] = field(default_factory=dict)  # logical CPU -> NUMA node
    gpus: tuple[tuple[str, int], ...] = ()  # (PCI address, NUMA node or -1), in PCI bus order

    @property
    def online(self) -> frozenset[int]:
        return frozenset(c for core in self.cores for c in core)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except OSError:
        return None


def read_topology(root: Path | str = "/sys") -> Topology:
    """The host's topology from sysfs under ``root`` (a fake tree in tests). Missing files degrade:
    no sibling information = one logical CPU per core; no NUMA information = node 0."""
    root = Path(root)
    cpu_dir = root / "devices/system/cpu"
    online_text = _read(cpu_dir / "online")
    if online_text:
        online = parse_cpulist(online_text)
    else:
        online = sorted(int(p.name[3:]) for p in cpu_dir.glob("cpu[0-9]*") if p.name[3:].isdigit())
    node_of: dict[int, int] = {}
    for node in sorted((root / "devices/system/node").glob("node[0-9]*")):
        cpus = _read(node / "cpulist")
        if cpus and node.name[4:].isdigit():
            for c in parse_cpulist(cpus):
                node_of[c] = int(node.name[4:])
    seen: set[int] = set()
    cores = []
    for c in online:
        if c in seen:
            continue
        topo = cpu_dir / f"cpu{c}/topology"
        sib = _read(topo / "thread_siblings_list") or _read(topo / "core_cpus_list")
        group = tuple(x for x in (parse_cpulist(sib) if sib else [c]) if x in online) or (c,)
        seen.update(group)
        cores.append(group)
    cores.sort(key=lambda g: (node_of.get(g[0], 0), g[0]))
    gpus = []
    for dev in sorted((root / "bus/pci/devices").glob("*")):
        cls = _read(dev / "class") or ""
        if _read(dev / "vendor") == _NVIDIA and cls.startswith(("0x0300", "0x0302")):
            numa = _read(dev / "numa_node")
            gpus.append((dev.name.lower(), int(numa) if numa and numa.lstrip("-").isdigit() else -1))
    return Topology(tuple(cores), node_of, tuple(gpus))


@dataclass(frozen=True)
class Placement:
    """A plan; ``training``/``optimizer`` empty (with ``note`` saying why) when not placed."""

    training: tuple[int, ...] = ()
    optimizer: tuple[int, ...] = ()
    #: This process's share (training | optimizer).
    process: tuple[int, ...] = ()
    #: The GPU's position among the host's NVIDIA GPUs, and its NUMA node, when the share came from it.
    gpu_slot: int | None = None
    gpus: int = 0
    numa_node: int | None = None
    note: str = ""
    applied: bool = False

    @property
    def placed(self) -> bool:
        return bool(self.training and self.optimizer)

    def as_dict(self) -> dict[str, Any]:
        return {
            "placed": self.placed,
            "applied": self.applied,
            "training_cpus": format_cpulist(self.training),
            "optimizer_cpus": format_cpulist(self.optimizer),
            "process_cpus": format_cpulist(self.process),
            "gpu_slot": self.gpu_slot,
            "gpus": self.gpus,
            "numa_node": self.numa_node,
            "note": self.note,
        }

    def describe(self) -> str:
        where = ""
        if self.gpu_slot is not None:
            node = f", NUMA node {self.numa_node}" if self.numa_node is not None else ""
            where = f" (GPU {self.gpu_slot + 1} of {self.gpus}{node})"
        if self.placed:
            return (
                f"CPU placement{where}: training thread on CPUs {format_cpulist(self.training)}, "
                f"CPU optimizer on CPUs {format_cpulist(self.optimizer)}"
            )
        if self.gpu_slot is not None and self.process:
            return f"CPU placement{where}: this process on CPUs {format_cpulist(self.process)} ({self.note})"
        return f"CPU placement off: {self.note}"


def _split_even(items: list[tuple[int, ...]], parts: int, index: int) -> list[tuple[int, ...]]:
    """The ``index``-th of ``parts`` contiguous, near-equal slices of ``items``."""
    n = len(items)
    lo, hi = (index * n) // parts, ((index + 1) * n) // parts
    return items[lo:hi]


def plan(
    topo: Topology, allowed: set[int] | frozenset[int], ratio: float, gpu: str | None = None
) -> Placement:
    """The placement for a process that may run on ``allowed`` CPUs and drives GPU ``gpu`` (its PCI
    address, None on a CPU-only run); ``ratio``: the share of physical cores for the CPU optimizer."""
    cores = [tuple(c for c in core if c in allowed) for core in topo.cores]
    cores = [c for c in cores if c]
    slot, node, n_gpus = None, None, len(topo.gpus)
    addresses = [g for g, _ in topo.gpus]
    note = ""
    if gpu is not None and gpu.lower() in addresses and n_gpus > 1:
        if topo.online <= set(allowed):
            slot = addresses.index(gpu.lower())
            node_id = topo.gpus[slot][1]
            if node_id >= 0 and any(topo.node_of.get(core[0], 0) == node_id for core in cores):
                peers = [g for g, nd in topo.gpus if nd == node_id]
                local = [core for core in cores if topo.node_of.get(core[0], 0) == node_id]
                share = _split_even(local, len(peers), peers.index(gpu.lower()))
                node = node_id
            else:
                share = _split_even(cores, n_gpus, slot)
            if not share:
                return Placement(
                    gpu_slot=slot,
                    gpus=n_gpus,
                    numa_node=node,
                    note=f"no physical core left for GPU {slot + 1} of {n_gpus}",
                )
            cores = share
        else:
            note = "this process's CPUs were already restricted: they are its share"
    if len(cores) < 2:
        why = "one physical core" if cores else "no CPU"
        return Placement(
            process=tuple(c for core in cores for c in core),
            gpu_slot=slot,
            gpus=n_gpus,
            numa_node=node,
            note=f"{why}: training and optimizer cannot be kept apart",
        )
    n = len(cores)
    opt = min(n - 1, max(1, round(ratio * n)))
    training = tuple(c for core in cores[: n - opt] for c in core)
    optimizer = tuple(c for core in cores[n - opt :] for c in core)
    return Placement(training, optimizer, tuple(sorted(training + optimizer)), slot, n_gpus, node, note)


def device_pci_address(device: Any) -> str | None:
    """The sysfs PCI address (``0000:3b:00.0``) of a CUDA device, from torch's device properties."""
    try:
        import torch

        props: Any = torch.cuda.get_device_properties(device)
        bus, dev, dom = props.pci_bus_id, props.pci_device_id, props.pci_domain_id
    except Exception:
        return None
    return f"{int(dom):04x}:{int(bus):02x}:{int(dev):02x}.0"


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def apply(cpus: tuple[int, ...] | list[int], *, skip: set[int] | None = None) -> dict[int, set[int]]:
    """Pin every thread of this process but ``skip`` (native thread ids) to ``cpus``.

    Returns the masks it replaced (for :func:`restore`); raises OSError when the host refuses.
    """
    if not hasattr(os, "sched_setaffinity"):
        raise OSError("sched_setaffinity is not available on this platform")
    skip = skip or set()
    old: dict[int, set[int]] = {}
    target = set(cpus)
    for tid in _threads():
        if tid in skip:
            continue
        try:
            prev = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, target)
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            continue
        except OSError:
            restore(old, target)
            raise
        old[tid] = prev
    return old


def restore(old: dict[int, set[int]], placed: set[int] | tuple[int, ...]) -> None:
    """Undo :func:`apply`: threads still on exactly ``placed`` get their previous mask back, and
    threads started meanwhile (which inherited ``placed``) the calling thread's previous mask."""
    placed = set(placed)
    default = old.get(threading.get_native_id()) or (next(iter(old.values())) if old else None)
    for tid in _threads():
        with contextlib.suppress(OSError):
            if os.sched_getaffinity(tid) == placed:
                mask = old.get(tid, default)
                if mask is not None:
                    os.sched_setaffinity(tid, mask)
