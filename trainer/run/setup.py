"""The training run's set-up: data validated and tokenized, hyperparameters resolved, the model and the
``offload.engine.ZenFlowEngine`` built, and the newest checkpoint restored when resuming.

Used by :mod:`trainer.run.loop`; the model is bf16 on CUDA (every engine mode keeps fp32 master weights for
its optimizer), fp32 otherwise, with LoRA through peft when the spec asks for it.

With N data-parallel ranks (a :class:`trainer.run.distributed.DistContext`) every rank loads the same data and
builds an identical replica (the model from the seed or the same folder); rank 0's resolved
hyperparameters and plan are broadcast so every rank runs the same engine mode and micro-batches, and the
engine gets the group. Resuming, every rank reads rank 0's choice of checkpoint: one written by as many
ranks gives each rank its own engine shard and RNG states back (bit-exact); one written by another
number of ranks (a single process counts as one shard) hands the engine ALL shards, in rank order, to
re-cut. A fresh run seeds each rank's generators with seed + rank (dropout may differ per rank).
With ``engine.shard_params`` resolved on (:mod:`trainer.run.sharding`) the replica is then sharded with
FSDP2 before the engine is built over each rank's rows; such a checkpoint resumes on as many ranks only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.data.dataset import DataOptions, Example, load_examples
from trainer.data.packing import use_packing_attention
from trainer.events import Event, LogEvent
from trainer.model.lora import apply_lora
from trainer.plan.in_run import engine_choices, plan_for_run, planned_runtime
from trainer.plan.planner import Plan
from trainer.run.checkpoint import (
    CheckpointInfo,
    checkpoint_world_size,
    latest_checkpoint,
    load_rank_state,
    load_training_state,
    seed_all,
    set_rng_state,
)
from trainer.run.distributed import DistContext, broadcast_object, rank_device
from trainer.run.sharding import rank_memory, rank_param_bytes, reshard, resolve_shard_params, shard_model
from trainer.runtime import RuntimeChoices
from trainer.spec import JobSpec, ResolvedHyperparameters

if TYPE_CHECKING:
    import torch

    from offload.engine import ZenFlowEngine


class ResumeMismatchError(RuntimeError):
    """The newest checkpoint was made with different hyperparameters than the spec resolves to."""


@dataclass
class RunData:
    tokenizer: Any
    train: list[Example]
    valid: list[Example]
    hp: ResolvedHyperparameters
    pad_id: int
    #: The memory and speed plan on this machine (None when it could not be made): trainer.plan.in_run.
    plan: Plan | None = None


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
    #: torch's thread count before the engine's CPU worker took its share (restored at the end).
    restore_threads: int | None = None
    #: Embedding rows added for tokens the tokenizer gained (the LoRA adapter then saves the embeddings).
    added_tokens: int = 0
    #: A full fine-tuning DPO job's reference log-probabilities by set (trainer.run.dpo.reference_table).
    reference: dict[str, torch.Tensor] | None = None
    #: The weights are sharded over the ranks with FSDP2 (trainer.run.sharding).
    sharded: bool = False


def pick_device(pref: str) -> torch.device:
    """The single-process run's device (a rank's: :func:`trainer.run.distributed.rank_device`)."""
    return rank_device(None, pref)


def pick_dtype(spec: JobSpec, device: torch.device) -> torch.dtype:
    import torch

    if spec.dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    # bf16 params on CUDA in every mode (each keeps fp32 master weights for its optimizer), so the
    # device baseline is compared with offload/zenflow at the same compute precision.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_data(spec: JobSpec, emit: Callable[[Event], None], dist: DistContext | None = None) -> RunData:
    """Validate and tokenize the training (and validation) file; resolve the hyperparameters (rank 0's
    with several ranks)."""
    from trainer.limits import model_limit_errors
    from trainer.model.catalog import load_tokenizer, model_max_length

    tokenizer = load_tokenizer(spec.model)
    # Checked at create too; a job created before that check (or a spec run by hand) would otherwise
    # crash mid-run (learned positions) or train past the model's limit (RoPE).
    if problems := model_limit_errors(spec):
        raise ValueError("; ".join(f"{'.'.join(e.loc)} {e.message}" for e in problems))
    # max_seq_length does not depend on the example count: resolve it for the length checks.
    max_len = spec.hyperparameters.resolve(
        1, base_learning_rate=1.0, model_max_length=model_max_length(spec.model)
    ).max_seq_length
    options = DataOptions.of(spec.hyperparameters)  # truncation, system_message
    train, rep = load_examples(spec.training_file, tokenizer, max_len, options)
    emit(LogEvent(rep.event_message("training"), data=rep.as_dict()))
    valid: list[Example] = []
    if spec.validation_file is not None:
        valid, vrep = load_examples(spec.validation_file, tokenizer, max_len, options)
        emit(LogEvent(vrep.event_message("validation"), data=vrep.as_dict()))
    plan = plan_for_run(
        spec,
        rank_device(dist, spec.device).type,
        num_examples=len(train),
        num_tokens=rep.num_tokens,
        emit=emit,
    )
    hp = spec.resolve(len(train), planned_runtime(plan))
    if dist is not None:
        hp, plan = broadcast_object(dist, (hp, plan))
        if hp.batch_size < dist.world_size:
            raise ValueError(
                f"hyperparameters.batch_size ({hp.batch_size}) must be at least the job's ranks "
                f"(resources.gpus = {dist.world_size}): each optimizer step's examples are split across them"
            )
    return RunData(tokenizer, train, valid, hp, int(tokenizer.pad_token_id), plan)


def _checkpoint_state(
    out: Path, hp: ResolvedHyperparameters, dist: DistContext | None = None
) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """The newest complete checkpoint (rank 0's pick) and its training state; refused when made with
    other hyperparameters."""
    ckpt = latest_checkpoint(out) if dist is None or dist.is_main else None
    if dist is not None:
        ckpt = broadcast_object(dist, ckpt)
    if ckpt is None:
        return None
    state = load_training_state(ckpt.path)
    theirs = ResolvedHyperparameters(**state["hyperparameters"]).training_signature()
    if theirs != hp.training_signature():
        raise ResumeMismatchError(
            f"{ckpt.path} was made with different hyperparameters ({theirs}) than this spec "
            f"resolves to ({hp.training_signature()}); start afresh (no resume) or use another output_dir"
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


def _make_engine(model: Any, config: Any, dist: DistContext | None) -> ZenFlowEngine:
    from offload.engine import ZenFlowEngine

    if dist is None or config.shard_params:  # sharded: the parameters carry their mesh's group
        return ZenFlowEngine(model, config)
    return ZenFlowEngine(model, config, process_group=dist.group)


def build(
    spec: JobSpec,
    data: RunData,
    out: Path,
    *,
    resume: bool,
    emit: Callable[[Event], None],
    dist: DistContext | None = None,
) -> Built:
    """Model on its device, the engine around it, and the run's progress (restored when resuming).

    The engine is closed again when anything after its construction fails.
    """
    import torch

    from trainer.model.catalog import fit_to_tokenizer, load_model

    hp = data.hp
    device = rank_device(dist, spec.device)
    dtype = pick_dtype(spec, device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for what still runs in fp32
    model = load_model(spec.model, dtype=dtype, seed=hp.seed, device=device)
    added_tokens = fit_to_tokenizer(model, data.tokenizer)
    base_config = model.config
    generation_config = getattr(model, "generation_config", None)
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
    if data.hp.dpo is not None:
        from trainer.run.dpo import disable_dropout

        disable_dropout(model)
    sharded = resolve_shard_params(
        spec.engine.shard_params, dist.world_size if dist is not None else 1, data.plan
    )
    if sharded:
        assert dist is not None
        blocks = shard_model(model, dist, device)
        emit(
            LogEvent(
                f"Weights sharded over {dist.world_size} ranks (FSDP2, {blocks} blocks): rank {dist.rank} holds "
                f"{rank_param_bytes(model)} bytes of parameters",
                data={
                    "sharded": True,
                    "blocks": blocks,
                    "rank": dist.rank,
                    "rank_param_bytes": rank_param_bytes(model),
                },
            )
        )
    # Before the engine or a checkpoint touches the weights: the base model is DPO's reference.
    reference = _dpo_reference(spec, data, model, out, device, emit, dist, split=not sharded)
    if sharded and reference is not None:
        reshard(model)

    found = _checkpoint_state(out, hp, dist) if resume else None
    restore = _rank_restore(*found, dist, sharded) if found is not None else None
    threads = torch.get_num_threads()  # before the engine's core placement caps it
    resumed = restore.first if restore is not None else None
    config = spec.engine.engine_config(
        hp.lr_at(0), **engine_choices(data.plan, resumed), shard_params=sharded
    )
    engine = _make_engine(model, config, dist)
    built = Built(
        model,
        engine,
        device,
        dtype,
        base_config,
        generation_config,
        Progress(),
        added_tokens=added_tokens,
        reference=reference,
        sharded=sharded,
    )
    try:
        emit(LogEvent(engine.placement.describe(), data=engine.placement.as_dict()))
        mem = engine.memory()
        emit(
            LogEvent(
                engine_memory_text(mem.host_bytes, mem.params, mem.device_state_bytes), data=mem.as_dict()
            )
        )
        if dist is not None:
            emit(rank_memory(dist, model, mem, device))
        if device.type == "cpu" and engine.mode != "device":
            # The engine's CPU optimizer worker gets its share of the cores; training keeps the rest.
            built.restore_threads = threads
            torch.set_num_threads(engine.cpu_split[0])
        if found is not None and restore is not None:
            ckpt, state = found
            # The engine state holds the device values of the trainable parameters too; a list of every
            # rank's shard is re-cut by the engine for this group.
            engine.load_state_dict(restore.engine)
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
                    f"Resumed from checkpoint at step {ckpt.step}",
                    data={"step": ckpt.step, "path": str(ckpt.path)},
                )
            )
        else:
            seed_all(hp.seed + (dist.rank if dist is not None else 0))
    except BaseException:
        release(built)
        raise
    return built


def _dpo_reference(
    spec: JobSpec,
    data: RunData,
    model: Any,
    out: Path,
    device: torch.device,
    emit: Callable[[Event], None],
    dist: DistContext | None,
    *,
    split: bool,
) -> dict[str, torch.Tensor] | None:
    """A full fine-tuning DPO job's reference table (LoRA jobs disable the adapter instead); ``split``:
    each rank computes its part (not with sharded weights, trainer.run.dpo.reference_table)."""
    if data.hp.dpo is None or spec.lora is not None:
        return None
    from trainer.run.dpo import REFERENCE_FILE, reference_table

    sets = {"train": data.train, **({"valid": data.valid} if data.valid else {})}
    table, computed = reference_table(
        model,
        sets,
        out,
        model_name=spec.model,
        micro_batch_size=data.hp.micro_batch_size,
        pad_id=data.pad_id,
        device=device,
        dist=dist,
        split=split,
    )
    pairs = sum(len(v) for v in sets.values())
    how = "computed in a pass before training" if computed else "read back"
    emit(LogEvent(f"DPO reference log-probabilities of {pairs} pairs {how} ({REFERENCE_FILE})"))
    return table


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
