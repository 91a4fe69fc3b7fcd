"""The training run: a JobSpec in, a fine-tuned model directory out, on the ZenFlow offload engine.
Its parts live beside it: batching and loss in :mod:`trainer.batching`, LoRA and the exported weights
in :mod:`trainer.lora`, the checkpoint format (RNG states included) in :mod:`trainer.checkpoint`.

:func:`run_training` validates and tokenizes the data (tokenizer from the model directory, or the
byte-level one for built-in configs), resolves the hyperparameters, builds the model (bf16 on CUDA
with the offload/zenflow modes, fp32 otherwise; LoRA through peft when asked) and the
``offload.engine.ZenFlowEngine``, then runs ``n_epochs`` over the data:

- each epoch visits the examples in an order drawn from a generator seeded with (seed, epoch), so a
  data position is just the global step; ``engine.new_epoch()`` is called at each epoch start;
- each step: batch padded on the right (labels -100 on padding and non-learned tokens), forward,
  mean token loss over the batch, backward, ``engine.set_lr(schedule(step))``, ``engine.step()``,
  ``engine.zero_grad()``; a :class:`~trainer.events.StepEvent` reports loss, lr, tokens/s, the
  engine's stall fraction and its ``StepMetrics`` record;
- validation loss every ``eval_every`` steps and at the end;
- a resumable checkpoint every ``checkpoint_every`` steps and at the end (exported weights from
  ``engine.consolidated_state_dict()``, resume state from ``engine.state_dict()`` (which holds the
  device values of the trainable parameters too), RNG states); older checkpoints beyond
  keep_checkpoints go;
- ``should_cancel()`` is polled between steps: when true, the loop checkpoints and returns with
  ``cancelled=True`` (no final model);
- at the end: ``engine.flush()``, last checkpoint, ``final/`` (the model only: safetensors, config,
  tokenizer; the merged model plus ``adapter/`` for LoRA) and ``result.json``.

With ``resume=True`` (default) a run continues from the newest complete checkpoint in output_dir
(refused when its hyperparameters differ) and a finished run returns its recorded result at once;
``resume=False`` deletes earlier outputs first. Resuming gives bit-identical weights to an
uninterrupted run with the same seed (the engine's state, the device parameters, RNG states and the
data position are all restored; checkpoints do not perturb the trajectory).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.batching import collate, epoch_order, evaluate, loss_sum
from trainer.checkpoint import (
    FINAL_DIR,
    MANIFEST,
    RESULT_FILE,
    TRAINING_STATE,
    checkpoint_name,
    cleanup_partial,
    is_complete,
    latest_checkpoint,
    link_or_copy,
    load_training_state,
    prune_checkpoints,
    remove_outputs,
    rng_state,
    save_model_files,
    save_training_state,
    seed_all,
    set_rng_state,
    write_atomic_dir,
    write_json_atomic,
)
from trainer.data import DatasetValidationError, Example, load_examples
from trainer.events import (
    CheckpointRemoved,
    CheckpointSaved,
    ErrorEvent,
    EvalEvent,
    Event,
    EventCallback,
    LogEvent,
    RunFinished,
    RunStarted,
    StepEvent,
    skipped_step_warning,
)
from trainer.lora import apply_lora, current_state, merged_lora_state
from trainer.spec import JobSpec, ResolvedHyperparameters

if TYPE_CHECKING:
    import torch

STATE_VERSION = 1
#: Steps averaged for TrainResult.train_loss.
LOSS_WINDOW = 20
MAX_SKIPPED_IN_A_ROW = 100  # steps the engine may skip in a row (fp16 loss scale 2**16 -> 1 takes 16)


class ResumeMismatchError(RuntimeError):
    """The newest checkpoint was made with different hyperparameters than the spec resolves to."""


@dataclass
class TrainResult:
    final_model_dir: str | None
    steps: int
    total_steps: int
    #: Mean batch loss over the last (up to) 20 steps.
    train_loss: float | None
    valid_loss: float | None
    trained_tokens: int
    cancelled: bool
    last_checkpoint: str | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- helpers ----------------------------------------------------------------------------------


def _pick_device(pref: str) -> torch.device:
    import torch

    if pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but CUDA is not available")
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pick_dtype(spec: JobSpec, device: torch.device) -> torch.dtype:
    import torch

    if spec.dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    # bf16 params on CUDA in every mode (each keeps fp32 master weights for its optimizer), so the
    # device baseline is compared with offload/zenflow at the same compute precision.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _finished_result(out: Path) -> TrainResult | None:
    p = out / RESULT_FILE
    if not (p.is_file() and is_complete(out / FINAL_DIR)):
        return None
    try:
        return TrainResult(**json.loads(p.read_text()))
    except (ValueError, TypeError):
        return None


def _use_progress(progress: bool | None) -> bool:
    if progress is not None:
        return progress
    return sys.stderr.isatty()


# --- the run ----------------------------------------------------------------------------------


def run_training(
    spec: JobSpec,
    *,
    on_event: EventCallback | None = None,
    should_cancel: Callable[[], bool] | None = None,
    resume: bool = True,
    progress: bool | None = None,
) -> TrainResult:
    """Run one job to completion (or cancellation) and return its result; see the module docstring.

    ``on_event`` receives every :mod:`trainer.events` record; ``progress`` shows a tqdm bar (default:
    when stderr is a TTY). Raises DatasetValidationError for bad data, UnknownModelError, and any
    training error (after an ErrorEvent).
    """
    if spec.output_dir is None:
        raise ValueError("spec.output_dir is required")
    out = Path(spec.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)

    def emit(ev: Event) -> None:
        if on_event is not None:
            on_event(ev)

    cleanup_partial(out)
    if not resume:
        remove_outputs(out)
    else:
        done = _finished_result(out)
        if done is not None:
            emit(LogEvent(f"Run already finished; final model at {done.final_model_dir}"))
            return done
    def emit_error(ev: ErrorEvent) -> None:
        with contextlib.suppress(Exception):  # the callback itself may be what failed
            emit(ev)

    try:
        return _Run(spec, out, emit, should_cancel, resume, _use_progress(progress)).run()
    except DatasetValidationError as e:
        emit_error(ErrorEvent(str(e), type(e).__name__, errors=[dict(x) for x in e.errors]))
        raise
    except Exception as e:
        emit_error(ErrorEvent(f"{type(e).__name__}: {e}", type(e).__name__))
        raise


class _Run:
    def __init__(
        self,
        spec: JobSpec,
        out: Path,
        emit: Callable[[Event], None],
        should_cancel: Callable[[], bool] | None,
        resume: bool,
        progress: bool,
    ) -> None:
        self.spec, self.out, self.emit = spec, out, emit
        self.should_cancel = should_cancel or (lambda: False)
        self.resume, self.progress = resume, progress
        self.losses: list[float] = []
        self.trained_tokens = 0
        self.valid_loss: float | None = None
        self.step = 0
        self.skipped_in_a_row = 0
        self.last_saved: int | None = None
        self.last_checkpoint: str | None = None

    # -- set-up --

    def _load_data(self) -> None:
        from trainer.models import load_tokenizer, model_max_length

        spec = self.spec
        self.tokenizer = load_tokenizer(spec.model)
        # max_seq_length does not depend on the example count: resolve it for the length checks.
        max_len = spec.hyperparameters.resolve(1, base_learning_rate=1.0, model_max_length=model_max_length(spec.model)).max_seq_length
        self.train, rep = load_examples(spec.training_file, self.tokenizer, max_len)
        self.emit(LogEvent(f"Validated training file: {rep.num_examples} examples, {rep.num_tokens} tokens", data=rep.as_dict()))
        self.valid: list[Example] = []
        if spec.validation_file is not None:
            self.valid, vrep = load_examples(spec.validation_file, self.tokenizer, max_len)
            self.emit(LogEvent(f"Validated validation file: {vrep.num_examples} examples", data=vrep.as_dict()))
        self.hp: ResolvedHyperparameters = spec.resolve(len(self.train))
        self.pad_id = int(self.tokenizer.pad_token_id)

    def _build(self) -> None:
        import torch

        from offload.engine import ZenFlowEngine
        from trainer.models import load_model

        spec, hp = self.spec, self.hp
        self.device = _pick_device(spec.device)
        self.dtype = _pick_dtype(spec, self.device)
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 for what still runs in fp32
        model = load_model(spec.model, dtype=self.dtype, seed=hp.seed, tokenizer=self.tokenizer)
        self.base_config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        if spec.lora is not None:
            model = apply_lora(model, spec, hp.seed)
        model.to(self.device)  # type: ignore[arg-type]  # mypy mis-binds transformers' wrapped Module.to
        model.train()
        self.model = model

        ckpt = latest_checkpoint(self.out) if self.resume else None
        state: dict[str, Any] | None = None
        if ckpt is not None:
            state = load_training_state(ckpt.path)
            theirs = ResolvedHyperparameters(**state["hyperparameters"]).training_signature()
            if theirs != hp.training_signature():
                raise ResumeMismatchError(
                    f"{ckpt.path} was made with different hyperparameters ({theirs}) than this spec "
                    f"resolves to ({hp.training_signature()}); start afresh (no resume) or use another output_dir"
                )
        threads = torch.get_num_threads()  # before the engine's core placement caps it
        self.engine = ZenFlowEngine(model, spec.engine.engine_config(hp.lr_at(0)))
        self.emit(LogEvent(self.engine.placement.describe(), data=self.engine.placement.as_dict()))
        if self.device.type == "cpu" and spec.engine.mode != "device":
            # The engine's CPU optimizer worker gets its share of the cores; training keeps the rest.
            self._threads = threads
            torch.set_num_threads(self.engine.cpu_split[0])
        if state is not None and ckpt is not None:
            # The engine state holds the device values of the trainable parameters too.
            self.engine.load_state_dict(state["engine"])
            self.step = int(state["step"])
            self.losses = list(state.get("losses", []))
            self.trained_tokens = int(state.get("trained_tokens", 0))
            self.valid_loss = state.get("valid_loss")
            self.last_saved, self.last_checkpoint = ckpt.step, str(ckpt.path)
            set_rng_state(state["rng"], hp.seed)
            self.emit(LogEvent(f"Resumed from checkpoint at step {ckpt.step}", data={"step": ckpt.step, "path": str(ckpt.path)}))
        else:
            seed_all(hp.seed)

    # -- checkpoints --

    def _metrics(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "train_loss": self.losses[-1] if self.losses else None,
            "train_mean_loss": self._mean_loss(),
            "valid_loss": self.valid_loss,
            "trained_tokens": self.trained_tokens,
        }

    def _mean_loss(self) -> float | None:
        w = self.losses[-LOSS_WINDOW:]
        return sum(w) / len(w) if w else None

    def _export(self) -> dict[str, torch.Tensor]:
        state = current_state(self.model, self.engine.consolidated_state_dict())
        self._adapter_state = state if self.spec.lora is not None else None
        return merged_lora_state(self.model, state) if self.spec.lora is not None else state

    def _save_checkpoint(self) -> None:
        weights = self._export()
        adapter = self._adapter_state
        tstate = {
            "version": STATE_VERSION,
            "step": self.step,
            "hyperparameters": self.hp.model_dump(),
            "engine": self.engine.state_dict(),
            "rng": rng_state(),
            "losses": self.losses[-LOSS_WINDOW:],
            "trained_tokens": self.trained_tokens,
            "valid_loss": self.valid_loss,
        }
        metrics = self._metrics()

        def write(tmp: Path) -> None:
            save_model_files(tmp, weights, self.base_config, self.tokenizer, self.generation_config)
            if adapter is not None:
                # save_embedding_layers=False: no Hub lookup of the base model's config.
                self.model.save_pretrained(str(tmp / "adapter"), state_dict=adapter, save_embedding_layers=False)
            save_training_state(tmp, tstate)

        path = write_atomic_dir(
            self.out / checkpoint_name(self.step),
            write,
            {"kind": "checkpoint", "step": self.step, "base_model": self.spec.model, "metrics": metrics},
        )
        self.last_saved, self.last_checkpoint = self.step, str(path)
        self.emit(CheckpointSaved(self.step, str(path), metrics))
        for c in prune_checkpoints(self.out, self.spec.keep_checkpoints):
            self.emit(CheckpointRemoved(c.step, str(c.path)))

    def _export_final(self) -> Path:
        assert self.last_checkpoint is not None
        src = Path(self.last_checkpoint)

        def write(tmp: Path) -> None:
            for p in sorted(src.rglob("*")):
                if p.is_file() and p.name not in (TRAINING_STATE, MANIFEST):
                    link_or_copy(p, tmp / p.relative_to(src))

        return write_atomic_dir(
            self.out / FINAL_DIR,
            write,
            {"kind": "final", "step": self.step, "base_model": self.spec.model, "metrics": self._metrics()},
        )

    # -- loop --

    def run(self) -> TrainResult:
        self._load_data()
        try:
            self._build()
            return self._train()
        finally:
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.close()
            if getattr(self, "_threads", None):
                import torch

                torch.set_num_threads(self._threads)

    def _train(self) -> TrainResult:
        hp, spec = self.hp, self.spec
        n_params = sum(p.numel() for p in self.model.parameters())
        n_train = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.emit(
            RunStarted(
                total_steps=hp.total_steps,
                start_step=self.step,
                hyperparameters=hp.model_dump(),
                device=str(self.device),
                dtype=str(self.dtype).removeprefix("torch."),
                mode=spec.engine.mode,
                num_parameters=n_params,
                trainable_parameters=n_train,
                num_examples=len(self.train),
                num_validation_examples=len(self.valid),
            )
        )
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=hp.total_steps, initial=self.step, unit="step", dynamic_ncols=True, file=sys.stderr)
        cancelled = False
        order: list[int] = []
        order_epoch = -1
        try:
            while self.step < hp.total_steps:
                if self.should_cancel():
                    cancelled = True
                    break
                epoch, b = divmod(self.step, hp.steps_per_epoch)
                if epoch != order_epoch:
                    order, order_epoch = epoch_order(len(self.train), hp.seed, epoch), epoch
                if b == 0:
                    self.engine.new_epoch()
                t0 = time.perf_counter()
                idx = order[b * hp.batch_size : (b + 1) * hp.batch_size]
                batch = collate([self.train[i] for i in idx], self.pad_id, self.device)
                lr = hp.lr_at(self.step)
                self.engine.set_lr(lr)
                ls, count = loss_sum(self.model, batch)
                loss = ls / count.clamp(min=1)
                self.engine.scale_loss(loss).backward()  # scaled only with fp16 loss scaling
                m = self.engine.step()
                self.engine.zero_grad()
                loss_value = float(loss.detach())
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"loss is {loss_value} at step {self.step + 1}")
                self.skipped_in_a_row = self.skipped_in_a_row + 1 if m.skipped else 0
                if m.skipped:  # gradient norm not finite: nothing was updated
                    self.emit(skipped_step_warning(m, self.step + 1))
                if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                    raise FloatingPointError(f"gradient norm not finite for {self.skipped_in_a_row} steps in a row")
                dt = time.perf_counter() - t0
                self.step += 1
                self.losses = [*self.losses[-(LOSS_WINDOW - 1) :], loss_value]
                self.trained_tokens += batch.num_tokens
                wall = m.wall_seconds if m.wall_seconds > 0 else dt
                self.emit(
                    StepEvent(
                        step=self.step,
                        total_steps=hp.total_steps,
                        epoch=epoch,
                        loss=loss_value,
                        lr=lr,
                        tokens=batch.num_tokens,
                        tokens_per_second=batch.num_tokens / dt if dt > 0 else 0.0,
                        step_seconds=wall,
                        stall_seconds=m.stall_seconds,
                        stall_fraction=m.stall_fraction,
                        engine=m,
                    )
                )
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", tok_s=f"{batch.num_tokens / dt:.0f}")
                if self.valid and hp.eval_every and self.step % hp.eval_every == 0 and self.step < hp.total_steps:
                    self._eval()
                if self.step % hp.checkpoint_every == 0 and self.step < hp.total_steps:
                    self._save_checkpoint()
            if cancelled:
                if self.step > 0 and self.last_saved != self.step:
                    self._save_checkpoint()
                self.emit(LogEvent(f"Cancelled at step {self.step}"))
                result = self._result(None, cancelled=True)
            else:
                self.engine.flush()
                if self.valid and hp.eval_every:
                    self._eval()  # on the flushed (final) weights
                if self.last_saved != self.step:
                    self._save_checkpoint()
                final = self._export_final()
                result = self._result(str(final), cancelled=False)
                write_json_atomic(self.out / RESULT_FILE, result.as_dict())
        finally:
            if bar is not None:
                bar.close()
        self.emit(
            RunFinished(
                steps=result.steps,
                cancelled=result.cancelled,
                final_model_dir=result.final_model_dir,
                train_loss=result.train_loss,
                valid_loss=result.valid_loss,
                trained_tokens=result.trained_tokens,
            )
        )
        return result

    def _eval(self) -> None:
        loss, n = evaluate(self.model, self.valid, self.hp.batch_size, self.pad_id, self.device)
        self.valid_loss = loss
        self.emit(EvalEvent(self.step, loss, n))

    def _result(self, final: str | None, *, cancelled: bool) -> TrainResult:
        return TrainResult(
            final_model_dir=final,
            steps=self.step,
            total_steps=self.hp.total_steps,
            train_loss=self._mean_loss(),
            valid_loss=self.valid_loss,
            trained_tokens=self.trained_tokens,
            cancelled=cancelled,
            last_checkpoint=self.last_checkpoint,
            hyperparameters=self.hp.model_dump(),
        )
