"""What a worker can run, measured when it starts: :class:`WorkerCapacity`.

GPU name and memory (NVML, else torch), the number of GPUs on the host, host memory (the cgroup's
limit when lower), usable cores (the CPU affinity), the locked-memory limit (RLIMIT_MEMLOCK), our C++
CPU AdamW's throughput (a ~0.2 s timed run on a 4M-parameter buffer, all usable cores) and, on CUDA,
the pinned host->device copy rate (best of a few 128 MiB copies). The worker measures in a
subprocess (:func:`measure_in_subprocess`: ``python -m worker.capacity.measure`` prints the record as
JSON) so that its own process never imports torch nor holds a CUDA context; the record is stored with
its heartbeat (:mod:`worker.capacity.presence`, :mod:`store.worker_registry`).

:func:`to_machine` turns a record into the plan's :class:`trainer.plan.gpus.Machine`. A worker on a host
with several GPUs gets an even share of the host's memory, cores and CPU AdamW bandwidth (its peers
train at the same time), the way the engine's core placement splits the cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from store.settings import Settings
from trainer.plan.gpus import (
    KNOWN_GPUS,
    PCIE_GBPS,
    GiB,
    Machine,
    default_cpu_adam_gbps,
    find_gpu,
    host_memory_bytes,
    locked_memory_limit,
    usable_cores,
)
from worker.metrics.nvml import NVML, Nvml, nvml_index

log = logging.getLogger("zenflow.worker")

#: The CPU AdamW byte model of one parameter as the engine updates it on CUDA: read the fp32 param,
#: both fp32 moments and a bf16 gradient, write them back and a bf16 copy for the device (28 B).
ADAM_BYTES_PER_PARAM = 4 * 3 + 2 + 4 * 3 + 2
#: Parameters of the AdamW timing buffer (64 MiB touched per step: mostly beyond the CPU caches).
ADAM_PARAMS = 4 << 20
ADAM_SECONDS = 0.2
PCIE_BYTES = 128 << 20
PCIE_REPEATS = 4
#: Dense FLOP/s per streaming multiprocessor assumed for a GPU missing from trainer.plan.gpus' table (an
#: A100's rate: 312 TFLOP/s over 108 SMs), as trainer.plan.gpus.Machine.detect does.
FLOPS_PER_SM = 2.9e12
#: How long a worker waits for its measurement subprocess (importing torch and loading the C++
#: extension dominate; building it the first time on a new host can take a minute or two).
MEASURE_TIMEOUT_SECONDS = 600.0


class CapacityError(RuntimeError):
    """The capacity could not be measured."""


class WorkerCapacity(BaseModel):
    """One worker's measured capacity; stored as JSON in its ``workers`` row."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    #: ``cuda`` when jobs here train on a GPU (torch sees one), else ``cpu``.
    device_type: Literal["cuda", "cpu"]
    #: The GPU's name as NVML or torch spell it (``NVIDIA H100 80GB HBM3``); None on a CPU worker.
    gpu_name: str | None = None
    gpu_memory_bytes: int = Field(0, ge=0)
    gpu_sm_count: int | None = Field(None, ge=1)
    #: NVIDIA GPUs on this host (or container): the workers that share its memory and cores.
    gpus_on_host: int = Field(0, ge=0)
    host_memory_bytes: int = Field(gt=0)
    cores: int = Field(ge=1)
    #: RLIMIT_MEMLOCK in bytes; None = unlimited.
    locked_memory_bytes: int | None = Field(None, ge=0)
    #: Our CPU AdamW over all usable cores, GB/s of optimizer traffic (ADAM_BYTES_PER_PARAM per param).
    cpu_adam_gbps: float | None = Field(None, gt=0)
    #: Pinned host->device copies, GB/s; None without CUDA.
    pcie_gbps: float | None = Field(None, gt=0)

    def describe(self) -> str:
        """``NVIDIA H100 80GB HBM3, 79.6 GiB, 256.0 GiB of host memory, 16 cores (its share of a host
        with 8 GPUs)``: what :func:`to_machine` plans with, for messages."""
        m = to_machine(self)
        where = (
            f"{self.gpu_name}, {m.gpu_memory_bytes / GiB:.1f} GiB" if m.device_type == "cuda" else "CPU only"
        )
        text = f"{where}, {m.host_memory_bytes / GiB:.1f} GiB of host memory, {m.cores} cores"
        if m.device_type == "cuda" and self.gpus_on_host > 1:
            text += f" (its share of a host with {self.gpus_on_host} GPUs)"
        return text


