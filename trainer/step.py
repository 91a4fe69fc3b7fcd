"""One optimizer step of the training run: forward/backward over its micro-batches, then one engine step.

Gradients accumulate in the parameters' ``.grad`` across the micro-batches (the engine reads them only
in ``engine.step()``). Each micro-batch's summed token loss is divided by the learned-token count of the
WHOLE optimizer step, so the accumulated gradient is the gradient of the step's mean token loss however
the step is cut into micro-batches (1 x 8 and 4 x 2 give the same update up to float rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.batching import Batch, loss_sum

if TYPE_CHECKING:
    from offload.engine import ZenFlowEngine
    from offload.metrics import StepMetrics


@dataclass(frozen=True)
class StepOutcome:
    #: Mean token loss over the learned tokens of the whole optimizer step.
    loss: float
    #: Non-padding tokens of the whole optimizer step.
    tokens: int
    metrics: StepMetrics


def optimizer_step(model: Any, engine: ZenFlowEngine, micro_batches: list[Batch], lr: float, step: int) -> StepOutcome:
    """Run one optimizer step (``step`` is its 1-based number, for messages) at learning rate ``lr``.

    Raises FloatingPointError when the loss is not finite.
    """
    engine.set_lr(lr)
    learned = max(1, sum(b.num_learned for b in micro_batches))
    loss_total = None
    for mb in micro_batches:
        ls, _ = loss_sum(model, mb)
        loss = ls / learned
        engine.scale_loss(loss).backward()  # scaled only with fp16 loss scaling
        loss_total = loss.detach() if loss_total is None else loss_total + loss.detach()
    m = engine.step()
    engine.zero_grad()
    loss_value = float(loss_total) if loss_total is not None else 0.0
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"loss is {loss_value} at step {step}")
    return StepOutcome(loss_value, sum(b.num_tokens for b in micro_batches), m)
