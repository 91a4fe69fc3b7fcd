"""A reinforcement job on 2 gloo ranks (run_training(dist=...)), its weights replicated and sharded with
FSDP2 (``engine.shard_params``): each rank samples and grades its own share of the step's prompts, the
step's reward figures are every rank's completions (rank 0's events report the whole step), generation
with sharded weights runs as many forwards on every rank (no hang: the harness's deadline), the weights
learn, and a run cut after a mid-epoch checkpoint resumes to the uninterrupted run's steps and weights."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.dist_ranks import Job, RankOutcome, train_on_ranks
from tests.trainer.method.test_reinforcement_run import (
    COMMON_LETTER,
    base_weights,
    figures,
    lines,
    rl_spec,
    weights,
)
from tests.trainer.run.test_distributed_run import MODES, ok
from trainer.data.batching import epoch_order, rank_part
from trainer.spec import JobSpec

pytestmark = [pytest.mark.usefixtures("torch_single_thread"), pytest.mark.slow]

#: 5 prompts, 4 a step (2 a rank; the last step of an epoch 1: rank 1 has none, and with sharded weights
#: runs a filler pass and samples with the other): 2 steps an epoch, 2 epochs; a checkpoint every 2 steps.
PROMPTS = 5
HP = {
    "n_epochs": 2,
    "batch_size": 4,
    "micro_batch_size": 1,
    "max_seq_length": 96,
    "checkpoint_every": 2,
    "eval_every": 3,
}
STEPS = 4
#: A reward the prompt decides, whatever the completion: 1 where the row's keyword is 'return'. A step's
#: mean reward is then its prompts' share of 'return' rows, which one rank's half alone would not give.
RETURN_ROWS = {
    "type": "string_check",
    "name": "a return row",
    "input": "{{item.keyword}}",
    "reference": "return",
    "operation": "eq",
}
SAMPLES = 4  # compute_multiplier 0.5


def spec(
    out: Path,
    files: tuple[Path, Path],
    *,
    shard: bool,
    grader: dict[str, Any] | None = None,
    mode: str = "device",
    **kw: Any,
) -> JobSpec:
    train, valid = files
    return rl_spec(
        out,
        train,
        valid,
        hyperparameters={**HP, "learning_rate": 1e-2, "seed": 1},
        method=kw.pop("method", {"grader": grader}),
        engine={**MODES[mode], "shard_params": shard},
        resources={"gpus": 2},
        **kw,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("rl-ranks-data")
    return lines("keyword_rl_train.jsonl", PROMPTS, d / "train.jsonl"), lines(
        "keyword_rl_valid.jsonl", 3, d / "valid.jsonl"
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rl-ranks")


@pytest.fixture(scope="module")
def runs(files: tuple[Path, Path], root: Path) -> dict[str, list[RankOutcome]]:
    jobs: dict[str, Job] = {}
    for shard in (False, True):
        name = "sharded" if shard else "replicated"
        jobs[f"{name}-rows"] = Job(spec(root / f"{name}-rows", files, shard=shard, grader=RETURN_ROWS))
        jobs[name] = Job(spec(root / name, files, shard=shard, grader=COMMON_LETTER))
        # cut after step 3 (mid-epoch: epoch 1's first step; the cancel checkpoints there), then resumed
        cut = spec(root / f"{name}-cut", files, shard=shard, grader=COMMON_LETTER)
        jobs[f"{name}-cut"] = Job(cut, cancel_after=3)
        jobs[f"{name}-resumed"] = Job(cut)
    # the other engine modes, and LoRA with its KL penalty (the reference: the adapter disabled)
    kl = {"grader": COMMON_LETTER, "kl_beta": 0.1}
    lora = {"lora": {"r": 4}, "method": kl}
    jobs["zenflow"] = Job(spec(root / "zenflow", files, shard=False, grader=COMMON_LETTER, mode="zenflow"))
    jobs["sharded-offload"] = Job(
        spec(root / "sharded-offload", files, shard=True, grader=COMMON_LETTER, mode="offload")
    )
    jobs["sharded-lora"] = Job(spec(root / "sharded-lora", files, shard=True, mode="zenflow", **lora))
    jobs["lora"] = Job(spec(root / "lora", files, shard=False, mode="offload", **lora))
    outcomes = train_on_ranks(list(jobs.values()), timeout=600)
    return dict(zip(jobs, outcomes, strict=True))


def step_rewards(o: RankOutcome) -> dict[int, dict[str, Any]]:
    return {step: r for t, step, r in o.rewards if t == "step"}


def step_keywords(train: Path, step: int) -> list[str]:
    """The keywords of step ``step``'s prompts (1-based), in the data's order."""
    import json

    rows = [json.loads(x) for x in train.read_text().splitlines()]
    epoch, b = divmod(step - 1, 2)
    return [rows[i]["keyword"] for i in epoch_order(len(rows), 1, epoch)[b * 4 : (b + 1) * 4]]


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_every_ranks_rewards_make_the_steps_figures(
    layout: str, files: tuple[Path, Path], runs: dict[str, list[RankOutcome]]
) -> None:
    res = ok(runs[f"{layout}-rows"])
    assert res.steps == STEPS
    got = [step_rewards(o) for o in runs[f"{layout}-rows"]]
    assert got[0] == got[1] and sorted(got[0]) == [1, 2, 3, 4]  # every rank the same, global, figures
    checked = []
    for s in range(1, STEPS + 1):
        keywords = step_keywords(files[0], s)
        mine = rank_part(keywords, 0, 2)  # rank 0's own prompts (none in a step of one)
        share = keywords.count("return") / len(keywords)
        r = got[0][s]
        assert r["samples"] == len(keywords) * SAMPLES  # both ranks' prompts
        assert r["reward_mean"] == pytest.approx(share)
        assert (r["reward_min"], r["reward_max"]) == (float(share == 1), float(share > 0))
        checked.append(not mine or mine.count("return") / len(mine) != share)
    assert any(checked)  # the check can fail: rank 0's part alone would report another mean


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_two_ranks_learn_and_resume_mid_epoch_to_the_same_steps(
    layout: str, root: Path, runs: dict[str, list[RankOutcome]]
) -> None:
    full = ok(runs[layout])
    assert full.steps == STEPS and not full.cancelled
    losses = [[loss for t, _, loss, _ in o.events if t == "step"] for o in runs[layout]]
    assert losses[0] == losses[1] and len(losses[0]) == STEPS
    assert all(loss is not None and math.isfinite(loss) for loss in losses[0])
    rewards = step_rewards(runs[layout][0])
    assert [r["samples"] for r in rewards.values()] == [4 * SAMPLES, 1 * SAMPLES] * 2
    assert all(0 <= r["reward_min"] <= r["reward_mean"] <= r["reward_max"] <= 1 for r in rewards.values())
    evals = [(step, r["samples"]) for t, step, r in runs[layout][0].rewards if t == "eval"]
    assert evals == [(0, 3 * 2), (3, 3 * 2), (4, 3 * 2)]  # the validation prompts, all of them
    base = base_weights()
    trained = weights(root / layout)
    assert any(not torch.equal(trained[k], base[k]) for k in base)

    cut = ok(runs[f"{layout}-cut"])
    assert cut.cancelled and cut.steps == 3 and cut.last_checkpoint is not None
    resumed = ok(runs[f"{layout}-resumed"])
    assert resumed.steps == STEPS and not resumed.cancelled
    again = [(step, loss) for t, step, loss, _ in runs[f"{layout}-resumed"][0].events if t == "step"]
    assert again == [(4, losses[0][3])]
    assert figures(step_rewards(runs[f"{layout}-resumed"][0])[4]) == figures(rewards[4])
    a, b = weights(root / layout), weights(root / f"{layout}-cut")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("job", ["zenflow", "sharded-offload", "sharded-lora", "lora"])
def test_two_ranks_train_in_every_mode_and_with_lora(
    job: str, root: Path, runs: dict[str, list[RankOutcome]]
) -> None:
    res = ok(runs[job])
    assert res.steps == STEPS and not res.cancelled
    losses = [[loss for t, _, loss, _ in o.events if t == "step"] for o in runs[job]]
    assert losses[0] == losses[1] and len(losses[0]) == STEPS
    assert all(loss is not None and math.isfinite(loss) for loss in losses[0])
    rewards = step_rewards(runs[job][0])
    assert [r["samples"] for r in rewards.values()] == [4 * SAMPLES, 1 * SAMPLES] * 2
    assert all(0 <= r["reward_min"] <= r["reward_mean"] <= r["reward_max"] <= 1 for r in rewards.values())
    base, trained = base_weights(), weights(root / job)  # the merged model, with LoRA
    assert any(not torch.equal(trained[k], base[k]) for k in base)
