"""Predicted optimizer-step time per engine mode: a roofline over GPU FLOPs, PCIe bytes and CPU
AdamW bytes (for :mod:`trainer.plan.planner`).

- GPU: ``6 x matmul params x tokens`` FLOPs for full fine-tuning (forward 2, backward 4; LoRA: 4, no
  weight gradients for frozen weights), plus causal attention (``6 x layers x seq x query width`` per
  token), plus one more forward (``2 x params x tokens`` and its attention) with activation
  checkpointing; divided by the GPU's dense bf16 FLOP/s times a utilization factor: ``UTILIZATION``
  (what Hugging Face Llama training with SDPA reaches on large micro-batches, ~45% of peak) scaled by
  ``N / (N + UTILIZATION_HALF_TOKENS)`` for ``N`` tokens per micro-batch (small matmuls keep the GPU
  below its roofline). The device optimizer adds its memory traffic over the device memory bandwidth.
- PCIe: bytes copied per optimizer step over the achievable pinned-copy rate.
- CPU: AdamW and accumulation bytes over the measured CPU AdamW rate (zenflow's worker gets its
  ``cpu_optimizer_cores_ratio`` share of it; offload runs on all cores).
- Interconnect (sharded weights, :mod:`trainer.plan.shards`): FSDP's all-gathers and
  reduce-scatters per step over the GPU-to-GPU bus bandwidth (``Machine.interconnect_gbps``). FSDP
  prefetches the next block while one computes, so the GPU part is the longer of the compute and the
  traffic (``bound`` says ``interconnect`` when the traffic is).

Modes combine them differently: ``device`` is the GPU alone; ``offload`` is the serial sum (the device
waits for the copies and the CPU step every step); ``zenflow`` overlaps: the CPU work and copies of a
window run while the GPU computes the next one, so a step takes the longest of the three (with
``overlap_step=False`` the window's CPU AdamW is added instead).

zenflow's own device work is charged to its GPU time (:func:`zenflow_device_bytes`): per step the
column scores and window norms read the split gradients, the selected columns' gradients and params
are gathered (``index_select`` over dim 1 of a row-major weight: scattered elements, so whole 32-byte
sectors are read), AdamW runs on the selected columns in fp32 and scatters them back
(``index_copy_``: a read-modify-write of the sectors); with ``accumulate_on=host`` the gradient is read
for its copy to the host; per window the CPU's result is merged from the landing buffer into the
weights. Strided traffic runs at ``GATHER_EFFICIENCY`` of the device bandwidth, and each split weight
costs ``ZENFLOW_KERNELS_PER_WEIGHT`` launches a step. These are estimates for choosing
settings and for admission, not promises: ``bench/gpu_check.sh`` prints planned vs measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from contract.engine import HOST_MOMENT_BYTES
from trainer.plan.gpus import Machine
from trainer.plan.shapes import ModelShape

#: Fraction of the dense bf16 peak a large micro-batch reaches (fp32 peak for a CPU machine: 0.5).
UTILIZATION = 0.45
CPU_UTILIZATION = 0.5
#: Tokens per micro-batch at which the utilization is half of ``UTILIZATION``.
UTILIZATION_HALF_TOKENS = 1024
#: Bytes AdamW moves per parameter (read fp32 param, moments and a bf16 gradient, write them and a
#: bf16 copy: the byte model bench/cpu_adam.py and the workers' measurement use).
ADAM_BYTES_PER_PARAM = 28


def adam_bytes_per_param(host_moments: str) -> int:
    """What the CPU AdamW moves per parameter with ``host_moments`` (contract.engine.HostMoments): the
    two moments are read and written in that dtype (bf16: 20 bytes)."""
    return ADAM_BYTES_PER_PARAM - 4 * (4 - HOST_MOMENT_BYTES[host_moments])


#: Bytes the fused device AdamW moves per parameter (fp32 master, moments, gradient, the bf16 copy).
DEVICE_ADAM_BYTES_PER_PARAM = 32
#: Host accumulation moves this many parameter-dtype elements per parameter and step: the streamed
#: gradient read, the window accumulator (kept in the parameter dtype, offload.memory) read and written.
ACCUMULATE_ELEMENTS_PER_PARAM = 3
#: Fraction of the device memory bandwidth that zenflow's column gathers and scatters reach (scattered
#: 2-byte elements in 32-byte sectors, index arithmetic): an estimate, bench/gpu_check.sh measures it.
GATHER_EFFICIENCY = 0.5
#: Kernel launches per split weight and step (scores, gradient and param gathers, scatter) and the cost
#: of one (launch plus a small kernel's tail).
ZENFLOW_KERNELS_PER_WEIGHT = 4
KERNEL_SECONDS = 8e-6


def zenflow_device_bytes(
    split: int, *, topk_ratio: float, dtype_bytes: int, interval: int, on_device: bool
) -> tuple[float, float]:
    """Device bytes zenflow moves per step for ``split`` split parameters, beyond forward and backward
    (see the module doc): ``(streamed, strided)``; strided bytes run at ``GATHER_EFFICIENCY``."""
    e, k = dtype_bytes, topk_ratio
    scan = split * e  # column scores / window norms read the split gradients
    stream = 0 if on_device else split * e  # the gradient read for its copy to the host
    columns = k * split * DEVICE_ADAM_BYTES_PER_PARAM  # fp32 AdamW of the selected columns
    gathered = k * split * (4 + e)  # written: fp32 gradient columns, param columns
    merge = 3 * split * e / interval  # landing read, weights read and written (per window)
    strided = 2 * split * e + 2 * split * e  # gathers read the sectors; the scatter reads and writes them
    return scan + stream + columns + gathered + merge, strided


@dataclass(frozen=True)
class StepTime:
    """One mode's predicted optimizer step: its parts and the total (seconds)."""

    mode: str
    gpu_seconds: float
    pcie_seconds: float
    cpu_seconds: float
    step_seconds: float
    tokens_per_second: float
    #: What bounds the step: ``gpu``, ``pcie`` or ``cpu``.
    bound: str
    #: zenflow: the window length the prediction assumes.
    update_interval: int | None = None
    #: Sharded weights: the collectives' seconds per step (overlapped with the compute).
    interconnect_seconds: float = 0.0
    #: A reinforcement job: the rollout's sampling before the step (included in ``step_seconds``).
    generation_seconds: float = 0.0


