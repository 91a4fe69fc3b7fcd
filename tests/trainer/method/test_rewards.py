"""A rollout graded (trainer.method.rewards): GRPO's group-normalised advantages, the reward statistics
of a step (one rank and two), and grading in order with the job's grader, a Python grader under the
limits given (a sleeping grader stopped at a small wall clock)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from contract.graders import Grader, PythonGrader, StringCheckGrader
from trainer.graders.grading import Grading
from trainer.graders.result import GraderErrors, GradeResult
from trainer.graders.sandbox import SandboxLimits, run_python_grader
from trainer.method import rewards
from trainer.method.rewards import ADVANTAGE_EPS, Graded, RewardSums, grade_all, group_advantages


def keyword_grader() -> StringCheckGrader:
    return StringCheckGrader.model_validate(
        {
            "type": "string_check",
            "name": "uses the word",
            "input": "{{sample.output_text}}",
            "reference": "{{item.keyword}}",
            "operation": "ilike",
        }
    )


def test_advantages_are_zero_mean_per_group_and_scaled_by_the_sample_std() -> None:
    r = [1.0, 0.0, 0.0, 0.0, 0.5, 0.25, 0.75, 0.5]
    adv = group_advantages(r, 4)
    assert len(adv) == 8
    for g in (adv[:4], adv[4:]):
        assert sum(g) == pytest.approx(0.0, abs=1e-9)
    # group 1: mean 0.25, sample std sqrt(0.75 / 3) = 0.5
    assert adv[:4] == pytest.approx([0.75 / (0.5 + ADVANTAGE_EPS), *[-0.25 / (0.5 + ADVANTAGE_EPS)] * 3])
    # group 2: mean 0.5, sample std sqrt(0.125 / 3)
    std = math.sqrt(0.125 / 3)
    assert adv[5] == pytest.approx(-0.25 / (std + ADVANTAGE_EPS))
    assert adv[4] == 0.0 and adv[7] == 0.0


def test_a_group_of_equal_rewards_has_zero_advantages() -> None:
    assert group_advantages([0.3, 0.3, 0.3, 1.0, 0.0, 1.0], 3)[:3] == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 1.0], 2) == [0.0, 0.0]
    assert group_advantages([], 4) == []
    big = group_advantages([0.0, 1.0], 2)  # two samples: +-1/sqrt(2) over sqrt(0.5)
    assert big == pytest.approx(
        [-0.5 / (math.sqrt(0.5) + ADVANTAGE_EPS), 0.5 / (math.sqrt(0.5) + ADVANTAGE_EPS)]
    )


def result(reward: float, *, sub: dict[str, float] | None = None, **flags: Any) -> GradeResult:
    return GradeResult(reward, "g", "multi", GraderErrors(**flags), sub_rewards=sub or {})


def test_reward_metrics_of_one_rank() -> None:
    sums = RewardSums(sub_names=("a", "b"))
    graded = Graded(
        [
            result(1.0, sub={"a": 1.0, "b": 0.5}),
            result(0.0, sub={"a": 0.0}, formula_parse_error=True),
            result(0.5, sub={"a": 1.0, "b": 0.0}, python_grader_runtime_error=True, other_error=True),
            result(0.25, sub={"a": 0.0, "b": 1.0}),
        ],
        seconds=0.5,
    )
    sums.add(graded, [4, 6, 10, 4], [False, False, True, True], seconds=2.0)
    m = sums.metrics(None)
    assert (m.reward_mean, m.reward_min, m.reward_max, m.samples) == (0.4375, 0.0, 1.0, 4)
    assert m.completion_tokens_mean == 6.0 and m.truncated_fraction == 0.5
    assert m.grader_errors == 2
    assert m.grader_error_flags == {
        "formula_parse_error": 1,
        "other_error": 1,
        "python_grader_runtime_error": 1,
    }
    assert m.sub_rewards == {"a": 0.5, "b": 0.375}  # a missing sub-reward counts 0
    assert (m.generation_seconds, m.grading_seconds, m.rollout_tokens_per_second) == (2.0, 0.5, 12.0)
    assert m.examples == []


def test_reward_metrics_with_no_samples() -> None:
    m = RewardSums(sub_names=("a",)).metrics(None)
    assert (m.reward_mean, m.reward_min, m.reward_max, m.samples, m.grader_errors) == (0.0, 0.0, 0.0, 0, 0)
    assert m.completion_tokens_mean == 0.0 and m.truncated_fraction == 0.0
    assert m.rollout_tokens_per_second == 0.0 and m.grader_error_flags == {} and m.sub_rewards == {"a": 0.0}
    assert all(math.isfinite(v) for v in (m.reward_min, m.reward_max))


def test_two_ranks_sum_counts_and_take_extremes_of_the_ranks_with_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 graded nothing (its inf/-inf must not leak), rank 0 four completions; the seconds are the
    ranks' mean (they sample at once)."""
    busy, idle = RewardSums(), RewardSums()
    busy.add(
        Graded([result(0.5), result(0.75), result(0.25), result(0.5)], 1.0), [2, 2, 2, 2], [False] * 4, 3.0
    )
    idle.generation_seconds, idle.grading_seconds = 1.0, 0.0
    sent: list[list[float]] = []

    def capture(ctx: Any, values: Sequence[float]) -> list[float]:
        sent.append(list(values))
        return list(values)

    monkeypatch.setattr(rewards, "all_sum", capture)
    idle._summed(SimpleNamespace(rank=1, world_size=2))  # type: ignore[arg-type]
    monkeypatch.setattr(rewards, "all_sum", lambda ctx, v: [a + b for a, b in zip(v, sent[0], strict=True)])
    m = busy.metrics(SimpleNamespace(rank=0, world_size=2))  # type: ignore[arg-type]
    assert (m.reward_mean, m.reward_min, m.reward_max, m.samples) == (0.5, 0.25, 0.75, 4)
    assert m.generation_seconds == 2.0 and m.grading_seconds == 0.5
    assert m.rollout_tokens_per_second == 4.0  # 8 tokens over the ranks' mean 2 s


