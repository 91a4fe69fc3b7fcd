"""A reinforcement job's rewards in its rows (worker.job.reporter): the step event's message and data,
the step's ``method_metrics``, the evaluation's validation reward and its graded samples (bounded)."""

from __future__ import annotations

from dataclasses import replace

from tests.trainer.rewards import EXAMPLES, reward_eval, reward_step
from trainer.events import PreferenceMetrics
from worker.job.reporter import SAMPLE_CHARS, DBReporter
from worker.job.writer import Write, _StepRows


class _Writer:
    def __init__(self) -> None:
        self.writes: list[Write] = []

    def put(self, w: Write) -> None:
        self.writes.append(w)


def _report(*events: object) -> list[Write]:
    writer = _Writer()
    reporter = DBReporter(writer)  # type: ignore[arg-type]
    for ev in events:
        reporter(ev)  # type: ignore[arg-type]
    return writer.writes


def test_a_reinforcement_step_shows_its_rewards() -> None:
    (w,) = _report(reward_step())
    (event,) = w.events
    assert event["message"] == "Step 20/120: training loss=0.0000, reward mean=0.41 (min 0.00, max 1.00)"
    data = event["data"]
    assert (data["reward_mean"], data["reward_min"], data["reward_max"]) == (0.41, 0.0, 1.0)
    assert data["sub_rewards"] == {"exact match": 0.5, "fuzzy{{x}}": 0.25}
    assert data["grader_error_flags"] == {"model_grader_parse_error": 2}
    assert data["completion_tokens_mean"] == 12.5 and data["grader_errors"] == 2
    assert data["generation_seconds"] == 1.5 and data["grading_seconds"] == 0.25
    assert "examples" not in data
    assert w.metric is not None and w.metric["method_metrics"]["reward_mean"] == 0.41
    rows = _StepRows("ftjob-1", {})
    rows.take(w)
    assert rows.added[20]["method_metrics"]["sub_rewards"]["exact match"] == 0.5


def test_other_methods_steps_have_no_method_metrics() -> None:
    (w,) = _report(reward_step(reward=None))
    assert w.metric is not None and "method_metrics" not in w.metric
    assert w.events[0]["message"] == "Step 20/120: training loss=0.0000"
    rows = _StepRows("ftjob-1", {})
    rows.take(w)
    assert rows.added[20]["method_metrics"] is None


def test_a_dpo_step_keeps_its_reward_margin_and_accuracy_in_method_metrics() -> None:
    pref = PreferenceMetrics(chosen_reward=0.3, rejected_reward=-0.2, reward_margin=0.5, accuracy=0.75)
    (w,) = _report(reward_step(reward=None, preference=pref))
    assert w.events[0]["message"] == "Step 20/120: training loss=0.0000, preference accuracy=0.75"
    assert w.metric is not None and w.metric["method_metrics"] == {
        "chosen_reward": 0.3,
        "rejected_reward": -0.2,
        "reward_margin": 0.5,
        "accuracy": 0.75,
    }


def test_a_reinforcement_evaluation_shows_its_reward_and_graded_samples() -> None:
    (w,) = _report(reward_eval())
    assert w.valid_loss == {"step": 20, "valid_loss": -0.44}
    metrics, samples = w.events
    assert metrics["message"] == "Step 20: validation reward=0.44 (32 samples)"
    assert metrics["data"]["valid_reward_mean"] == 0.44 and metrics["data"]["valid_samples"] == 32
    assert metrics["data"]["valid_loss"] == -0.44 and "valid_examples" not in metrics["data"]
    message = samples["message"]
    assert message.startswith('Step 20: graded samples: reward 1.00 "Paris and more')
    assert 'reward 0.00 "Quito"' in message and "(errors: model_grader_parse_error)" in message
    assert message.endswith("; 1 more") and len(message) < 600
    kept = samples["data"]["samples"]
    assert [s["reward"] for s in kept] == [e.reward for e in EXAMPLES]
    assert kept[1] == {"prompt": "Capital of Peru?", "completion": "Quito", "reward": 0.0, "errors": []}
    assert len(kept[0]["completion"]) == SAMPLE_CHARS  # cut


def test_an_evaluation_without_examples_makes_one_event() -> None:
    ev = reward_eval()
    assert ev.reward is not None
    (w,) = _report(replace(ev, reward=replace(ev.reward, examples=[])))
    assert len(w.events) == 1
