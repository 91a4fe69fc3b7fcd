"""One optimizer step of the training run: forward/backward over its micro-batches, then one engine step.

Gradients accumulate in the parameters' ``.grad`` across the micro-batches (the engine reads them only
in ``engine.step()``). Each micro-batch's summed token loss is divided by the learned-token count of the
WHOLE optimizer step, so the accumulated gradient is the gradient of the step's mean token loss however
the step is cut into micro-batches (1 x 8 and 4 x 2 give the same update up to float rounding).

With N data-parallel ranks (``dist``) the step's learned tokens are summed over all ranks before the
backward passes, and each rank backpropagates its token-loss sum / that global count * N: the engine
AVERAGES the ranks' gradients, so the update is the gradient of the global step's mean token loss, the
same as one process taking all N parts. The reported loss and tokens are the global ones (identical on
every rank).

Nothing here waits for the device. The step's loss stays on the device: a copy into page-locked host
memory is queued behind the last micro-batch's forward (before its backward), so it has landed by the
time ``engine.step()`` returns (the engine's own read of the gradient norm comes after it on the
stream) and :meth:`LateLoss.value` reads it without waiting. The ranks' token counts, the cancel vote
and the previous step's loss travel in ONE host all-reduce per step (:func:`step_totals`), before
the backward passes that need the global learned-token count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from trainer.run.distributed import DistContext, all_sum

if TYPE_CHECKING:  # torch is imported where it is used: importing the training library stays light
    import torch

    from offload.engine import ZenFlowEngine
    from offload.step_metrics import StepMetrics


class LateLoss:
    """A step's loss (this rank's part of the global mean) on its way to host memory.

    On CUDA: one non-blocking copy into page-locked memory and an event; ``value()`` waits only if
    the copy has not landed (``landed()``). On CPU the value is read directly.
    """

    __slots__ = ("_event", "_host", "_value")

    def __init__(self, loss: torch.Tensor | None) -> None:
        self._value: float | None = None if loss is not None else 0.0
        self._event: torch.cuda.Event | None = None
        self._host = loss
        if loss is not None and loss.device.type == "cuda":
            import torch

            self._host = torch.empty((), dtype=torch.float32, pin_memory=True)
            self._host.copy_(loss.detach().to(torch.float32), non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(loss.device))

    def landed(self) -> bool:
        return self._value is not None or self._event is None or bool(self._event.query())

    def value(self) -> float:
        if self._value is None:
            if self._event is not None:
                self._event.synchronize()  # a no-op once landed
            assert self._host is not None
            self._value = float(self._host)
            self._host = self._event = None
        return self._value


class MicroBatch(Protocol):
    """What a step counts of a micro-batch: a :class:`~trainer.data.batching.Batch`, or a DPO job's
    :class:`~trainer.method.dpo.PairBatch` (whose ``num_learned`` is its pairs: the loss's units)."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_learned(self) -> int: ...


@dataclass(frozen=True)
class StepTotals:
    """What the step's one host all-reduce carried (the local values in a single process)."""

    #: Learned (loss-bearing) and non-padding tokens of the whole optimizer step (all ranks).
    learned: int
    tokens: int
    #: Some rank asked to cancel before this step: the loop stops here, every rank alike.
    cancel: bool
    #: The previous step's global loss when one was passed in (else None).
    prev_loss: float | None
    #: The most micro-batches any rank runs this step (counted only when asked: sharded weights, where
    #: every rank must run as many forward/backward passes as the others, for FSDP's gathers); else 0.
    most_micro: int = 0


def step_totals(
    dist: DistContext | None,
    micro_batches: Sequence[MicroBatch],
    *,
    cancel: bool,
    prev_loss: LateLoss | None = None,
    count_micro: bool = False,
) -> StepTotals:
    """The step's token counts over all ranks, the cancel vote and the previous step's loss, in one
    all-reduce (none in a single process). ``prev_loss`` must be given on every rank or on none."""
    learned_here = sum(b.num_learned for b in micro_batches)
    tokens_here = sum(b.num_tokens for b in micro_batches)
    vals = [float(learned_here), float(tokens_here), 1.0 if cancel else 0.0]
    if prev_loss is not None:
        vals.append(prev_loss.value())
    at = len(vals)
    if count_micro and dist is not None:  # each rank's count in its own slot: every rank learns all
        vals += [float(len(micro_batches)) if r == dist.rank else 0.0 for r in range(dist.world_size)]
    if dist is not None:
        vals = all_sum(dist, vals)
    return StepTotals(
        most_micro=int(max(vals[at:], default=0)),
        learned=int(vals[0]),
        tokens=int(vals[1]),
        cancel=vals[2] > 0,
        prev_loss=vals[3] if prev_loss is not None else None,
    )


@dataclass(frozen=True)
class StepOutcome:
    #: This rank's part of the mean token loss over the learned tokens of the whole optimizer step
    #: (the loss itself in a single process; summed over ranks it is the step's loss).
    loss: LateLoss
    #: Non-padding tokens of the whole optimizer step (all ranks).
    tokens: int
    metrics: StepMetrics
    #: This rank's share of ``tokens`` (None in a single process).
    rank_tokens: int | None = None


def optimizer_step(
    model: Any,
    engine: ZenFlowEngine,
    micro_batches: Sequence[MicroBatch],
    lr: float,
    totals: StepTotals,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    dist: DistContext | None = None,
    filler: MicroBatch | None = None,
) -> StepOutcome:
    """Run one optimizer step at learning rate ``lr``; ``micro_batches`` are this rank's part of the
    step and ``totals`` its counts over all ranks (:func:`step_totals`). ``loss_fn(model, micro_batch)``
    is a micro-batch's summed loss over its ``num_learned`` units (the method's,
    :meth:`trainer.method.base.TrainingMethod.loss`: tokens, or a DPO job's pairs). ``filler`` (sharded weights): a micro-batch this rank
    runs with a zero loss until it has run ``totals.most_micro`` passes, as every rank."""
    loss_of = loss_fn
    engine.set_lr(lr)
    scale = float(dist.world_size) if dist is not None else 1.0
    learned = max(1, totals.learned)
    loss_total = None
    late = LateLoss(None)
    for i, mb in enumerate(micro_batches):
        loss = loss_of(model, mb) / learned
        loss_total = loss.detach() if loss_total is None else loss_total + loss.detach()
        if i == len(micro_batches) - 1:  # the copy runs behind this forward, before the backward
            late = LateLoss(loss_total)
        engine.scale_loss(
            loss * scale if dist is not None else loss
        ).backward()  # scaled only with fp16 loss scaling
    if filler is not None:
        for _ in range(totals.most_micro - len(micro_batches)):
            (
                loss_of(model, filler) * 0.0
            ).backward()  # adds nothing; takes part in FSDP's gathers and reductions
    m = engine.step()
    engine.zero_grad()
    tokens_here = sum(b.num_tokens for b in micro_batches)
    return StepOutcome(late, totals.tokens, m, tokens_here if dist is not None else None)
