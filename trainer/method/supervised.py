"""Supervised fine-tuning: next-token prediction on the learned (assistant) tokens, the loss normalized
by the learned tokens of the whole step (trainer.run.step); rows packed when the job packs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from contract.method import ResolvedMethod
from trainer.data.batching import Batch, evaluate, evaluate_sums, loss_sum, micro_batches, rank_part
from trainer.data.example import Example
from trainer.events import EvalEvent, PreferenceMetrics
from trainer.method.base import Batching, MethodSetup
from trainer.run.distributed import DistContext, all_sum

if TYPE_CHECKING:
    import torch


class SupervisedTraining:
    """:class:`trainer.method.base.TrainingMethod` of ``supervised``."""

    eval_before_training = False

    @classmethod
    def of(cls, resolved: ResolvedMethod) -> SupervisedTraining:
        return cls()

    def prepare(self, setup: MethodSetup) -> None:
        """Nothing: the model trains as loaded."""

    def micro_batches(
        self, examples: list[Example], index: list[int], b: Batching, *, step: int = 0
    ) -> Iterator[Batch]:
        hp = b.hp
        return micro_batches(
            examples,
            hp.micro_batch_size,
            pad_id=b.pad_id,
            device=b.device,
            packing=hp.packing,
            max_seq_length=hp.max_seq_length,
        )

    def filler(self, example: Example, b: Batching) -> Batch:
        return next(self.micro_batches([example], [0], b))

    def loss(self, model: Any, mb: Any) -> torch.Tensor:
        return loss_sum(model, mb)[0]

    def step_metrics(self, dist: DistContext | None) -> PreferenceMetrics | None:
        return None

    def evaluate(
        self,
        model: Any,
        valid: list[Example],
        b: Batching,
        dist: DistContext | None,
        sharded: bool,
        step: int,
    ) -> EvalEvent:
        """Mean token loss: each rank its part, summed (sharded weights: every rank runs every pass)."""
        hp = b.hp
        kw: dict[str, Any] = {
            "pad_id": b.pad_id,
            "device": b.device,
            "packing": hp.packing,
            "max_seq_length": hp.max_seq_length,
        }
        if dist is None or sharded:
            loss, n = evaluate(model, valid, hp.micro_batch_size, **kw)
            return EvalEvent(step, loss, n)
        part = rank_part(valid, dist.rank, dist.world_size)
        s_total, n_total = all_sum(dist, list(evaluate_sums(model, part, hp.micro_batch_size, **kw)))
        n = int(n_total)
        return EvalEvent(step, s_total / n if n else float("nan"), n)
