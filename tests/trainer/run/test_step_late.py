"""Issue 22, items 4-5 in the trainer: the step's loss is read late but reported as step N's own, and
a step costs one host all-reduce (token counts, cancel vote, the previous loss) and no device read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import trainer.data.batching as batching
import trainer.method.supervised as supervised
import trainer.run.loop as loop
import trainer.run.step as step_mod
from tests.trainer.run.test_engine_trainer import _spec as engine_trainer_spec
from trainer.events import Event, StepEvent
from trainer.run.distributed import DistContext
from trainer.run.step import LateLoss, step_totals
from trainer.spec import JobSpec

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _spec(out: Path, micro: int) -> JobSpec:
    return engine_trainer_spec(out, 24, seed=1, micro_batch_size=micro)


@pytest.mark.parametrize("micro", [4, 2])
def test_the_loss_reported_for_step_n_is_the_loss_computed_at_step_n(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, micro: int
) -> None:
    """Each step's summed micro-batch losses, recorded where they are computed, against the StepEvents
    (and the mean of the last ones, the result's train loss)."""
    computed: list[float] = []  # per step: the loss where optimizer_step computed it
    real_loss_sum, real_late = batching.loss_sum, step_mod.LateLoss
    calls = {"mb": 0}

    def loss_sum(model: Any, batch: Any) -> Any:
        calls["mb"] += 1
        return real_loss_sum(model, batch)

    class Late(real_late):  # type: ignore[misc, valid-type]
        def __init__(self, loss: torch.Tensor | None) -> None:
            if loss is not None:
                computed.append(float(loss))
            super().__init__(loss)

    monkeypatch.setattr(supervised, "loss_sum", loss_sum)
    monkeypatch.setattr(step_mod, "LateLoss", Late)
    events: list[Event] = []
    res = loop.run_training(_spec(tmp_path, micro), on_event=events.append, progress=False)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert res.steps == 6 and [e.step for e in steps] == list(range(1, 7))
    assert calls["mb"] == 6 * (4 // micro) and len(computed) == 6
    assert [e.loss for e in steps] == computed  # exactly step N's value, read after it landed
    assert len(set(computed)) == 6  # distinct steps: a one-step shift would show
    assert res.train_loss == pytest.approx(sum(computed) / 6)


def test_late_loss_reads_the_value_once() -> None:
    t = torch.tensor(2.5)
    late = LateLoss(t)
    assert late.landed() and late.value() == 2.5
    t.fill_(7.0)  # the value was taken; a later change does not matter once read
    assert late.value() == 2.5
    assert LateLoss(None).value() == 0.0


class _Batch:
    def __init__(self, learned: int, tokens: int) -> None:
        self.num_learned, self.num_tokens = learned, tokens


def test_step_totals_is_one_all_reduce_with_ranks_and_none_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[list[float]] = []

    def all_sum(ctx: Any, values: list[float]) -> list[float]:
        sent.append(list(values))
        return [2 * v for v in values]  # two ranks with the same numbers

    monkeypatch.setattr(step_mod, "all_sum", all_sum)
    micro: list[Any] = [_Batch(3, 10), _Batch(4, 12)]
    alone = step_totals(None, micro, cancel=False, prev_loss=LateLoss(torch.tensor(0.5)))
    assert sent == [] and (alone.learned, alone.tokens, alone.cancel, alone.prev_loss) == (7, 22, False, 0.5)
    fake = DistContext(rank=0, world_size=2, local_rank=0, backend="gloo", group=None)  # type: ignore[arg-type]
    first = step_totals(fake, micro, cancel=False)
    assert sent == [[7.0, 22.0, 0.0]] and (first.learned, first.tokens, first.cancel, first.prev_loss) == (
        14,
        44,
        False,
        None,
    )
    later = step_totals(fake, micro, cancel=True, prev_loss=LateLoss(torch.tensor(0.25)))
    assert len(sent) == 2 and sent[1] == [7.0, 22.0, 1.0, 0.25]
    assert later.cancel and later.prev_loss == 0.5
