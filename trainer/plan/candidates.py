"""The candidate settings of a plan: for each engine mode, every micro-batch size, checkpointing and
accumulator the job leaves open, with its device and host bytes and predicted step time on one rank
(:func:`candidate`), and the one :func:`best` picks. The margins and per-process constants the plan
counts with are here. With sharded weights (``JobShape.shard``) a rank holds its row shards of the
weights, gradients and optimizer state, FSDP's gather buffers, and sends their collectives' traffic
(:mod:`trainer.plan.shards`).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import NamedTuple

from contract.engine import Accumulator, EngineMode
from offload.config import EngineConfig
from trainer.plan.engine import EngineBytes, engine_bytes, engine_config
from trainer.plan.gpus import GiB, Machine
from trainer.plan.query import PlanQuery
from trainer.plan.records import PlanChoices
from trainer.plan.rollout import generation_seconds, rollout_bytes
from trainer.plan.shapes import Activations, ModelShape, activation_bytes
from trainer.plan.shards import gather_bytes, reduce_scatter_bytes, row_shards, shard_numel, traffic_bytes
from trainer.plan.speed import StepTime, step_times

#: Fraction of device memory the plan leaves free (the device reserve): the caching allocator's
#: fragmentation, cuBLAS/NCCL workspaces and kernels' temporaries the components do not list.
DEVICE_MARGIN = 0.10
#: Host memory the plan leaves to the system (the host reserve): the OS, the NVIDIA driver's own
#: allocations and a page cache for reading data and writing checkpoints. Pinned memory cannot be
#: reclaimed, so a plan that fills the host to the byte would push these out: the larger of the two.
HOST_RESERVE_FRACTION = 0.05
HOST_RESERVE_MIN_BYTES = 2 * GiB
#: Device memory outside torch's allocator: the CUDA context and library workspaces.
CUDA_RUNTIME_BYTES = 3 * GiB // 4
#: Host memory of the training process apart from the engine and the data (Python, torch, transformers).
HOST_PROCESS_BYTES = 2 * GiB
#: Largest weight file a checkpoint is sharded into (transformers' default): what loading holds at once.
WEIGHT_SHARD_BYTES = 5 * 10**9
#: Bytes per element of the largest tensor a checkpoint copies to the host at once (an fp32 master or
#: moment of a device optimizer, a weight's copy with its pending CPU columns merged in).
CHECKPOINT_TENSOR_ELEMENT_BYTES = 4
#: Host bytes of one tokenized token (its id and label as Python ints in lists).
DATA_BYTES_PER_TOKEN = 72
#: Examples assumed when the count is unknown (``batch_size: auto`` resolves to its largest, 32).
DEFAULT_NUM_EXAMPLES = 3200
MICRO_BATCH_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
#: The CPU optimizer's share of the cores the plan assumes: the engine's own default (a worker's tuning
#: may differ, ZENFLOW_ENGINE_TUNING).
CPU_OPTIMIZER_SHARE: float = EngineConfig.model_fields["cpu_optimizer_cores_ratio"].default


class Candidate(NamedTuple):
    settings: PlanChoices
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


class JobShape(NamedTuple):
    query: PlanQuery
    machine: Machine
    shape: ModelShape
    dtype_bytes: int
    #: Examples per optimizer step on one rank (the job's batch split across its ranks).
    batch: int
    seq: int
    num_examples: int
    num_tokens: int | None
    ranks: int = 1
    #: Weights sharded across the ranks (FSDP2) rather than replicated.
    shard: bool = False


#: Host components of the engine each rank holds only its 1/N shard of (the CPU optimizer state).
SHARDED_HOST = ("engine_state", "engine_accumulators")


def landing_optional(job: JobShape) -> bool:
    """Whether zenflow's landing buffers are the job's to drop: in one process, or a sharded rank's copy
    of its own rows; replicated ranks keep the gathered replica whatever is asked."""
    return job.ranks == 1 or job.shard


def engine_bytes_on_rank(
    job: JobShape, mode: EngineMode, acc: Accumulator, landing: bool = True
) -> EngineBytes:
    """The engine's bytes on one rank with the job's knobs in ``mode`` with accumulator ``acc`` and
    ``landing`` buffers (the job's own values or another candidate's): with N ranks, its shard of the CPU
    optimizer state; with sharded weights, the engine of its row shards (its device state too)."""
    config = engine_config(job.query.knobs, mode, acc, landing=landing or not landing_optional(job))
    cuda = job.machine.device_type == "cuda"
    if job.shard:
        return engine_bytes(config, row_shards(job.shape.trainable, job.ranks), job.dtype_bytes, cuda=cuda)
    eng = engine_bytes(config, job.shape.trainable, job.dtype_bytes, cuda=cuda)
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


def candidate(
    job: JobShape, mode: EngineMode, mb: int, ckpt: bool, acc: Accumulator, landing: bool = True
) -> Candidate:
    q, m, shape, e = job.query, job.machine, job.shape, job.dtype_bytes
    cuda = m.device_type == "cuda"
    eng = engine_bytes_on_rank(job, mode, acc, landing)
    # DPO (trainer.method.dpo): a pair is two rows in one forward and backward; with LoRA the reference is
    # one more forward of them without grad (a third more work), without it a table of 8 B a pair. A
    # reinforcement job's prompt is its completions' rows (trainer.plan.rollout: their sampling too)
    dpo = q.method == "dpo"
    rows = 2 if dpo else q.rollout.samples_per_prompt if q.rollout is not None else 1
    work = rows * (4 / 3 if dpo and q.lora is not None else 1.0)
    act = activation_bytes(shape, mb * rows, job.seq, e, checkpointing=ckpt)
    n = job.ranks if job.shard else 1
    params, trainable = shape.params, shape.trainable_params
    if job.shard:
        params, trainable = shard_numel(shape.weights or shape.trainable, n), shard_numel(shape.trainable, n)
    device = {"weights": params * e, "gradients": trainable * e, **eng.device}
    if job.shard:
        device["gather_buffers"] = gather_bytes(shape, e)
        device["reduce_scatter_buffer"] = reduce_scatter_bytes(shape, e)
    device["activations"] = act.peak_bytes
    if mode == "device" and e < 4:
        # device AdamW steps fp32 masters on fp32 copies of the gradients (offload.device_mode: 4 B per
        # trainable parameter, made at the step, after backward has freed the activations): the peak
        # is the larger of the two, so only the excess over the activations is added
        device["step_fp32_gradients"] = max(0, 4 * trainable - act.peak_bytes)
    if q.rollout is not None:  # sampled before the training forward: only the excess over its peak
        cache = rollout_bytes(shape, job.batch * rows, job.seq, e)
        device["rollout_kv_cache"] = max(0, cache - act.peak_bytes)
    if cuda:
        device["runtime"] = CUDA_RUNTIME_BYTES
    host = _host_bytes(job, eng, mode, dpo)
    dev_total, host_total = sum(device.values()), sum(host.values())
    if cuda:
        fits_device = dev_total <= device_capacity(m)
        fits_host = host_total <= host_capacity(m)
    else:
        fits_device = fits_host = dev_total + host_total <= host_capacity(m)
    pinned = eng.host_total if cuda else 0
    fits_locked = m.locked_memory_bytes is None or pinned <= m.locked_memory_bytes
    interval = q.knobs.update_interval
    split = eng.host_params if mode == "zenflow" else engine_bytes_on_rank(job, "zenflow", acc).host_params
    times = step_times(
        shape,
        m,
        tokens=round(job.batch * job.seq * work),
        micro_tokens=mb * job.seq * rows,
        seq=job.seq,
        checkpointing=ckpt,
        dtype_bytes=e,
        host_params={"offload": trainable, "zenflow": split},
        trainable_params=trainable,
        accumulate_on=acc,
        update_interval=None if interval == "adaptive" else int(interval),
        max_update_interval=q.knobs.max_update_interval,
        cpu_share=CPU_OPTIMIZER_SHARE,
        overlap_step=q.knobs.overlap_step,
        topk_ratio=q.knobs.topk_ratio,
        split_weights=sum(1 for w in shape.trainable if len(w.shape) == 2),
        interconnect_bytes=traffic_bytes(shape, e, n, -(-job.batch // mb)) if job.shard else 0.0,
        landing_buffers=landing or not landing_optional(job),
        host_moments=q.knobs.host_moments,
    )
    if q.rollout is not None:
        times = {k: _with_rollout(job, t) for k, t in times.items()}
    settings = PlanChoices(
        mode=mode,
        micro_batch_size=mb,
        gradient_checkpointing=ckpt,
        packing=q.packing,
        accumulate_on=acc,
        update_interval=interval,
        shard_params=job.shard,
        landing_buffers=landing or not landing_optional(job),
    )
    return Candidate(
        settings, device, host, act, times[mode], dev_total, host_total, fits_device, fits_host, fits_locked
    )


def _with_rollout(job: JobShape, t: StepTime) -> StepTime:
    """``t`` with the rollout's sampling before it (the whole step's prompts on this rank, at once)."""
    r = job.query.rollout
    assert r is not None
    gen = generation_seconds(
        job.shape,
        job.machine,
        rows=job.batch * r.samples_per_prompt,
        prompt_tokens=max(1, job.seq - r.completion_tokens),
        completion_tokens=r.completion_tokens,
        dtype_bytes=job.dtype_bytes,
    )
    step = t.step_seconds + gen
    tokens = t.tokens_per_second * t.step_seconds
    return replace(t, generation_seconds=gen, step_seconds=step, tokens_per_second=tokens / step)


def _host_bytes(job: JobShape, eng: EngineBytes, mode: EngineMode, dpo: bool) -> dict[str, int]:
    """One rank's host bytes: the engine's, loading the weights, writing a checkpoint, the tokenized data,
    the process, and a full fine-tune's DPO reference table."""
    shape, e = job.shape, job.dtype_bytes
    tokens = job.num_tokens if job.num_tokens is not None else job.num_examples * job.seq // 2
    return {
        **eng.host,
        "model_loading": min(shape.params * e, WEIGHT_SHARD_BYTES),
        "checkpoint": checkpoint_bytes(shape, e, node_ranks=job.query.resources.gpus),
        "data": tokens * DATA_BYTES_PER_TOKEN,
        "process": HOST_PROCESS_BYTES,
        **({"dpo_reference": 8 * job.num_examples} if dpo and job.query.lora is None else {}),
    }