def matmul_params(shape: ModelShape) -> int:
    """Parameters that take part in matmuls (embedding lookups and norms do not)."""
    embed = shape.modules.get("embeddings", 0)
    tied = "lm_head" not in shape.modules
    return max(0, shape.params - (0 if tied else embed) - shape.modules.get("final_norm", 0))


def compute_seconds(
    shape: ModelShape, machine: Machine, *, tokens: int, micro_tokens: int, seq: int, checkpointing: bool
) -> float:
    """GPU seconds of forward and backward for ``tokens`` tokens in micro-batches of ``micro_tokens``."""
    p = matmul_params(shape)
    attn = 2 * shape.num_layers * seq * shape.heads * shape.head_dim  # forward, per token (causal)
    lora = shape.lora_rank is not None
    passes = (2 if lora else 3) + (1 if checkpointing else 0)  # forward-equivalents per step
    flops = passes * (2 * p + attn) * tokens
    util = CPU_UTILIZATION if machine.device_type == "cpu" else UTILIZATION
    util *= micro_tokens / (micro_tokens + UTILIZATION_HALF_TOKENS)
    return flops / (machine.gpu_flops * util)


def step_times(
    shape: ModelShape,
    machine: Machine,
    *,
    tokens: int,
    micro_tokens: int,
    seq: int,
    checkpointing: bool,
    dtype_bytes: int,
    host_params: dict[str, int],
    accumulate_on: str,
    update_interval: int | None,
    max_update_interval: int,
    cpu_share: float,
    overlap_step: bool,
    topk_ratio: float,
    split_weights: int = 0,
    interconnect_bytes: float = 0.0,
    trainable_params: int | None = None,
    landing_buffers: bool = True,
    host_moments: str = "fp32",
) -> dict[str, StepTime]:
    """Predicted step time of each mode. ``host_params``: parameters the CPU updates per mode
    (offload: all trainable, zenflow: the split weights); ``update_interval`` None: the shortest
    window that hides the CPU work (at most ``max_update_interval``: the engine's ``adaptive``);
    ``interconnect_bytes``: what a rank sends per step with sharded weights; ``trainable_params``: the
    trainable parameters this rank's device optimizer updates (default: all of the model's);
    ``landing_buffers`` False: zenflow's merge uploads each window's CPU result while the GPU waits;
    ``host_moments``: the CPU optimizer's moment dtype (its bytes moved per parameter)."""
    trainable = shape.trainable_params if trainable_params is None else trainable_params
    compute = compute_seconds(
        shape, machine, tokens=tokens, micro_tokens=micro_tokens, seq=seq, checkpointing=checkpointing
    )
    roof = _Roofline(
        machine,
        tokens=tokens,
        compute=compute,
        link=interconnect_bytes / (machine.interconnect_gbps * 1e9),
        dtype_bytes=dtype_bytes,
        adam_bytes=adam_bytes_per_param(host_moments),
    )
    split = host_params.get("zenflow", 0)
    zenflow = _Zenflow(
        roof,
        split=split,
        full=trainable - split,
        worker=roof.adam * cpu_share,
        on_device=accumulate_on == "device",
        topk_ratio=topk_ratio,
        split_weights=split_weights,
    )
    interval = zenflow.interval(update_interval, max_update_interval)
    return {
        "device": roof.device(trainable),
        "offload": roof.offload(host_params.get("offload", trainable)),
        "zenflow": zenflow.step(interval, overlap_step=overlap_step, landing_buffers=landing_buffers),
    }


