"""The training run's set-up: data validated and tokenized, hyperparameters resolved, the model and the
``offload.engine.ZenFlowEngine`` built, and the newest checkpoint restored when resuming.

Used by :mod:`trainer.loop`; the model is bf16 on CUDA (every engine mode keeps fp32 master weights for
its optimizer), fp32 otherwise, with LoRA through peft when the spec asks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.checkpoint import latest_checkpoint, load_training_state, seed_all, set_rng_state
from trainer.data import DataOptions, Example, load_examples
from trainer.events import Event, LogEvent
from trainer.lora import apply_lora
from trainer.packing import use_packing_attention
from trainer.plan import Plan
from trainer.plan_run import engine_choices, plan_for_run, planned_runtime
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
    #: The memory and speed plan on this machine (None when it could not be made): trainer.plan_run.
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


def pick_device(pref: str) -> torch.device:
    import torch

    if pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but CUDA is not available")
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_dtype(spec: JobSpec, device: torch.device) -> torch.dtype:
    import torch

    if spec.dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    # bf16 params on CUDA in every mode (each keeps fp32 master weights for its optimizer), so the
    # device baseline is compared with offload/zenflow at the same compute precision.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_data(spec: JobSpec, emit: Callable[[Event], None]) -> RunData:
    """Validate and tokenize the training (and validation) file; resolve the hyperparameters."""
    from trainer.limits import model_limit_errors
    from trainer.models import load_tokenizer, model_max_length

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
    plan = plan_for_run(spec, pick_device(spec.device).type, num_examples=len(train), num_tokens=rep.num_tokens,
                        emit=emit)
    hp = spec.resolve(len(train), planned_runtime(plan))
    return RunData(tokenizer, train, valid, hp, int(tokenizer.pad_token_id), plan)


def _checkpoint_state(out: Path, hp: ResolvedHyperparameters) -> tuple[Any, dict[str, Any]] | None:
    """The newest complete checkpoint and its training state; refused when made with other hyperparameters."""
    ckpt = latest_checkpoint(out)
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


def build(
    spec: JobSpec, data: RunData, out: Path, *, resume: bool, emit: Callable[[Event], None]
) -> Built:
    """Model on its device, the engine around it, and the run's progress (restored when resuming).

    The engine is closed again when anything after its construction fails.
    """
    import torch

    from offload.engine import ZenFlowEngine
    from trainer.models import fit_to_tokenizer, load_model

    hp = data.hp
    device = pick_device(spec.device)
    dtype = pick_dtype(spec, device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for what still runs in fp32
    model = load_model(spec.model, dtype=dtype, seed=hp.seed, device=device)
    added_tokens = fit_to_tokenizer(model, data.tokenizer)
    base_config = model.config
    generation_config = getattr(model, "generation_config", None)
    attention = apply_runtime(model, hp.runtime(), device, dtype)
    emit(LogEvent(
        f"Micro-batches of {hp.micro_batch_size} (batch size {hp.batch_size}); packing "
        f"{'on' if hp.packing else 'off'}; gradient checkpointing {'on' if hp.gradient_checkpointing else 'off'}; "
        f"attention {attention}",
        data={**hp.runtime().model_dump(), "attention": attention},
    ))
    if spec.lora is not None:
        model = apply_lora(model, spec, hp.seed)
    model.to(device)  # type: ignore[arg-type]  # mypy mis-binds transformers' wrapped Module.to
    model.train()

    found = _checkpoint_state(out, hp) if resume else None
    threads = torch.get_num_threads()  # before the engine's core placement caps it
    resumed = found[1]["engine"] if found is not None else None
    engine = ZenFlowEngine(model, spec.engine.engine_config(hp.lr_at(0), **engine_choices(data.plan, resumed)))
    built = Built(model, engine, device, dtype, base_config, generation_config, Progress(),
                  added_tokens=added_tokens)
    try:
        emit(LogEvent(engine.placement.describe(), data=engine.placement.as_dict()))
        mem = engine.memory()
        emit(LogEvent(f"Engine memory: host {mem.host_bytes / 2**30:.2f} GiB ({mem.host_bytes_per_param:.1f} B/param), "
                      f"device state {mem.device_state_bytes / 2**30:.2f} GiB", data=mem.as_dict()))
        if device.type == "cpu" and engine.mode != "device":
            # The engine's CPU optimizer worker gets its share of the cores; training keeps the rest.
            built.restore_threads = threads
            torch.set_num_threads(engine.cpu_split[0])
        if found is not None:
            ckpt, state = found
            # The engine state holds the device values of the trainable parameters too.
            engine.load_state_dict(state["engine"])
            built.progress = Progress(
                step=int(state["step"]),
                losses=list(state.get("losses", [])),
                trained_tokens=int(state.get("trained_tokens", 0)),
                valid_loss=state.get("valid_loss"),
                last_saved=ckpt.step,
                last_checkpoint=str(ckpt.path),
            )
            set_rng_state(state["rng"], hp.seed)
            theirs = ResolvedHyperparameters(**state["hyperparameters"]).runtime()
            if theirs != hp.runtime():
                emit(LogEvent(
                    f"Resuming with {hp.runtime().model_dump()} where the checkpoint ran {theirs.model_dump()}: "
                    "the same updates up to float rounding, not bit-identical", data={"checkpoint": theirs.model_dump()},
                ))
            emit(LogEvent(f"Resumed from checkpoint at step {ckpt.step}", data={"step": ckpt.step, "path": str(ckpt.path)}))
        else:
            seed_all(hp.seed)
    except BaseException:
        release(built)
        raise
    return built


def apply_runtime(model: Any, choices: RuntimeChoices, device: torch.device, dtype: torch.dtype) -> str:
    """Set up ``model`` (a transformers model, before peft wraps it) for the runtime choices: the
    attention implementation packing needs, activation checkpointing (non-reentrant; transformers also
    makes the embeddings' output require grad, which a LoRA model behind frozen layers needs). Returns
    the attention implementation in use."""
    attention = use_packing_attention(model, device, dtype) if choices.packing else model.config._attn_implementation
    if choices.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return str(attention)


def release(built: Built) -> None:
    """Close the engine and give torch its threads back."""
    import torch

    built.engine.close()
    if built.restore_threads:
        torch.set_num_threads(built.restore_threads)
