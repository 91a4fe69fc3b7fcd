"""The training run's set-up: data validated and tokenized, the job's resolution (trainer.resolve: the
one made at create, or a new one when the run must decide again), the model, the method and the
``offload.engine.ZenFlowEngine`` built, and the newest checkpoint restored when resuming.

Used by :mod:`trainer.run.loop`; the model is bf16 on CUDA (every engine mode keeps fp32 master weights for
its optimizer), fp32 otherwise, with LoRA through peft when the spec asks for it.

With N data-parallel ranks (a :class:`trainer.run.distributed.DistContext`) every rank loads the same data and
builds an identical replica (the model from the seed or the same folder); rank 0's resolution is broadcast
so every rank runs the same engine mode and micro-batches, and the engine gets the group. Resuming, every
rank reads rank 0's choice of checkpoint: one written by as many ranks gives each rank its own engine
shard and RNG states back (bit-exact); one written by another number of ranks (a single process counts
as one shard) hands the engine ALL shards, in rank order, to re-cut. A fresh run seeds each rank's
generators with seed + rank (dropout may differ per rank). With the resolution's ``engine.shard_params``
the replica is sharded with FSDP2 (:mod:`trainer.run.fsdp_model`) before the engine is built over each
rank's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract.hyperparameters import ResolvedHyperparameters, RuntimeChoices
from contract.job import Resolution, ResolvedJob
from trainer.data.dataset import DataOptions, Example, load_examples
from trainer.data.packing import use_packing_attention
from trainer.events import Event, LogEvent, Resolved
from trainer.graders.grading import Grading
from trainer.method import method_for
from trainer.method.base import Batching, MethodSetup, TrainingMethod
from trainer.model.lora import apply_lora
from trainer.plan.gpus import Machine
from trainer.resolve import Counts, completion_budget, example_budget, for_run
from trainer.run.checkpoint import (
    CheckpointInfo,
    checkpoint_pins,
    checkpoint_world_size,
    latest_checkpoint,
    load_rank_state,
    load_training_state,
    seed_all,
    set_rng_state,
    training_signature,
)
from trainer.run.distributed import DistContext, broadcast_object, rank_device
from trainer.run.fsdp_model import rank_memory, rank_param_bytes, reshard, shard_model
from trainer.spec import JobSpec

if TYPE_CHECKING:
    import torch

    from offload.config import EngineConfig
    from offload.engine import ZenFlowEngine
    from trainer.plan.records import Plan


class ResumeMismatchError(RuntimeError):
    """The newest checkpoint was made with different hyperparameters than the spec resolves to."""


@dataclass
class RunData:
    tokenizer: Any
    train: list[Example]
    valid: list[Example]
    #: The job's resolution this run uses (trainer.resolve).
    resolution: Resolution
    pad_id: int

    @property
    def job(self) -> ResolvedJob:
        return self.resolution.job

    @property
    def hp(self) -> ResolvedHyperparameters:
        return self.resolution.job.hyperparameters


@dataclass
class Progress:
    """Where the run stands: restored from a checkpoint on resume, advanced by the loop."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    trained_tokens: int = 0
    valid_loss: float | None = None
    last_saved: int | None = None
    last_checkpoint: str | None = None


@dataclass
class Built:
    model: Any
    engine: ZenFlowEngine
    device: torch.device
    dtype: torch.dtype
    base_config: Any
    generation_config: Any
    progress: Progress
    #: The job's method in this run (trainer.method): its micro-batches, loss and metrics.
    method: TrainingMethod
    batching: Batching
    #: torch's thread count before the engine's CPU worker took its share (restored at the end).
    restore_threads: int | None = None
    #: Embedding rows added for tokens the tokenizer gained (the LoRA adapter then saves the embeddings).
    added_tokens: int = 0
    #: The weights are sharded over the ranks with FSDP2 (trainer.run.fsdp_model).
    sharded: bool = False


def pick_device(pref: str) -> torch.device:
    """The single-process run's device (a rank's: :func:`trainer.run.distributed.rank_device`)."""
    return rank_device(None, pref)


