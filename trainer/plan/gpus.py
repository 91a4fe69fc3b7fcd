"""Machines a job can run on: the known-GPU table and :class:`Machine`, what the plan
(:mod:`trainer.plan.planner`) needs to know of a host.

The table's figures are the vendors' data-sheet numbers: dense bf16 tensor-core FLOP/s (no
sparsity), the memory ``torch.cuda.get_device_properties(...).total_memory`` reports, the HBM/GDDR
bandwidth, and the host link's PCIe generation. A PCIe generation becomes the *achievable* copy rate
of page-locked memory over an x16 link (about 80% of the raw rate: 25 GB/s for gen 4, 50 for gen 5).
``interconnect_gbps`` is the GPU-to-GPU link a job's ranks share inside one box (NVLink on SXM boards,
else PCIe peer copies): the bus bandwidth NCCL's all-gather and reduce-scatter reach per GPU (about
80% of one direction's raw rate: NVLink 4, 450 GB/s a direction on an H100/H200 SXM, reaches ~360),
what sharded weights cost per step (:mod:`trainer.plan.speed`).

Each row also names the *typical host* of one such GPU (:class:`Host`): its share of the usual server's
physical cores, memory and memory bandwidth (a DGX H100/H200 is 2 x 56 cores, 2 TiB of DDR5-4800 on 16
channels, for 8 GPUs). A plan for a named GPU (``zenflow plan --gpu h200``) uses that host for every
figure not given (flags) or measured (a registered worker's capacity), and says which were assumed
(:attr:`Machine.sources`). ``bash bench/gpu_check.sh`` prints a box's measured figures to give instead.

This module does not import torch (the API builds machines when it admits a job);
:meth:`Machine.detect` does.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

GiB = 1 << 30
MiB = 1 << 20
GB = 10**9

#: Achievable pinned host <-> device copy rate (bytes/s) over an x16 link, per PCIe generation.
PCIE_GBPS: dict[int, float] = {3: 12.0, 4: 25.0, 5: 50.0, 6: 100.0}

#: CPU AdamW throughput (GB/s of optimizer traffic: about 30 bytes per fp32 parameter updated) of our
#: C++ kernel per physical core, and its ceiling (memory bandwidth of a socket), used when the machine's
#: own figure was not measured (``python -m bench.cpu_adam`` measures it; workers measure it at start).
CPU_ADAM_GBPS_PER_CORE = 2.5
CPU_ADAM_GBPS_CEILING = 60.0
#: Dense fp32 FLOP/s of one CPU core (AVX-512 / AVX2 FMA at realistic clocks): the "GPU" of CPU runs.
CPU_FLOPS_PER_CORE = 5e10
#: Fraction of a host's memory bandwidth CPU AdamW (a streaming, memory-bound kernel) reaches: STREAM
#: triad on a loaded socket reaches 60-80% of the DDR peak; the AdamW ceiling of a typical host.
ADAM_BANDWIDTH_SHARE = 0.6


class Host(BaseModel):
    """One GPU's share of the server it usually sits in (the assumed host of a named GPU)."""

    model_config = ConfigDict(frozen=True)

    cores: int  # physical cores
    memory_bytes: int
    memory_gbps: float  # DDR peak bandwidth
    #: The server the share is of (for the plan's output).
    example: str


class GPU(BaseModel):
    """One row of the known-GPU table."""

    model_config = ConfigDict(frozen=True)

    key: str
    #: Words of ``torch.cuda.get_device_name()`` / NVML's name that identify it (lower case).
    names: tuple[str, ...]
    flops: float  # dense bf16 tensor FLOP/s
    memory_bytes: int
    memory_gbps: float  # device memory bandwidth, GB/s
    pcie_gen: int
    host: Host
    #: Achievable GPU-to-GPU bus bandwidth per GPU (GB/s, see the module doc) and the link's name.
    interconnect_gbps: float
    interconnect: str

    @property
    def pcie_gbps(self) -> float:
        return PCIE_GBPS[self.pcie_gen]


