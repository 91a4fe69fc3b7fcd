"""A reinforcement job end to end (trainer.run.loop.run_training) on docs-llama with a string_check
grader: steps report their rewards, validation runs before step 0 and at the end, the final model loads
with ``from_pretrained``, and a run cut after a checkpoint resumes to the uninterrupted run's weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.run.test_loop import Recorder
from trainer.events import EvalEvent, RunStarted, StepEvent
from trainer.run.loop import run_training
from trainer.samples import MODELS_DIR, SAMPLES_DIR
from trainer.spec import JobSpec

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def lines(src: str, n: int, dst: Path) -> Path:
    rows = (SAMPLES_DIR / src).read_text().splitlines()[:n]
    dst.write_text("\n".join(rows) + "\n")
    return dst


def rl_spec(out: Path, train: Path, valid: Path, **extra: Any) -> JobSpec:
    method = extra.pop("method", {})
    return JobSpec.model_validate(
        {
            "model": str(MODELS_DIR / "docs-llama"),
            "training_file": str(train),
            "validation_file": str(valid),
            "method": {
                "type": "reinforcement",
                "grader": {
                    "type": "string_check",
                    "name": "uses the word",
                    "input": "{{sample.output_text}}",
                    "reference": "{{item.keyword}}",
                    "operation": "ilike",
                },
                "compute_multiplier": 0.5,
                "eval_samples": 2,
                "max_completion_tokens": 8,
                **method,
            },
            "hyperparameters": {
                "n_epochs": 2,
                "batch_size": 4,
                "max_seq_length": 96,
                "eval_every": 2,
                "checkpoint_every": 2,
                "learning_rate": 1e-3,
                "seed": 1,
            },
            "output_dir": str(out),
            "device": "cpu",
            "dtype": "float32",
            **extra,
        }
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("rl-data")
    return lines("keyword_rl_train.jsonl", 8, d / "train.jsonl"), lines(
        "keyword_rl_valid.jsonl", 3, d / "valid.jsonl"
    )


def weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


def base_weights() -> dict[str, torch.Tensor]:
    """docs-llama's own weights (what a run's ``weights`` moved from)."""
    from safetensors.torch import load_file

    return load_file(str(MODELS_DIR / "docs-llama" / "model.safetensors"))


def figures(reward: dict[str, Any]) -> dict[str, Any]:
    """A step's reward figures (RewardMetrics.figures()) but its timings: what a rerun repeats."""
    return {k: v for k, v in reward.items() if not k.endswith(("_seconds", "_per_second"))}


@pytest.mark.slow
def test_a_reinforcement_job_runs_reports_rewards_and_resumes(
    tmp_path: Path, files: tuple[Path, Path]
) -> None:
    from transformers import AutoModelForCausalLM

    train, valid = files
    rec = Recorder()
    full = run_training(rl_spec(tmp_path / "a", train, valid), on_event=rec)
    assert full.steps == 4
    steps = [e for e in rec.events if isinstance(e, StepEvent)]
    assert [e.step for e in steps] == [1, 2, 3, 4]
    for e in steps:
        assert e.reward is not None and e.reward.samples == 4 * 4  # 4 prompts, 4 completions each
        assert 0 <= e.reward.reward_mean <= 1 and e.reward.generation_seconds > 0
    evals = [e for e in rec.events if isinstance(e, EvalEvent)]
    assert [e.step for e in evals] == [0, 2, 4]  # the base before step 0, every 2 steps, the end
    for ev in evals:
        assert (
            ev.reward is not None and ev.reward.samples == 3 * 2 and ev.valid_loss == -ev.reward.reward_mean
        )
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a" / "final"), local_files_only=True)
    assert model.config.model_type == "llama"
    assert json.loads((tmp_path / "a" / "final" / "config.json").read_text())["vocab_size"] > 0

    out = tmp_path / "b"
    seen = Recorder()
    cut = run_training(
        rl_spec(out, train, valid),
        on_event=seen,
        should_cancel=lambda: len([e for e in seen.events if isinstance(e, StepEvent)]) >= 2,
    )
    assert cut.cancelled and cut.steps == 2
    again = Recorder()
    resumed = run_training(rl_spec(out, train, valid), on_event=again)
    started = [e for e in again.events if isinstance(e, RunStarted)]
    assert started[0].start_step == 2
    assert [e.step for e in again.events if isinstance(e, StepEvent)] == [3, 4]
    assert resumed.steps == 4
    a, b = weights(tmp_path / "a"), weights(out)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    rewards: list[Any] = [e.reward.reward_mean for e in steps[2:] if e.reward is not None]
    resumed_rewards = [e.reward.reward_mean for e in again.events if isinstance(e, StepEvent) and e.reward]
    assert resumed_rewards == rewards  # the same rollouts: sampled from the step's seed, not the RNG's state


#: Rewards that vary within a group from the start: some completions of 8 tokens have an 'e', not all.
COMMON_LETTER = {
    "type": "string_check",
    "name": "has an e",
    "input": "{{sample.output_text}}",
    "reference": "e",
    "operation": "ilike",
}


@pytest.mark.slow
def test_lora_with_a_kl_penalty_trains_against_the_disabled_adapter(
    tmp_path: Path, files: tuple[Path, Path]
) -> None:
    """The KL term runs inside the engine's model (the adapter disabled for the reference): at step 1 the
    adapter is the base, so the loss is the KL-free one's; later steps differ."""
    train, valid = files
    hp = {
        "hyperparameters": {
            "n_epochs": 1,
            "batch_size": 4,
            "learning_rate": 1e-2,
            "seed": 1,
            "max_seq_length": 64,
        }
    }
    losses = []
    for beta in (0.0, 0.5):
        rec = Recorder()
        spec = rl_spec(
            tmp_path / str(beta),
            train,
            valid,
            lora={"r": 4},
            method={"kl_beta": beta, "grader": COMMON_LETTER},
            **hp,
        )
        run_training(spec, on_event=rec)
        steps = [e for e in rec.events if isinstance(e, StepEvent)]
        assert len(steps) == 2 and all(e.reward is not None for e in steps)
        losses.append([e.loss for e in steps])
    assert losses[1][0] == pytest.approx(losses[0][0], abs=1e-6)
    assert losses[1][1] > losses[0][1]  # the same rollouts (step 1 alike), plus a positive penalty


def test_a_prompt_leaves_room_for_its_completion(tmp_path: Path, files: tuple[Path, Path]) -> None:
    """A reinforcement job's prompt is at most max_seq_length - max_completion_tokens (the row it makes
    with its completion fits max_seq_length); other methods' examples have the whole length."""
    from trainer.resolve import example_budget

    train, valid = files
    assert example_budget(rl_spec(tmp_path, train, valid)) == 96 - 8
    auto = rl_spec(tmp_path, train, valid, method={"max_completion_tokens": "auto"})
    assert example_budget(auto) == 96 - 48  # auto: 256, capped at half of max_seq_length
    sft = JobSpec.model_validate(
        {**rl_spec(tmp_path, train, valid).model_dump(), "method": {"type": "supervised"}}
    )
    assert example_budget(sft) == 96