def to_machine(capacity: WorkerCapacity) -> Machine:
    """The plan's :class:`~trainer.plan.gpus.Machine` for a worker of this capacity (its share of the host)."""
    share = max(1, capacity.gpus_on_host) if capacity.device_type == "cuda" else 1
    host = max(1, capacity.host_memory_bytes // share)
    cores = max(1, capacity.cores // share)
    adam = capacity.cpu_adam_gbps / share if capacity.cpu_adam_gbps else None
    locked = capacity.locked_memory_bytes
    if capacity.device_type == "cpu":
        return Machine.for_cpu(
            host_memory_bytes=host, cores=cores, cpu_adam_gbps=adam, locked_memory_bytes=locked
        )
    gpu = find_gpu(capacity.gpu_name or "")
    if gpu is not None:
        return Machine.for_gpu(
            gpu.key,
            host_memory_bytes=host,
            cores=cores,
            cpu_adam_gbps=adam,
            pcie_gbps=capacity.pcie_gbps,
            locked_memory_bytes=locked,
            gpu_memory_bytes=capacity.gpu_memory_bytes or None,
        )
    flops = capacity.gpu_sm_count * FLOPS_PER_SM if capacity.gpu_sm_count else KNOWN_GPUS["a100-80gb"].flops
    return Machine(
        gpu_name=capacity.gpu_name or "unknown GPU",
        gpu_memory_bytes=capacity.gpu_memory_bytes,
        gpu_flops=flops,
        pcie_gbps=capacity.pcie_gbps or PCIE_GBPS[4],
        host_memory_bytes=host,
        cores=cores,
        cpu_adam_gbps=adam or default_cpu_adam_gbps(cores),
        locked_memory_bytes=locked,
    )


def default_capacity(settings: Settings) -> WorkerCapacity:
    """The capacity admission assumes while no worker of a queue is registered (``ZENFLOW_DEFAULT_WORKER_*``);
    ValueError for a GPU the table does not know whose memory is not given either."""
    name = settings.default_worker_gpu.strip()
    common: dict[str, Any] = dict(
        host_memory_bytes=settings.default_worker_host_memory_bytes,
        cores=settings.default_worker_cores,
        locked_memory_bytes=settings.default_worker_locked_memory_bytes,
        cpu_adam_gbps=settings.default_worker_cpu_adam_gbps,
    )
    if not name:
        return WorkerCapacity(device_type="cpu", **common)
    gpu = find_gpu(name)
    memory = settings.default_worker_gpu_memory_bytes or (gpu.memory_bytes if gpu else None)
    if memory is None:
        raise ValueError(
            f"ZENFLOW_DEFAULT_WORKER_GPU={name!r} is not a known GPU ({', '.join(KNOWN_GPUS)}): "
            "give ZENFLOW_DEFAULT_WORKER_GPU_MEMORY_BYTES too"
        )
    return WorkerCapacity(
        device_type="cuda",
        gpu_name=name,
        gpu_memory_bytes=memory,
        gpus_on_host=1,
        pcie_gbps=settings.default_worker_pcie_gbps,
        **common,
    )


# --- measuring -----------------------------------------------------------------------------------


def measure_cpu_adam_gbps(
    *, params: int = ADAM_PARAMS, seconds: float = ADAM_SECONDS, threads: int | None = None
) -> float:
    """Our fused CPU AdamW's throughput on this host (GB/s of ADAM_BYTES_PER_PARAM per parameter): steps
    on one buffer for about ``seconds`` after a warm-up step (page faults, thread start-up)."""
    import torch

    from offload import cpu_adam

    p, m, v = (torch.zeros(params) for _ in range(3))
    g = torch.full((params,), 1e-3, dtype=torch.bfloat16)
    out = torch.empty(params, dtype=torch.bfloat16)

    def step(k: int) -> None:
        cpu_adam.adam_step(
            p,
            g,
            m,
            v,
            step=k,
            lr=1e-4,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            param_out=out,
            num_threads=threads,
        )

    step(1)
    k, t0 = 1, time.perf_counter()
    while True:
        k += 1
        step(k)
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and k > 3:
            return ADAM_BYTES_PER_PARAM * params * (k - 1) / elapsed / 1e9


def measure_pcie_gbps(*, nbytes: int = PCIE_BYTES, repeats: int = PCIE_REPEATS) -> float | None:
    """Pinned host->device copy rate of the current CUDA device (best of ``repeats``), GB/s; None
    without CUDA or when the copy fails (pinning refused, out of memory)."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = math.inf
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError and pinning failures are RuntimeErrors
        log.warning("capacity: PCIe copy test failed: %s", e)
        return None
    return nbytes / best / 1e9 if best > 0 else None


def _gpu(nvml: Nvml) -> tuple[str, int, int | None, int] | None:
    """(name, memory bytes, SM count, GPUs on the host) of the device jobs here train on; None when
    torch sees no CUDA device (jobs then train on the CPU, whatever NVML sees)."""
    import torch

    if not torch.cuda.is_available():
        if nvml.device_count():
            log.warning("capacity: NVML sees a GPU but torch has no CUDA: this worker trains on the CPU")
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    name, memory = props.name, int(props.total_memory)
    idx = nvml_index(nvml)
    if idx is not None and (found := nvml.name_and_memory(idx)) is not None:
        name, memory = found
    return name, memory, int(props.multi_processor_count), nvml.device_count() or torch.cuda.device_count()


def measure_capacity(*, nvml: Nvml | None = None, adam_seconds: float = ADAM_SECONDS) -> WorkerCapacity:
    """Measure this process's capacity (imports torch; initializes CUDA when there is a GPU)."""
    cores = usable_cores()
    gpu = _gpu(nvml or NVML)
    try:
        adam: float | None = measure_cpu_adam_gbps(seconds=adam_seconds, threads=cores)
    except Exception as e:  # the extension cannot be built here: the plan assumes a per-core rate
        log.warning("capacity: CPU AdamW timing failed: %s", e)
        adam = None
    common: dict[str, Any] = dict(
        host_memory_bytes=host_memory_bytes(),
        cores=cores,
        locked_memory_bytes=locked_memory_limit(),
        cpu_adam_gbps=adam,
    )
    if gpu is None:
        return WorkerCapacity(device_type="cpu", **common)
    name, memory, sms, count = gpu
    return WorkerCapacity(
        device_type="cuda",
        gpu_name=name,
        gpu_memory_bytes=memory,
        gpu_sm_count=sms,
        gpus_on_host=count,
        pcie_gbps=measure_pcie_gbps(),
        **common,
    )


def kept_capacity() -> WorkerCapacity:
    """:func:`measure_capacity`, or on a host without a GPU the measurement kept from an earlier start
    (:mod:`worker.capacity.cache`)."""
    from worker.capacity.cache import cached_capacity

    return cached_capacity(measure_capacity, WorkerCapacity, gpus_seen=NVML.device_count())


@cache
def local_capacity() -> WorkerCapacity:
    """This process's capacity, measured once (a job process whose worker registered none)."""
    return kept_capacity()


def measure_in_subprocess(*, timeout: float = MEASURE_TIMEOUT_SECONDS) -> WorkerCapacity:
    """:func:`measure_capacity` in ``python -m worker.capacity.measure`` (same environment, so the same
    ``CUDA_VISIBLE_DEVICES``); CapacityError when it fails."""
    cmd = [sys.executable, "-m", __name__]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ), check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CapacityError(f"capacity measurement did not finish: {e}") from e
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise CapacityError(
            f"capacity measurement failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    return WorkerCapacity.model_validate_json(lines[-1])


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.capacity.measure``: measure this host's capacity and print it as JSON."""
    p = argparse.ArgumentParser(prog="python -m worker.capacity.measure", description=main.__doc__)
    p.add_argument("--indent", type=int, default=None, help="pretty-print the JSON")
    p.add_argument("--fresh", action="store_true", help="measure again, even where one is kept")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    capacity = measure_capacity() if args.fresh else kept_capacity()
    print(json.dumps(capacity.model_dump(mode="json"), indent=args.indent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