def torch_dtype(job: ResolvedJob) -> torch.dtype:
    """The resolved parameters' dtype as torch's."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[job.dtype]


def load_data(
    spec: JobSpec,
    emit: Callable[[Event], None],
    dist: DistContext | None = None,
    *,
    resolution: Resolution | None = None,
    machine: Machine | None = None,
    resume: bool = True,
) -> RunData:
    """Validate and tokenize the training (and validation) file; the job's resolution for this run
    (rank 0's with several ranks): ``resolution`` while it holds for ``machine`` (default: this one's),
    the data's counts and the checkpoint to resume, else a new one (a :class:`~trainer.events.Resolved`
    event)."""
    from trainer.limits import model_limit_errors
    from trainer.model.catalog import load_tokenizer

    tokenizer = load_tokenizer(spec.model)
    # Checked at create too; a job created before that check (or a spec run by hand) would otherwise
    # crash mid-run (learned positions) or train past the model's limit (RoPE).
    if problems := model_limit_errors(spec):
        raise ValueError("; ".join(f"{'.'.join(e.loc)} {e.message}" for e in problems))
    options = DataOptions.of(spec.hyperparameters, spec.method.type, completion_budget(spec))
    max_len = example_budget(spec)
    train, rep = load_examples(spec.training_file, tokenizer, max_len, options)
    emit(LogEvent(rep.event_message("training"), data=rep.as_dict()))
    valid: list[Example] = []
    if spec.validation_file is not None:
        valid, vrep = load_examples(spec.validation_file, tokenizer, max_len, options)
        emit(LogEvent(vrep.event_message("validation"), data=vrep.as_dict()))
    if dist is None or dist.is_main:
        device_type = rank_device(dist, spec.device).type
        here = machine or Machine.detect("cuda" if device_type == "cuda" else "cpu")
        pins = checkpoint_pins(Path(spec.output_dir)) if resume and spec.output_dir is not None else None
        resolution = _run_resolution(spec, resolution, here, Counts(len(train), rep.num_tokens), pins, emit)
    if dist is not None:
        resolution = broadcast_object(dist, resolution)
    assert resolution is not None
    hp = resolution.job.hyperparameters
    if dist is not None and hp.batch_size < dist.world_size:
        raise ValueError(
            f"hyperparameters.batch_size ({hp.batch_size}) must be at least the job's ranks "
            f"({dist.world_size}): each optimizer step's examples are split across them"
        )
    return RunData(tokenizer, train, valid, resolution, int(tokenizer.pad_token_id))


def _run_resolution(
    spec: JobSpec,
    given: Resolution | None,
    machine: Machine,
    counts: Counts,
    pins: Any,
    emit: Callable[[Event], None],
) -> Resolution:
    """``given`` while it holds, else a new resolution, reported (the plan it took its choices from too)."""
    resolution, plan, new = for_run(spec, given, machine, counts, pins)
    if plan is not None:
        emit(plan_event(plan))
    elif new:
        emit(
            LogEvent(
                "No memory and speed plan (the model's config could not be planned); the settings the "
                "plan chooses take their defaults",
                level="warning",
            )
        )
    if new:
        changes = resolution.job.changes(given.job) if given is not None else {}
        what = "; ".join(f"{k} {v['from']} -> {v['to']}" for k, v in changes.items())
        head = "Settings decided again" if given is not None else "Settings decided for this run"
        emit(LogEvent(f"{head}: {resolution.reason}" + (f" ({what})" if what else "")))
        emit(Resolved(resolution.model_dump(mode="json"), changes))
    return resolution


def plan_event(plan: Plan) -> LogEvent:
    """The plan as a job's event (``data["plan"]``: :meth:`Plan.as_dict`): a warning when it does not fit."""
    text = plan.summary() + "".join(f". {r}" for r in plan.reasons)
    if not plan.fits:
        text += "".join(f". {'.'.join(p.loc)}: {p.message}" for p in plan.problems)
    return LogEvent(text, level="info" if plan.fits else "warning", data={"plan": plan.as_dict()})