def checkpoint_bytes(shape: ModelShape, dtype_bytes: int, *, node_ranks: int = 1) -> int:
    """The host bytes a checkpoint holds on one rank beyond the engine's state while it is written
    (trainer.run.outputs): the engine's state (zenflow's device optimizer state too) and a full
    fine-tune's weights are streamed tensor by tensor, so about the largest tensor (the embedding or the
    widest trainable weight, fp32); LoRA
    exports from a CPU copy of the whole model's weights, with the adapted ones merged, which rank 0
    alone makes: the host it shares with the ``node_ranks`` ranks of its node holds it once, so each
    rank's share of that host counts its part."""
    widest = max([w.numel for w in shape.trainable] + [shape.vocab * shape.hidden])
    largest = widest * CHECKPOINT_TENSOR_ELEMENT_BYTES
    if shape.lora_rank is not None:
        return -(-shape.params * dtype_bytes // node_ranks) + largest
    return largest


def host_reserve(m: Machine) -> int:
    """Host bytes left to the OS, driver and page cache (see ``HOST_RESERVE_FRACTION``)."""
    return min(
        m.host_memory_bytes // 2,
        max(HOST_RESERVE_MIN_BYTES, int(m.host_memory_bytes * HOST_RESERVE_FRACTION)),
    )


def host_capacity(m: Machine) -> int:
    """Host bytes the job may use: the host's memory less :func:`host_reserve`."""
    return m.host_memory_bytes - host_reserve(m)


def device_capacity(m: Machine) -> int:
    """Device bytes the job may use: the GPU's memory less ``DEVICE_MARGIN`` (a CPU machine's usable host)."""
    if m.device_type == "cpu":
        return host_capacity(m)
    return int(m.gpu_memory_bytes * (1 - DEVICE_MARGIN))


def options(job: JobShape, mode: EngineMode) -> list[tuple[int, bool, Accumulator]]:
    """The micro-batch sizes, checkpointing and accumulators to plan ``mode`` with: the job's own value of
    each, or every candidate where the plan chooses."""
    q = job.query
    mbs = (
        [min(q.micro_batch_size, job.batch)]
        if q.micro_batch_size is not None
        else sorted({min(c, job.batch) for c in MICRO_BATCH_CANDIDATES if c <= job.batch} | {job.batch})
    )
    ckpts = [q.gradient_checkpointing] if q.gradient_checkpointing is not None else [False, True]
    accs: list[Accumulator]
    if q.accumulate_on is not None:
        accs = [q.accumulate_on]
    else:  # on a CPU machine both accumulators are host memory: keep the worker doing the adds
        accs = ["host", "device"] if mode == "zenflow" and job.machine.device_type == "cuda" else ["host"]
    return list(itertools.product(mbs, ckpts, accs))


def landings(job: JobShape, mode: EngineMode) -> list[bool]:
    """zenflow's landing buffers to plan with: kept, or the job's own choice; dropped only as a fallback
    (:func:`trainer.plan.planner.plan_job` tries that when nothing fits with them)."""
    if mode != "zenflow" or job.machine.device_type != "cuda" or not landing_optional(job):
        return [True]
    return [job.query.landing_buffers if job.query.landing_buffers is not None else True]


def best(cands: list[Candidate]) -> Candidate:
    """The fastest that fits (ties: the least memory); when none does, the fastest of those that fit
    the device (the host side is then what to change), else the one needing the least device memory."""
    for good in ([c for c in cands if c.fits], [c for c in cands if c.fits_device]):
        if good:
            return min(good, key=lambda c: (round(c.time.step_seconds, 9), c.device_total + c.host_total))
    return min(cands, key=lambda c: (c.device_total, c.time.step_seconds))
