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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.data.batching import Batch, loss_sum
from trainer.run.distributed import DistContext, all_sum

if TYPE_CHECKING:
    from offload.engine import ZenFlowEngine
    from offload.metrics import StepMetrics


@dataclass(frozen=True)
class StepOutcome:
    #: Mean token loss over the learned tokens of the whole optimizer step (all ranks).
    loss: float
    #: Non-padding tokens of the whole optimizer step (all ranks).
    tokens: int
    metrics: StepMetrics
    #: This rank's share of ``tokens`` (None in a single process).
    rank_tokens: int | None = None


def optimizer_step(
    model: Any,
    engine: ZenFlowEngine,
    micro_batches: list[Batch],
    lr: float,
    step: int,
    *,
    dist: DistContext | None = None,
) -> StepOutcome:
    """Run one optimizer step (``step`` is its 1-based number, for messages) at learning rate ``lr``;
    ``micro_batches`` are this rank's part of the step.

    Raises FloatingPointError when the loss is not finite (on every rank alike: the loss is global).
    """
    engine.set_lr(lr)
    learned_here = sum(b.num_learned for b in micro_batches)
    tokens_here = sum(b.num_tokens for b in micro_batches)
    scale = 1.0
    if dist is None:
        learned, tokens = learned_here, tokens_here
    else:
        g_learned, g_tokens = all_sum(dist, [learned_here, tokens_here])
        learned, tokens = int(g_learned), int(g_tokens)
        scale = float(dist.world_size)
    learned = max(1, learned)
    loss_total = None
    for mb in micro_batches:
        ls, _ = loss_sum(model, mb)
        loss = ls / learned
        engine.scale_loss(
            loss * scale if dist is not None else loss
        ).backward()  # scaled only with fp16 loss scaling
        loss_total = loss.detach() if loss_total is None else loss_total + loss.detach()
    m = engine.step()
    engine.zero_grad()
    loss_value = float(loss_total) if loss_total is not None else 0.0
    if dist is not None:
        loss_value = all_sum(dist, [loss_value])[0]
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"loss is {loss_value} at step {step}")
    return StepOutcome(loss_value, tokens, m, tokens_here if dist is not None else None)