def _checkpoint_state(
    out: Path, job: ResolvedJob, dist: DistContext | None = None
) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """The newest complete checkpoint (rank 0's pick) and its training state; refused when made with
    other hyperparameters or another method."""
    ckpt = latest_checkpoint(out) if dist is None or dist.is_main else None
    if dist is not None:
        ckpt = broadcast_object(dist, ckpt)
    if ckpt is None:
        return None
    state = load_training_state(ckpt.path)
    theirs, ours = training_signature(state), training_signature(job)
    if theirs != ours:
        raise ResumeMismatchError(
            f"{ckpt.path} was made with different hyperparameters ({theirs}) than this spec "
            f"resolves to ({ours}); start afresh (no resume) or use another output_dir"
        )
    return ckpt, state


@dataclass
class _Restore:
    """What this rank restores from a checkpoint: its engine state (a shard, or every shard to re-cut)."""

    engine: dict[str, Any] | list[dict[str, Any]]
    rng: dict[str, Any] | None
    saved_world: int

    @property
    def first(self) -> dict[str, Any]:
        """An engine state of the checkpoint (its mode and accumulator, for the engine's auto choices)."""
        return self.engine[0] if isinstance(self.engine, list) else self.engine


def _rank_restore(
    ckpt: CheckpointInfo, state: dict[str, Any], dist: DistContext | None, sharded: bool = False
) -> _Restore:
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    saved = checkpoint_world_size(state)
    if state.get("engine_dcp"):  # a sharded run's: each rank reads its rows, and its own shard file's RNG
        rng = load_rank_state(ckpt.path, rank, saved).get("rng") if rank < saved else None
        return _Restore(_dcp_engine(ckpt.path / state["engine_dcp"], state, dist, sharded), rng, saved)

    def shard(r: int) -> dict[str, Any]:
        return state if saved == 1 else load_rank_state(ckpt.path, r, saved)

    if saved == world:
        own = shard(rank)
        return _Restore(own["engine"], own.get("rng"), saved)
    shards = [shard(r) for r in range(saved)]
    rng = shards[rank].get("rng") if rank < saved else None
    return _Restore([s["engine"] for s in shards], rng, saved)


def _dcp_engine(
    folder: Path, state: dict[str, Any], dist: DistContext | None, sharded: bool
) -> dict[str, Any] | list[dict[str, Any]]:
    """This rank's engine state from a sharded checkpoint's DCP folder: its rows when ``sharded`` (the
    engine loads it as its own), else the whole parameters' (one state of one process, re-cut by the
    engine for replicated ranks)."""
    from offload.dcp_state import join_rows, load_rows

    rank, world = (dist.rank, dist.world_size) if dist is not None and sharded else (0, 1)
    group = (dist.cpu_group or dist.group) if dist is not None and sharded else None
    pieces, skeleton = load_rows(folder, rank, world, group)
    engine = {
        **state["engine_header"],
        "mode_state": join_rows(skeleton, pieces),
        "shard": {"rank": rank, "world_size": world, "row_sharded": sharded},
    }
    return engine if sharded else [engine]


def engine_config(job: ResolvedJob, lr: float, tuning: dict[str, Any]) -> EngineConfig:
    """The engine's config: the resolution's engine settings, the first learning rate, the worker's tuning."""
    from offload.config import EngineConfig

    return EngineConfig(**job.engine.model_dump(), lr=lr, **tuning)


def _make_engine(model: Any, config: EngineConfig, dist: DistContext | None) -> ZenFlowEngine:
    from offload.engine import ZenFlowEngine

    if dist is None or config.shard_params:  # sharded: the parameters carry their mesh's group
        return ZenFlowEngine(model, config)
    return ZenFlowEngine(model, config, process_group=dist.group)


@dataclass
class _Model:
    model: Any
    base_config: Any
    generation_config: Any
    added_tokens: int


def _setup_model(
    spec: JobSpec, data: RunData, device: torch.device, dtype: torch.dtype, emit: Callable[[Event], None]
) -> _Model:
    """The base model on its device with the runtime's attention and checkpointing, LoRA applied."""
    import torch

    from trainer.model.catalog import fit_to_tokenizer, load_model

    hp = data.hp
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for what still runs in fp32
    model = load_model(spec.model, dtype=dtype, seed=hp.seed, device=device)
    added_tokens = fit_to_tokenizer(model, data.tokenizer)
    base_config, generation_config = model.config, getattr(model, "generation_config", None)
    attention = apply_runtime(model, hp.runtime(), device, dtype)
    emit(
        LogEvent(
            f"Micro-batches of {hp.micro_batch_size} (batch size {hp.batch_size}); packing "
            f"{'on' if hp.packing else 'off'}; gradient checkpointing {'on' if hp.gradient_checkpointing else 'off'}; "
            f"attention {attention}",
            data={**hp.runtime().model_dump(), "attention": attention},
        )
    )
    if spec.lora is not None:
        model = apply_lora(model, spec, hp.seed)
    model.to(device)  # type: ignore[arg-type]  # mypy mis-binds transformers' wrapped Module.to
    model.train()
    return _Model(model, base_config, generation_config, added_tokens)