_DGX_H = Host(
    cores=14,
    memory_bytes=256 * GiB,
    memory_gbps=76.8,
    example="DGX H100/H200: 2 x 56 cores, 2 TiB DDR5-4800, 8 GPUs",
)
KNOWN_GPUS: dict[str, GPU] = {
    g.key: g
    for g in (
        GPU(
            key="a100-40gb",
            names=("a100-sxm4-40gb", "a100-pcie-40gb", "a100 40gb"),
            flops=312e12,
            memory_bytes=40_536 * MiB,
            memory_gbps=1555,
            pcie_gen=4,
            interconnect_gbps=240.0,
            interconnect="NVLink 3",
            host=Host(
                cores=16,
                memory_bytes=128 * GiB,
                memory_gbps=51.2,
                example="DGX A100 320GB: 2 x 64 cores, 1 TiB DDR4-3200, 8 GPUs",
            ),
        ),
        GPU(
            key="a100-80gb",
            names=("a100-sxm4-80gb", "a100 80gb pcie", "a100-pcie-80gb", "a100 80gb", "a100"),
            flops=312e12,
            memory_bytes=81_051 * MiB,
            memory_gbps=2039,
            pcie_gen=4,
            interconnect_gbps=240.0,
            interconnect="NVLink 3",
            host=Host(
                cores=16,
                memory_bytes=256 * GiB,
                memory_gbps=51.2,
                example="DGX A100 640GB: 2 x 64 cores, 2 TiB DDR4-3200, 8 GPUs",
            ),
        ),
        GPU(
            key="h100",
            names=("h100",),
            flops=989e12,
            memory_bytes=81_559 * MiB,
            memory_gbps=3350,
            pcie_gen=5,
            interconnect_gbps=360.0,
            interconnect="NVLink 4",
            host=_DGX_H,
        ),
        GPU(
            key="h200",
            names=("h200",),
            flops=989e12,
            memory_bytes=143_771 * MiB,
            memory_gbps=4800,
            pcie_gen=5,
            interconnect_gbps=360.0,
            interconnect="NVLink 4",
            host=_DGX_H,
        ),
        GPU(
            key="l40s",
            names=("l40s",),
            flops=362e12,
            memory_bytes=46_068 * MiB,
            memory_gbps=864,
            pcie_gen=4,
            interconnect_gbps=20.0,
            interconnect="PCIe gen 4 peer",
            host=Host(
                cores=12,
                memory_bytes=192 * GiB,
                memory_gbps=51.2,
                example="g6e.48xlarge: 96 cores, 1.5 TiB DDR4-3200, 8 GPUs",
            ),
        ),
        GPU(
            key="l4",
            names=("l4",),
            flops=121e12,
            memory_bytes=23_034 * MiB,
            memory_gbps=300,
            pcie_gen=4,
            interconnect_gbps=20.0,
            interconnect="PCIe gen 4 peer",
            host=Host(
                cores=4,
                memory_bytes=32 * GiB,
                memory_gbps=25.6,
                example="g2-standard-8 / g6.2xlarge: 4 cores, 32 GiB, 1 GPU",
            ),
        ),
        GPU(
            key="rtx4090",
            names=("rtx 4090", "rtx4090"),
            flops=165e12,
            memory_bytes=24_564 * MiB,
            memory_gbps=1008,
            pcie_gen=4,
            interconnect_gbps=20.0,
            interconnect="PCIe gen 4 peer",
            host=Host(
                cores=16,
                memory_bytes=64 * GiB,
                memory_gbps=83.2,
                example="workstation: 16 cores, 64 GiB dual-channel DDR5-5200, 1 GPU",
            ),
        ),
    )
}
#: Names that stand for several rows: ``--gpu a100`` is refused with the variants listed.
AMBIGUOUS: dict[str, tuple[str, ...]] = {"a100": ("a100-40gb", "a100-80gb")}
#: Aliases accepted by :func:`find_gpu` besides the keys.
_ALIASES = {
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "4090": "rtx4090",
    "rtx-4090": "rtx4090",
    "h100-80gb": "h100",
    "h200-141gb": "h200",
}


def find_gpu(name: str) -> GPU | None:
    """The table row for a key (``h200``), an alias, or a device name as torch or NVML spell it
    (``NVIDIA H100 80GB HBM3``); None when unknown or ambiguous (``a100``: :func:`gpu_named`)."""
    key = name.strip().lower()
    if key in AMBIGUOUS:
        return None
    if key in KNOWN_GPUS:
        return KNOWN_GPUS[key]
    if key in _ALIASES:
        return KNOWN_GPUS[_ALIASES[key]]
    key = re.sub(r"\s+", " ", key)
    for gpu in KNOWN_GPUS.values():  # the table lists the more specific names first (A100 40 before 80)
        if any(re.search(rf"(?<![a-z0-9]){re.escape(n)}(?![a-z0-9])", key) for n in gpu.names):
            return gpu
    return None


