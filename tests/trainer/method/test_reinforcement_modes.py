"""A reinforcement job in every engine mode (``device``, ``offload``, ``zenflow``), full fine-tune and
LoRA, in one process on docs-llama: a few steps each with finite losses and rewards, weights that moved,
the modes agreeing (every mode the same first rollout and loss; offload the device's rollouts, losses and
weights throughout, within float rounding; zenflow's CPU columns land a window late, its later steps its
own), and runs cut after a mid-epoch checkpoint resumed to the uninterrupted runs' steps and weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.method.test_reinforcement_run import (
    COMMON_LETTER,
    base_weights,
    figures,
    lines,
    rl_spec,
    weights,
)
from tests.trainer.run.test_distributed_run import MODES, assert_close
from tests.trainer.run.test_loop import Recorder
from trainer.events import RunStarted, StepEvent
from trainer.run.loop import run_training
from trainer.spec import JobSpec

pytestmark = pytest.mark.usefixtures("torch_single_thread")

#: 6 prompts, 2 a step: 3 steps an epoch, 2 epochs.
HP = {"n_epochs": 2, "batch_size": 2, "max_seq_length": 96, "learning_rate": 1e-2, "seed": 1}
STEPS = 6
LORA = {"r": 4}


def spec(out: Path, files: tuple[Path, Path], mode: str, **kw: Any) -> JobSpec:
    train, valid = files
    hp = {**HP, "eval_every": 0, **kw.pop("hp", {})}
    return rl_spec(
        out, train, valid, hyperparameters=hp, method={"grader": COMMON_LETTER}, engine=MODES[mode], **kw
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("rl-modes-data")
    return lines("keyword_rl_train.jsonl", 6, d / "train.jsonl"), lines(
        "keyword_rl_valid.jsonl", 2, d / "valid.jsonl"
    )


def steps_of(rec: Recorder) -> list[StepEvent]:
    return [e for e in rec.events if isinstance(e, StepEvent)]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rl-modes")


@pytest.fixture(scope="module")
def runs(files: tuple[Path, Path], root: Path) -> dict[str, list[StepEvent]]:
    """Every mode, full and LoRA: each run's steps (its output in ``root/<mode>-<full|lora>``)."""
    out = {}
    for mode in MODES:
        for kind, extra in (("full", {}), ("lora", {"lora": LORA})):
            rec = Recorder()
            run_training(spec(root / f"{mode}-{kind}", files, mode, **extra), on_event=rec)
            out[f"{mode}-{kind}"] = steps_of(rec)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_every_mode_learns_and_the_modes_agree(
    kind: str, root: Path, runs: dict[str, list[StepEvent]]
) -> None:
    base = base_weights()
    by_mode = {mode: runs[f"{mode}-{kind}"] for mode in MODES}
    for mode, steps in by_mode.items():
        assert [e.step for e in steps] == list(range(1, STEPS + 1)), mode
        assert all(math.isfinite(e.loss) for e in steps), mode
        rewards = [e.reward for e in steps if e.reward is not None]
        assert len(rewards) == STEPS and all(r.samples == 2 * 4 for r in rewards), mode
        assert all(0 <= r.reward_min <= r.reward_mean <= r.reward_max <= 1 for r in rewards), mode
        w = weights(root / f"{mode}-{kind}")
        assert any(not torch.equal(w[k], base[k]) for k in base), mode  # the weights moved
    device, offload = by_mode["device"], by_mode["offload"]
    # step 1 samples from the base in every mode: the same rollout, the same loss
    for mode in ("offload", "zenflow"):
        assert _figures(by_mode[mode][0]) == _figures(device[0]), mode
        assert by_mode[mode][0].loss == pytest.approx(device[0].loss, rel=1e-5, abs=1e-7), mode
    # offload mode's CPU AdamW is the device's within float rounding: the same rollouts after, too
    # (zenflow's CPU columns land a window late: its later steps are its own)
    assert [_figures(e) for e in offload] == [_figures(e) for e in device]
    assert [e.loss for e in offload] == pytest.approx([e.loss for e in device], rel=1e-4, abs=1e-6)
    assert_close(weights(root / f"offload-{kind}"), weights(root / f"device-{kind}"), rel=1e-4)


def _figures(e: StepEvent) -> dict[str, Any]:
    assert e.reward is not None
    return figures(e.reward.figures())


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "kind"), [("zenflow", "full"), ("offload", "lora")])
def test_a_run_cut_mid_epoch_resumes_to_the_uninterrupted_steps(
    mode: str,
    kind: str,
    files: tuple[Path, Path],
    root: Path,
    runs: dict[str, list[StepEvent]],
    tmp_path: Path,
) -> None:
    """Cut after step 4 (epoch 1's first step; the cancel checkpoints there), resumed: steps 5 and 6
    sample the same rollouts (their seeds are the step's) and end on the uninterrupted run's weights."""
    extra = {"lora": LORA} if kind == "lora" else {}
    seen = Recorder()
    cut = run_training(
        spec(tmp_path, files, mode, **extra), on_event=seen, should_cancel=lambda: len(steps_of(seen)) >= 4
    )
    assert cut.cancelled and cut.steps == 4 and cut.last_checkpoint is not None
    again = Recorder()
    resumed = run_training(spec(tmp_path, files, mode, **extra), on_event=again)
    assert [e.start_step for e in again.events if isinstance(e, RunStarted)] == [4]
    assert resumed.steps == STEPS and not resumed.cancelled
    whole = runs[f"{mode}-{kind}"]
    assert [(e.step, e.loss) for e in steps_of(again)] == [(e.step, e.loss) for e in whole[4:]]
    assert [_figures(e) for e in steps_of(again)] == [_figures(e) for e in whole[4:]]
    a, b = weights(tmp_path), weights(root / f"{mode}-{kind}")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