def _shard(model: Any, dist: DistContext | None, device: torch.device, emit: Callable[[Event], None]) -> None:
    """The replica's weights sharded over the ranks (FSDP2), reported."""
    assert dist is not None
    blocks = shard_model(model, dist, device)
    held = rank_param_bytes(model)
    emit(
        LogEvent(
            f"Weights sharded over {dist.world_size} ranks (FSDP2, {blocks} blocks): rank {dist.rank} holds "
            f"{held} bytes of parameters",
            data={"sharded": True, "blocks": blocks, "rank": dist.rank, "rank_param_bytes": held},
        )
    )


def _prepare_method(
    spec: JobSpec,
    data: RunData,
    model: Any,
    out: Path,
    batching: Batching,
    dist: DistContext | None,
    emit: Callable[[Event], None],
    grading: Grading | None = None,
) -> TrainingMethod:
    """The job's method, prepared on the base weights (before the engine or a checkpoint touches them)."""
    method = method_for(data.job.method)
    sharded = data.job.engine.shard_params
    method.prepare(
        MethodSetup(
            model,
            data.train,
            data.valid,
            out,
            batching,
            spec.model,
            spec.lora is not None,
            dist,
            sharded,
            emit,
            tokenizer=data.tokenizer,
            grading=grading or Grading(),
        )
    )
    if sharded:  # a forward without a backward (a reference pass) leaves FSDP2's root gathered
        reshard(model)
    return method


def build(
    spec: JobSpec,
    data: RunData,
    out: Path,
    *,
    resume: bool,
    emit: Callable[[Event], None],
    dist: DistContext | None = None,
    grading: Grading | None = None,
) -> Built:
    """Model on its device, the method and the engine around it, and the run's progress (restored when
    resuming). The engine is closed again when anything after its construction fails. ``grading``:
    the method's graders' sandbox limits and judge (None: the defaults, no judge)."""
    import torch

    job, hp = data.job, data.hp
    device = rank_device(dist, spec.device)
    dtype = torch_dtype(job)
    m = _setup_model(spec, data, device, dtype, emit)
    sharded = job.engine.shard_params
    if sharded:
        _shard(m.model, dist, device, emit)
    batching = Batching(hp, data.pad_id, device)
    method = _prepare_method(spec, data, m.model, out, batching, dist, emit, grading)
    found = _checkpoint_state(out, job, dist) if resume else None
    restore = _rank_restore(*found, dist, sharded) if found is not None else None
    threads = torch.get_num_threads()  # before the engine's core placement caps it
    engine = _make_engine(m.model, engine_config(job, hp.lr_at(0), spec.engine_tuning), dist)
    built = Built(
        m.model,
        engine,
        device,
        dtype,
        m.base_config,
        m.generation_config,
        Progress(),
        method,
        batching,
        added_tokens=m.added_tokens,
        sharded=sharded,
    )
    try:
        _report_engine(built, dist, emit)
        if device.type == "cpu" and engine.mode != "device":
            # The engine's CPU optimizer worker gets its share of the cores; training keeps the rest.
            built.restore_threads = threads
            torch.set_num_threads(engine.cpu_split[0])
        if found is not None and restore is not None:
            _restore(built, found, restore, hp, dist, emit)
        else:
            seed_all(hp.seed + (dist.rank if dist is not None else 0))
    except BaseException:
        release(built)
        raise
    return built


