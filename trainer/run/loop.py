"""The training run: a JobSpec in, a fine-tuned model directory out, on the ZenFlow offload engine.
Its parts live beside it: data, model and engine set-up and resume in :mod:`trainer.run.setup`, one
optimizer step in :mod:`trainer.run.step`, batching and loss in :mod:`trainer.data.batching`, checkpoints and
``final/`` in :mod:`trainer.run.outputs` (format and RNG states in :mod:`trainer.run.checkpoint`), LoRA and
the exported weights in :mod:`trainer.model.lora`.

:func:`run_training` validates and tokenizes the data (tokenizer from the model directory, or the
byte-level one for built-in configs), resolves the hyperparameters, builds the model (bf16 on CUDA
with the offload/zenflow modes, fp32 otherwise; LoRA through peft when asked) and the
``offload.engine.ZenFlowEngine``, then runs ``n_epochs`` over the data:

- each epoch visits the examples in an order drawn from a generator seeded with (seed, epoch), so a
  data position is just the global step; ``engine.new_epoch()`` is called at each epoch start;
- each optimizer step takes ``batch_size`` examples, cut into micro-batches of ``micro_batch_size``
  sequences (right-padded, labels -100 on padding and non-learned tokens; or packed rows,
  :mod:`trainer.data.packing`); forward/backward per micro-batch with the loss normalized by the learned
  tokens of the whole step, then ``engine.set_lr(schedule(step))``, one ``engine.step()``,
  ``engine.zero_grad()`` (:mod:`trainer.run.step`); a :class:`~trainer.events.StepEvent` reports the
  optimizer step: loss, lr, tokens (summed over its micro-batches)/s, the engine's stall fraction and
  its ``StepMetrics`` record;
- validation loss every ``eval_every`` steps and at the end, in micro-batches too;
- a resumable checkpoint every ``checkpoint_every`` steps and at the end (exported weights from
  ``engine.consolidated_state_dict()``, resume state from ``engine.state_dict()`` (which holds the
  device values of the trainable parameters too), RNG states); older checkpoints beyond
  keep_checkpoints go;
- ``should_cancel()`` is polled between steps: when true, the loop checkpoints and returns with
  ``cancelled=True`` (no final model);
- at the end: ``engine.flush()``, last checkpoint, ``final/`` (the model only: safetensors, config,
  tokenizer; the merged model plus ``adapter/`` for LoRA) and ``result.json``.

Every method runs this loop: its micro-batches, loss, per-step metrics and validation are its own
(:mod:`trainer.method`; a DPO job's over preference pairs, with its reference and reward statistics).

The run's settings are its resolution (:mod:`trainer.resolve`): the one given (the service's, made at
create) while it holds for this machine, data and checkpoint, else one made here (reported as a
:class:`~trainer.events.Resolved` event).

With ``resume=True`` (default) a run continues from the newest complete checkpoint in output_dir
(refused when its hyperparameters differ) and a finished run returns its recorded result at once;
``resume=False`` deletes earlier outputs first. Resuming gives bit-identical weights to an
uninterrupted run with the same seed (the engine's state, the device parameters, RNG states and the
data position are all restored; checkpoints do not perturb the trajectory).

Data-parallel ranks (``dist``, a :class:`trainer.run.distributed.DistContext` of world N ==
``spec.resources.gpus``): every rank runs :func:`run_training` over an identical replica with the engine
on the group, and loads the same data in the same order. Each optimizer step's ``batch_size`` examples
are cut into N contiguous near-equal parts (:func:`trainer.data.batching.rank_part`; ``batch_size`` must be at
least N), rank r taking part r in its own micro-batches, so the data position is still the global step
and a checkpoint resumes on any N. The loss is normalized by the step's learned tokens summed over all
ranks (:mod:`trainer.run.step`); the step's loss and tokens, the validation loss (its examples split the same
way) and the cancel decision (``should_cancel()`` is asked on every rank; any rank's yes stops all at
the same step) are combined across ranks, so every rank takes the same branches. A step costs one
host all-reduce (:func:`trainer.run.step.step_totals`): its token counts, the cancel vote and the
previous step's loss, so a step's StepEvent comes once the next step's counts are in, or at an
evaluation, a checkpoint or the end (then with one all-reduce of the loss alone); ``should_cancel()``
is asked before each step, and with ranks it has then seen the events up to the step before last. Events: EVERY rank
emits its own :class:`~trainer.events.StepEvent` (the global loss and tokens, its own engine
``StepMetrics`` with ``rank``) and, on a failure, its own ErrorEvent; everything else (logs, RunStarted,
EvalEvent, checkpoint events, RunFinished) comes from rank 0 only. Rank 0 writes the checkpoints' shared
files, ``final/`` and ``result.json``; every rank adds its engine shard (and RNG states) to each
checkpoint (:mod:`trainer.run.outputs`). All ranks flush at the same point and meet at a barrier before
returning the same TrainResult (rank 0's). The caller owns the process group (init and shutdown).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from contract.job import Resolution
from trainer.data.batching import epoch_order, rank_part
from trainer.data.dataset import DatasetValidationError
from trainer.events import (
    ErrorEvent,
    Event,
    EventCallback,
    LogEvent,
    PreferenceMetrics,
    RewardMetrics,
    RunFinished,
    RunStarted,
    StepEvent,
    skipped_step_warning,
)
from trainer.graders.grading import Grading
from trainer.plan.gpus import Machine
from trainer.run.checkpoint import (
    FINAL_DIR,
    RESULT_FILE,
    cleanup_partial,
    is_complete,
    remove_outputs,
)
from trainer.run.distributed import DistContext, all_sum, barrier, broadcast_object
from trainer.run.loss_check import FIRST_STEPS, little_learned
from trainer.run.outputs import LOSS_WINDOW, RunOutputs, mean_loss
from trainer.run.setup import Built, ResumeMismatchError, RunData, build, load_data, release
from trainer.run.step import LateLoss, StepOutcome, optimizer_step, step_totals
from trainer.spec import JobSpec

__all__ = ["ResumeMismatchError", "TrainResult", "run_training"]

MAX_SKIPPED_IN_A_ROW = 100  # steps the engine may skip in a row (fp16 loss scale 2**16 -> 1 takes 16)


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


def run_training(
    spec: JobSpec,
    *,
    on_event: EventCallback | None = None,
    should_cancel: Callable[[], bool] | None = None,
    resume: bool = True,
    progress: bool | None = None,
    dist: DistContext | None = None,
    resolution: Resolution | None = None,
    machine: Machine | None = None,
    grading: Grading | None = None,
) -> TrainResult:
    """Run one job to completion (or cancellation) and return its result; see the module docstring.

    ``on_event`` receives every :mod:`trainer.events` record (with ranks: see the module docstring);
    ``progress`` shows a tqdm bar (default: when stderr is a TTY; rank 0 only). ``dist``: this process is
    one of the job's data-parallel ranks (None: the only process). ``resolution``: the job's (None: decided
    here), for ``machine`` (None: this one as detected). ``grading``: a reinforcement job's graders' sandbox
    limits and judge (None: the sandbox's defaults, no judge). Raises
    DatasetValidationError for bad data, UnknownModelError, and any training error (after an ErrorEvent).
    """
    dist = _group(spec, dist)
    main = dist is None or dist.is_main
    assert spec.output_dir is not None
    out = Path(spec.output_dir).resolve()

    def emit(ev: Event) -> None:
        if on_event is not None and (main or isinstance(ev, StepEvent | ErrorEvent)):
            on_event(ev)

    done = _tidy_outputs(out, resume=resume, main=main, dist=dist)
    if done is not None:
        emit(LogEvent(f"Run already finished; final model at {done.final_model_dir}"))
        return done
    try:
        data = load_data(spec, emit, dist, resolution=resolution, machine=machine, resume=resume)
        built = build(spec, data, out, resume=resume, emit=emit, dist=dist, grading=grading)
        try:
            show = main and _use_progress(progress)
            return _Run(spec, out, data, built, emit, should_cancel, show, dist).train()
        finally:
            release(built)
    except Exception as e:
        _report_error(emit, e)
        raise


def _group(spec: JobSpec, dist: DistContext | None) -> DistContext | None:
    """The run's process group, checked against the ranks the job asks for (a group of one is None)."""
    if spec.output_dir is None:
        raise ValueError("spec.output_dir is required")
    if dist is not None and dist.world_size != spec.resources.world_size:
        raise ValueError(
            f"the job asks for {spec.resources.world_size} rank(s) (resources.nodes x resources.gpus) "
            f"but runs in a group of {dist.world_size}"
        )
    return None if dist is None or dist.world_size == 1 else dist


def _tidy_outputs(out: Path, *, resume: bool, main: bool, dist: DistContext | None) -> TrainResult | None:
    """Rank 0 tidies ``out`` (a half-written checkpoint removed; everything, without ``resume``); the
    result of a run that already finished there (every rank gets rank 0's, after it has tidied)."""
    out.mkdir(parents=True, exist_ok=True)
    done: TrainResult | None = None
    if main:
        cleanup_partial(out)
        if not resume:
            remove_outputs(out)
        else:
            done = _finished_result(out)
    if dist is not None:  # also keeps the other ranks off output_dir until rank 0 has tidied it
        done = broadcast_object(dist, done)
    return done


def _report_error(emit: Callable[[Event], None], e: Exception) -> None:
    """The run's ErrorEvent (a data error's lines with it); never raises (the callback may be what failed)."""
    if isinstance(e, DatasetValidationError):
        ev = ErrorEvent(str(e), type(e).__name__, errors=[dict(x) for x in e.errors])
    else:
        ev = ErrorEvent(f"{type(e).__name__}: {e}", type(e).__name__)
    with contextlib.suppress(Exception):
        emit(ev)


@dataclass
class _Done:
    """A finished optimizer step whose StepEvent waits for its loss."""

    step: int
    epoch: int
    lr: float
    seconds: float
    outcome: StepOutcome
    preference: PreferenceMetrics | None = None
    reward: RewardMetrics | None = None

    @property
    def loss(self) -> LateLoss:
        return self.outcome.loss


def _check_loss(loss: float, step: int) -> None:
    """A non-finite loss ends the run (on every rank alike: the loss is global)."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} at step {step}")


class _Run:
    """The step loop over a built run: steps, evaluation, checkpoints, cancellation, the result."""

    def __init__(
        self,
        spec: JobSpec,
        out: Path,
        data: RunData,
        built: Built,
        emit: Callable[[Event], None],
        should_cancel: Callable[[], bool] | None,
        progress: bool,
        dist: DistContext | None = None,
    ) -> None:
        self.spec, self.out, self.data, self.built, self.emit = spec, out, data, built, emit
        self.dist = dist
        self.hp = data.hp
        self.state = built.progress
        self.outputs = RunOutputs(spec, out, data, built, emit, dist)
        self.should_cancel = should_cancel or (lambda: False)
        self.progress = progress
        self.skipped_in_a_row = 0
        self.method = built.method
        self.bar: Any = None
        self.order: list[int] = []
        self.order_epoch = -1
        #: With ranks: the last step, its event waiting for the global loss.
        self.pending: _Done | None = None
        #: This run's first losses and step (trainer.run.loss_check: did the loss move?).
        self.first_losses: list[float] = []
        self.start_step = self.state.step

    def train(self) -> TrainResult:
        self._announce()
        try:
            cancelled = self._steps()
            result = self._cancelled() if cancelled else self._finish()
        finally:
            if self.bar is not None:
                self.bar.close()
        if self.dist is not None:
            result = broadcast_object(self.dist, result)  # the same result on every rank: rank 0's
        learns_loss = self.spec.method.type != "reinforcement"  # a policy-gradient loss need not fall
        warning = None if result.cancelled or not learns_loss else self._little_learned(result)
        if warning is not None:
            self.emit(warning)
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
        barrier(self.dist)  # no rank leaves while another still works on the outputs
        return result

    def _announce(self) -> None:
        """RunStarted, and the progress bar."""
        hp, data, built, state = self.hp, self.data, self.built, self.state
        model = built.model
        self.emit(
            RunStarted(
                total_steps=hp.total_steps,
                start_step=state.step,
                hyperparameters=hp.model_dump(),
                device=str(built.device),
                dtype=str(built.dtype).removeprefix("torch."),
                mode=built.engine.mode,
                num_parameters=sum(p.numel() for p in model.parameters()),
                trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
                num_examples=len(data.train),
                num_validation_examples=len(data.valid),
                sharded=built.sharded,
                world_size=self.dist.world_size if self.dist is not None else 1,
            )
        )
        if self.progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=hp.total_steps, initial=state.step, unit="step", dynamic_ncols=True, file=sys.stderr
            )

    def _steps(self) -> bool:
        """The optimizer steps up to the total; True when cancelled (every rank alike)."""
        hp, state = self.hp, self.state
        if state.step == 0 and self.data.valid and hp.eval_every and self.method.eval_before_training:
            self._eval()
        while state.step < hp.total_steps:
            epoch, b = divmod(state.step, hp.steps_per_epoch)
            if epoch != self.order_epoch:
                self.order, self.order_epoch = epoch_order(len(self.data.train), hp.seed, epoch), epoch
            if self._step(epoch, b):
                return True
            self._after_step()
        return False

    def _step(self, epoch: int, b: int) -> bool:
        """One optimizer step (its event perhaps pending); True when a rank asked to cancel before it."""
        hp, state, built, engine = self.hp, self.state, self.built, self.built.engine
        engine.begin_step()  # the step's device work starts here (stall accounting)
        t0 = time.perf_counter()
        idx = self.order[b * hp.batch_size : (b + 1) * hp.batch_size]
        if self.dist is not None:
            idx = rank_part(idx, self.dist.rank, self.dist.world_size)
        micro = list(self._micro_batches(idx, state.step))
        prev = self.pending.loss if self.pending is not None else None
        totals = step_totals(
            self.dist, micro, cancel=self.should_cancel(), prev_loss=prev, count_micro=built.sharded
        )
        if self.pending is not None:
            assert totals.prev_loss is not None
            self._report(self.pending, totals.prev_loss)
            self.pending = None
        if totals.cancel:
            return True
        if b == 0:
            engine.new_epoch()
        lr = hp.lr_at(state.step)
        filler = self.method.filler(self.data.train[0], built.batching) if built.sharded else None
        done = optimizer_step(
            built.model, engine, micro, lr, totals, dist=self.dist, loss_fn=self.method.loss, filler=filler
        )
        extra = self.method.step_metrics(self.dist)
        self._check_skipped(done, state.step + 1)
        state.step += 1
        state.trained_tokens += done.tokens
        pref, reward = (extra, None) if not isinstance(extra, RewardMetrics) else (None, extra)
        self.pending = _Done(state.step, epoch, lr, time.perf_counter() - t0, done, pref, reward)
        return False

    def _check_skipped(self, done: StepOutcome, step: int) -> None:
        """A non-finite loss ends the run; a skipped step (non-finite gradient norm) is warned about,
        and too many in a row end it."""
        m = done.metrics
        if self.dist is None:
            _check_loss(done.loss.value(), step)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if m.skipped else 0
        if m.skipped:  # gradient norm not finite: nothing was updated
            self.emit(skipped_step_warning(m, step))
        if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise FloatingPointError(f"gradient norm not finite for {self.skipped_in_a_row} steps in a row")

    def _after_step(self) -> None:
        """The step's event when its loss is due (with ranks: at an evaluation, a checkpoint or the end),
        then the evaluation and checkpoint due at this step."""
        hp, state, data = self.hp, self.state, self.data
        eval_due = bool(
            data.valid and hp.eval_every and state.step % hp.eval_every == 0 and state.step < hp.total_steps
        )
        save_due = state.step % hp.checkpoint_every == 0 and state.step < hp.total_steps
        if self.pending is not None and (
            self.dist is None or eval_due or save_due or state.step >= hp.total_steps
        ):
            loss = self.pending.loss.value()  # landed: no wait
            if self.dist is not None:
                loss = all_sum(self.dist, [loss])[0]
            self._report(self.pending, loss)
            self.pending = None
        if eval_due:
            self._eval()
        if save_due:
            self.outputs.save_checkpoint(state)

    def _cancelled(self) -> TrainResult:
        state = self.state
        if state.step > 0 and state.last_saved != state.step:
            self.outputs.save_checkpoint(state)
        self.emit(LogEvent(f"Cancelled at step {state.step}"))
        return self._result(None, cancelled=True)

    def _finish(self) -> TrainResult:
        """The end of a run that was not cancelled: flush, validate, checkpoint, export ``final/``."""
        state = self.state
        self.built.engine.flush()
        if self.data.valid and self.hp.eval_every:
            self._eval()  # on the flushed (final) weights
        if state.last_saved != state.step:
            self.outputs.save_checkpoint(state)
        final = self.outputs.export_final(state)
        result = self._result(str(final), cancelled=False)
        self.outputs.write_result(result.as_dict())
        return result

    def _little_learned(self, result: TrainResult) -> LogEvent | None:
        steps = result.steps - self.start_step
        return little_learned(self.first_losses, result.train_loss, steps=steps, lr=self.hp.learning_rate)

    def _report(self, p: _Done, loss: float) -> None:
        """Step ``p``'s loss is in: keep it and emit its StepEvent."""
        _check_loss(loss, p.step)
        state, m, tokens, dt = self.state, p.outcome.metrics, p.outcome.tokens, p.seconds
        state.losses = [*state.losses[-(LOSS_WINDOW - 1) :], loss]
        if len(self.first_losses) < FIRST_STEPS:
            self.first_losses.append(loss)
        self.emit(
            StepEvent(
                step=p.step,
                total_steps=self.hp.total_steps,
                epoch=p.epoch,
                loss=loss,
                lr=p.lr,
                tokens=tokens,
                tokens_per_second=tokens / dt if dt > 0 else 0.0,
                step_seconds=m.wall_seconds if m.wall_seconds > 0 else dt,
                stall_seconds=m.stall_seconds,
                stall_fraction=m.stall_fraction,
                engine=m,
                rank_tokens=p.outcome.rank_tokens,
                preference=p.preference,
                reward=p.reward,
            )
        )
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{p.lr:.2e}", tok_s=f"{tokens / dt:.0f}")

    def _micro_batches(self, idx: list[int], step: int) -> Iterator[Any]:
        examples = [self.data.train[i] for i in idx]
        return self.method.micro_batches(examples, idx, self.built.batching, step=step)

    def _eval(self) -> None:
        built = self.built
        ev = self.method.evaluate(
            built.model, self.data.valid, built.batching, self.dist, built.sharded, self.state.step
        )
        self.state.valid_loss = ev.valid_loss
        self.emit(ev)

    def _result(self, final: str | None, *, cancelled: bool) -> TrainResult:
        return TrainResult(
            final_model_dir=final,
            steps=self.state.step,
            total_steps=self.hp.total_steps,
            train_loss=mean_loss(self.state),
            valid_loss=self.state.valid_loss,
            trained_tokens=self.state.trained_tokens,
            cancelled=cancelled,
            last_checkpoint=self.state.last_checkpoint,
            hyperparameters=self.hp.model_dump(),
        )