@dataclass(frozen=True)
class _Roofline:
    """One machine's rates for one job's step: GPU compute, the interconnect, device memory, PCIe and
    the CPU AdamW, each in units per second."""

    machine: Machine
    tokens: int
    compute: float
    link: float
    dtype_bytes: int
    #: bytes the CPU AdamW moves per parameter (adam_bytes_per_param)
    adam_bytes: int = ADAM_BYTES_PER_PARAM

    @property
    def gpu(self) -> float:
        """The GPU part: the compute, or the sharded weights' collectives when they take longer."""
        return max(self.compute, self.link)

    @property
    def hbm(self) -> float:
        return self.machine.gpu_memory_gbps * 1e9

    @property
    def pcie(self) -> float:
        return self.machine.pcie_gbps * 1e9

    @property
    def adam(self) -> float:
        return self.machine.cpu_adam_gbps * 1e9

    def time(
        self, mode: str, g: float, p: float, c: float, total: float, interval: int | None = None
    ) -> StepTime:
        parts = {"interconnect" if self.link > self.compute else "gpu": g, "pcie": p, "cpu": c}
        return StepTime(
            mode,
            g,
            p,
            c,
            total,
            self.tokens / total if total > 0 else math.inf,
            max(parts, key=lambda k: parts[k]),
            interval,
            self.link,
        )

    def device(self, trainable: int) -> StepTime:
        g_dev = self.gpu + trainable * DEVICE_ADAM_BYTES_PER_PARAM / self.hbm
        return self.time("device", g_dev, 0.0, 0.0, g_dev)

    def offload(self, n_off: int) -> StepTime:
        """Every step serial: the gradients down and the params up over PCIe, the CPU's AdamW."""
        p_off = 2 * n_off * self.dtype_bytes / self.pcie
        c_off = n_off * self.adam_bytes / self.adam
        return self.time("offload", self.gpu, p_off, c_off, self.gpu + p_off + c_off)


@dataclass(frozen=True)
class _Zenflow:
    """zenflow's step: ``split`` parameters on the CPU worker (``worker`` bytes/s), ``full`` on the device."""

    roof: _Roofline
    split: int
    full: int
    worker: float
    on_device: bool
    topk_ratio: float
    split_weights: int

    def parts(self, interval: int) -> tuple[float, float, float]:
        """GPU, PCIe and CPU seconds per step with windows of ``interval`` steps."""
        roof, split, dtype_bytes, hbm = self.roof, self.split, self.roof.dtype_bytes, self.roof.hbm
        streamed, strided = zenflow_device_bytes(
            split,
            topk_ratio=self.topk_ratio,
            dtype_bytes=dtype_bytes,
            interval=interval,
            on_device=self.on_device,
        )
        g = roof.gpu + self.full * DEVICE_ADAM_BYTES_PER_PARAM / hbm
        if split and roof.machine.device_type == "cuda":
            g += streamed / hbm + strided / (hbm * GATHER_EFFICIENCY)
            g += self.split_weights * ZENFLOW_KERNELS_PER_WEIGHT * KERNEL_SECONDS
        if self.on_device:  # an fp32 add on the device per step; per window the accumulator goes down
            g += split * (dtype_bytes + 8) / hbm  # rounded to the param dtype, the new params come up
            p = split * 2 * dtype_bytes / interval / roof.pcie
            c = split * roof.adam_bytes / interval / self.worker
        else:  # every step's gradient crosses PCIe and is added on the CPU
            p = split * dtype_bytes * (1 + 1 / interval) / roof.pcie
            c = (
                split
                * (ACCUMULATE_ELEMENTS_PER_PARAM * dtype_bytes + roof.adam_bytes / interval)
                / self.worker
            )
        return g, p, c

    def interval(self, update_interval: int | None, max_update_interval: int) -> int:
        """The window: the one asked for, else the shortest that hides PCIe and CPU behind the GPU."""
        if update_interval is not None:
            return update_interval
        for i in range(1, max_update_interval + 1):
            g, p, c = self.parts(i)
            if max(p, c) <= g:
                return i
        return max_update_interval

    def step(self, interval: int, *, overlap_step: bool, landing_buffers: bool) -> StepTime:
        split, worker, roof = self.split, self.worker, self.roof
        g, p, c = self.parts(interval)
        if overlap_step:
            total = max(g, p, c)
        else:  # the boundary waits for the window's CPU AdamW
            total = max(g, p, c - split * roof.adam_bytes / interval / worker) + (
                split * roof.adam_bytes / interval / worker
            )
        if (
            not landing_buffers and roof.machine.device_type == "cuda"
        ):  # the result comes up at the boundary, waited for
            total += split * roof.dtype_bytes / interval / roof.pcie
        return roof.time("zenflow", g, p, c, total, interval)