def _report_engine(built: Built, dist: DistContext | None, emit: Callable[[Event], None]) -> None:
    """The engine's core placement and memory (each rank's with ranks)."""
    engine = built.engine
    emit(LogEvent(engine.placement.describe(), data=engine.placement.as_dict()))
    mem = engine.memory()
    emit(LogEvent(engine_memory_text(mem.host_bytes, mem.params, mem.device_state_bytes), data=mem.as_dict()))
    if dist is not None:
        emit(rank_memory(dist, built.model, mem, built.device))


def _restore(
    built: Built,
    found: tuple[CheckpointInfo, dict[str, Any]],
    restore: _Restore,
    hp: ResolvedHyperparameters,
    dist: DistContext | None,
    emit: Callable[[Event], None],
) -> None:
    """The checkpoint's engine state (a list of every rank's shard is re-cut by the engine for this
    group), progress and RNG states; what makes the resumed run differ from an uninterrupted one, said."""
    ckpt, state = found
    recorded = restore.first.get("mode")
    if recorded is not None and recorded != built.engine.mode:
        raise ResumeMismatchError(
            f"{ckpt.path} was made in engine mode {recorded}; this run resolved {built.engine.mode}"
        )
    built.engine.load_state_dict(restore.engine)
    built.progress = Progress(
        step=int(state["step"]),
        losses=list(state.get("losses", [])),
        trained_tokens=int(state.get("trained_tokens", 0)),
        valid_loss=state.get("valid_loss"),
        last_saved=ckpt.step,
        last_checkpoint=str(ckpt.path),
    )
    if restore.rng is not None:
        set_rng_state(restore.rng, hp.seed)
    else:  # a rank the checkpoint did not have
        seed_all(hp.seed + (dist.rank if dist is not None else 0))
    world = dist.world_size if dist is not None else 1
    if restore.saved_world != world:
        emit(
            LogEvent(
                f"Checkpoint at step {ckpt.step} was written by {restore.saved_world} rank(s); its engine state "
                f"is re-cut for {world}: the same training up to float rounding, not bit-identical",
                data={"checkpoint_world_size": restore.saved_world, "world_size": world},
            )
        )
    theirs = ResolvedHyperparameters(**state["hyperparameters"]).runtime()
    if theirs != hp.runtime():
        emit(
            LogEvent(
                f"Resuming with {hp.runtime().model_dump()} where the checkpoint ran {theirs.model_dump()}: "
                "the same updates up to float rounding, not bit-identical",
                data={"checkpoint": theirs.model_dump()},
            )
        )
    emit(
        LogEvent(
            f"Resumed from checkpoint at step {ckpt.step}", data={"step": ckpt.step, "path": str(ckpt.path)}
        )
    )


def engine_memory_text(host_bytes: int, params: int, device_state_bytes: int) -> str:
    """``Engine memory: host 2.4 MiB (19.9 B/param), device state none``: sizes in their unit, and no
    bytes per parameter where the engine holds nothing on the host (``mode: device``)."""
    from trainer.plan.gpus import format_bytes

    host = "none" if host_bytes <= 0 else format_bytes(host_bytes)
    if host_bytes > 0 and params > 0:
        host += f" ({host_bytes / params:.1f} B/param)"
    device = "none" if device_state_bytes <= 0 else format_bytes(device_state_bytes)
    return f"Engine memory: host {host}, device state {device}"


def apply_runtime(model: Any, choices: RuntimeChoices, device: torch.device, dtype: torch.dtype) -> str:
    """Set up ``model`` (a transformers model, before peft wraps it) for the runtime choices: the
    attention implementation packing needs, activation checkpointing (non-reentrant; transformers also
    makes the embeddings' output require grad, which a LoRA model behind frozen layers needs). Returns
    the attention implementation in use."""
    attention = (
        use_packing_attention(model, device, dtype) if choices.packing else model.config._attn_implementation
    )
    if choices.gradient_checkpointing:
        enable_activation_checkpointing(model)
    return str(attention)


def enable_activation_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing under either transformers name: recent releases call it
    ``activation_checkpointing_enable`` (the old name warns), earlier ones (5.17 on the GPU image, the
    4.x floor) only ``gradient_checkpointing_enable``."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def release(built: Built) -> None:
    """Close the engine and give torch its threads back."""
    import torch

    built.engine.close()
    if built.restore_threads:
        torch.set_num_threads(built.restore_threads)