def test_grade_all_keeps_the_order_and_each_rows_item(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rewards, "GRADING_THREADS", 4)
    words = [f"w{k}" for k in range(40)]
    texts = [f"a sentence with {w}" if k % 3 == 0 else "nothing here" for k, w in enumerate(words)]
    grader: Grader = keyword_grader()
    g = grade_all(grader, texts, [{"keyword": w} for w in words])
    assert g.rewards == [1.0 if k % 3 == 0 else 0.0 for k in range(40)]
    assert g.seconds >= 0 and not any(r.errors.any() for r in g.results)
    # the text of row k against row k's item only: W2's row mentions w1, which is not its keyword
    g = grade_all(
        grader, ["W0!", "about w1", "w1 again"], [{"keyword": "w0"}, {"keyword": "w1"}, {"keyword": "w2"}]
    )
    assert g.rewards == [1.0, 1.0, 0.0]
    missing = grade_all(grader, ["x"], [{}])
    assert missing.rewards == [0.0] and missing.results[0].errors.any()


SLEEPER = "import time\n\ndef grade(sample, item):\n    time.sleep(60)\n    return 1.0\n"


def sandbox_available() -> bool:
    return run_python_grader("def grade(sample, item):\n    return 1\n", {}, {}).error != "server"


def sleeping_grader() -> PythonGrader:
    return PythonGrader.model_validate({"type": "python", "name": "sleeps", "source": SLEEPER})


def test_grade_all_runs_a_python_grader_under_the_limits_given() -> None:
    """A grader that sleeps a minute is stopped at the given wall clock (1 s), each call flagged."""
    if not sandbox_available():
        pytest.skip("no sandbox on this host")
    limits = SandboxLimits(wall_seconds=1.0)
    t0 = time.monotonic()
    g = grade_all(sleeping_grader(), ["a", "b", "c"], [{}, {}, {}], Grading(limits))
    took = time.monotonic() - t0
    assert g.rewards == [0.0, 0.0, 0.0]
    for r in g.results:
        assert r.errors.python_grader_runtime_error
        assert r.errors.python_grader_runtime_error_details == "timed out after 1 s (wall)"
    assert took < 2 * limits.wall_seconds + 10  # the three calls at once; interpreters' start on a loaded box