def gpu_named(name: str) -> GPU:
    """The table row ``name`` names (as :func:`find_gpu`); ValueError naming the variants of an
    ambiguous name (``a100``) or the known rows of an unknown one."""
    key = name.strip().lower()
    if key in AMBIGUOUS:
        raise ValueError(f"ambiguous GPU {name!r}: say which, one of {', '.join(AMBIGUOUS[key])}")
    gpu = find_gpu(name)
    if gpu is None:
        raise ValueError(f"unknown GPU {name!r}: known are {', '.join(KNOWN_GPUS)}")
    return gpu


def default_cpu_adam_gbps(cores: int, memory_gbps: float | None = None) -> float:
    """CPU AdamW throughput assumed for ``cores`` physical cores when it was not measured: per core,
    up to ``ADAM_BANDWIDTH_SHARE`` of the host's memory bandwidth when known, else the ceiling."""
    ceiling = CPU_ADAM_GBPS_CEILING if memory_gbps is None else ADAM_BANDWIDTH_SHARE * memory_gbps
    return min(ceiling, CPU_ADAM_GBPS_PER_CORE * max(1, cores))


class Sources(BaseModel):
    """Where each of a machine's figures came from: ``measured``, ``given`` or ``assumed (...)``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host_memory: str | None = None
    cores: str | None = None
    cpu_adam: str | None = None
    pcie: str | None = None
    gpu_memory: str | None = None

    def items(self) -> list[tuple[str, str]]:
        """The recorded ones, in field order."""
        return [(k, v) for k, v in self.model_dump().items() if v is not None]


class Machine(BaseModel):
    """What the plan knows of the machine a job runs on (one GPU of it, or the CPU)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    #: ``cuda``: a GPU with its own memory; ``cpu``: the model trains in host memory (device bytes
    #: and host bytes both come out of ``host_memory_bytes``).
    device_type: Literal["cuda", "cpu"] = "cuda"
    gpu_name: str
    gpu_memory_bytes: int = Field(ge=0)
    gpu_flops: float = Field(gt=0)  # dense bf16 FLOP/s (fp32 for a CPU)
    gpu_memory_gbps: float = Field(1000.0, gt=0)  # device memory bandwidth (the device optimizer's roofline)
    pcie_gbps: float = Field(gt=0)
    #: GPU-to-GPU bus bandwidth a rank reaches in NCCL's collectives (GB/s; the GPU table's, PCIe peer
    #: copies for an unknown GPU); on a CPU machine gloo's over shared memory.
    interconnect_gbps: float = Field(PCIE_GBPS[4] * 0.8, gt=0)
    host_memory_bytes: int = Field(gt=0)
    cores: int = Field(ge=1)
    cpu_adam_gbps: float = Field(gt=0)
    #: RLIMIT_MEMLOCK in bytes (page-locked host buffers); None = unlimited.
    locked_memory_bytes: int | None = Field(None, ge=0)
    #: Where each figure came from (None: not recorded).
    sources: Sources = Field(default_factory=lambda: Sources())

    @classmethod
    def for_gpu(
        cls,
        name: str,
        *,
        host_memory_bytes: int | None = None,
        cores: int | None = None,
        cpu_adam_gbps: float | None = None,
        pcie_gbps: float | None = None,
        locked_memory_bytes: int | None = None,
        gpu_memory_bytes: int | None = None,
        source: str = "given",
    ) -> Machine:
        """A machine with a known GPU (a table key, alias or device name; ValueError if unknown or
        ambiguous). Host figures not given are the GPU's typical host's (:class:`Host`), marked
        ``assumed`` in :attr:`sources`; the given ones are marked ``source``."""
        gpu = gpu_named(name)
        host = gpu.host
        typical = f"assumed (typical {gpu.key} host, {host.example})"
        sources = Sources(
            host_memory=source if host_memory_bytes else typical,
            cores=source if cores else typical,
            cpu_adam=source if cpu_adam_gbps else f"assumed ({CPU_ADAM_GBPS_PER_CORE:g} GB/s per core)",
            pcie=source if pcie_gbps else f"assumed (PCIe gen {gpu.pcie_gen} x16)",
            gpu_memory=source if gpu_memory_bytes else "GPU table",
        )
        n = cores or host.cores
        return cls(
            gpu_name=gpu.key,
            gpu_memory_bytes=gpu_memory_bytes or gpu.memory_bytes,
            gpu_flops=gpu.flops,
            gpu_memory_gbps=gpu.memory_gbps,
            pcie_gbps=pcie_gbps or gpu.pcie_gbps,
            interconnect_gbps=gpu.interconnect_gbps,
            host_memory_bytes=host_memory_bytes or host.memory_bytes,
            cores=n,
            cpu_adam_gbps=cpu_adam_gbps or default_cpu_adam_gbps(n, None if cores else host.memory_gbps),
            locked_memory_bytes=locked_memory_bytes,
            sources=sources,
        )

    @classmethod
    def for_cpu(
        cls,
        *,
        host_memory_bytes: int,
        cores: int,
        cpu_adam_gbps: float | None = None,
        locked_memory_bytes: int | None = None,
        source: str = "given",
    ) -> Machine:
        """A CPU-only machine: the model, its gradients and activations live in host memory too."""
        adam = cpu_adam_gbps or default_cpu_adam_gbps(cores)
        sources = Sources(
            host_memory=source,
            cores=source,
            cpu_adam=source if cpu_adam_gbps else f"assumed ({CPU_ADAM_GBPS_PER_CORE:g} GB/s per core)",
        )
        return cls(
            device_type="cpu",
            gpu_name="cpu",
            gpu_memory_bytes=0,
            gpu_flops=CPU_FLOPS_PER_CORE * cores,
            gpu_memory_gbps=adam,
            pcie_gbps=adam,
            interconnect_gbps=adam,
            host_memory_bytes=host_memory_bytes,
            cores=cores,
            cpu_adam_gbps=adam,
            locked_memory_bytes=locked_memory_bytes,
            sources=sources,
        )

    @classmethod
    def detect(cls, device_type: Literal["cuda", "cpu"] | None = None) -> Machine:
        """This process's machine: the current CUDA device (when there is one and ``device_type`` is
        not ``cpu``) or the CPU, with table figures for what is not measured here."""
        import torch

        host, cores, locked = host_memory_bytes(), usable_cores(), locked_memory_limit()
        if device_type != "cpu" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            gpu = find_gpu(props.name)
            if gpu is not None:
                return cls.for_gpu(
                    gpu.key,
                    host_memory_bytes=host,
                    cores=cores,
                    locked_memory_bytes=locked,
                    gpu_memory_bytes=int(props.total_memory),
                    source="measured",
                )
            # an unknown GPU: its memory is known; FLOPs from the SM count at an A100-like rate per SM
            return cls(
                gpu_name=props.name,
                gpu_memory_bytes=int(props.total_memory),
                gpu_flops=props.multi_processor_count * 2.9e12,
                pcie_gbps=PCIE_GBPS[4],
                host_memory_bytes=host,
                cores=cores,
                cpu_adam_gbps=default_cpu_adam_gbps(cores),
                locked_memory_bytes=locked,
                sources=Sources(host_memory="measured", cores="measured", gpu_memory="measured"),
            )
        return cls.for_cpu(host_memory_bytes=host, cores=cores, locked_memory_bytes=locked, source="measured")


def host_memory_bytes() -> int:
    """Physical memory of this host (bytes), or the cgroup's limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def usable_cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def locked_memory_limit() -> int | None:
    """RLIMIT_MEMLOCK (bytes), None when unlimited or unknown."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def format_bytes(n: float) -> str:
    """``126.4 GiB``, ``512.0 MiB``, ``3.0 KiB``, ``12 B``: binary units, one decimal."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int:
    """``128GiB``, ``120 GB``, ``512MiB``, ``1T`` or a plain number of bytes -> bytes (ValueError)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?)b?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 128GiB, 120GB, 512MiB)")
    value, unit, binary = float(m.group(1)), m.group(2), m.group(3)
    power = "kmgtp".index(unit) + 1 if unit else 0
    # a bare unit letter (128G) is binary, as ulimit and free print them
    base = 1024 if binary or (unit and not text.lower().rstrip().endswith("b")) else 1000
    return int(value * base**power)
