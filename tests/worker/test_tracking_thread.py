"""The tracking thread (worker.tracking.base.Tracking) never holds training up: a sink stuck on its
server leaves the training thread's calls returning, the queue bounded (dropped events, one warning),
a sink that raises is one warning and the others still get every event; close drains the queue."""

from __future__ import annotations

import threading
from typing import Any

from trainer.events import Event, LogEvent
from worker.tracking.base import Sink, Tracking


class Recording(Sink):
    kind = "recording"

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate, self.seen, self.closed = gate, [], []  # type: ignore[var-annotated]

    def handle(self, ev: Event) -> None:
        if self.gate is not None:
            self.gate.wait()
        self.seen.append(ev)

    def close(self, deadline: float, *, succeeded: bool) -> None:
        self.closed.append(succeeded)


class Failing(Recording):
    kind = "failing"

    def handle(self, ev: Event) -> None:
        raise ConnectionError("tracking server away (test)")


def _events(n: int) -> list[Event]:
    return [LogEvent(f"event {i}") for i in range(n)]


def test_a_stuck_sink_never_blocks_the_training_thread() -> None:
    warnings: list[tuple[str, dict[str, Any]]] = []
    gate = threading.Event()
    sink = Recording(gate)
    tracking = Tracking([sink], warn=lambda m, d: warnings.append((m, d)), max_items=3, flush_seconds=60)
    events = _events(50)
    training = threading.Thread(target=lambda: [tracking(ev) for ev in events])
    training.start()
    training.join(60)  # the sink holds its first event until the gate opens: the calls must return anyway
    assert not training.is_alive()
    assert tracking.dropped >= 50 - 3 - 1  # the queue's 3, and the one the thread holds
    assert [m for m, _ in warnings] == [
        "Tracking is behind: training events are being dropped for the tracking servers"
    ]
    gate.set()
    tracking.close(succeeded=True, seconds=5)
    assert sink.seen == events[: len(sink.seen)] and 50 - tracking.dropped == len(sink.seen)
    assert sink.closed == [True]
    tracking(LogEvent("after close"))  # ignored, no error
    tracking.close(succeeded=False, seconds=5)  # idempotent
    assert sink.closed == [True]


def test_a_failing_sink_is_one_warning_and_the_others_get_every_event() -> None:
    warnings: list[tuple[str, dict[str, Any]]] = []
    good, bad = Recording(), Failing()
    tracking = Tracking(
        [bad, good], warn=lambda m, d: warnings.append((m, d)), max_items=1000, flush_seconds=60
    )
    seen: list[Event] = []
    on_event = tracking.wrap(seen.append)
    events = _events(20)
    for ev in events:
        on_event(ev)
    tracking.close(succeeded=False, seconds=5)
    assert seen == events and good.seen == events and good.closed == [False] and bad.closed == [False]
    assert warnings == [
        (
            "Tracking (failing) failed: ConnectionError; training goes on",
            {"tracking": "failing", "error_type": "ConnectionError"},
        )
    ]


def test_no_sinks_no_thread() -> None:
    tracking = Tracking([], warn=lambda m, d: None, max_items=1, flush_seconds=1)
    for ev in _events(5):
        tracking(ev)
    tracking.close(succeeded=True)
    assert tracking.dropped == 0


def test_a_dpo_jobs_rewards_and_accuracy_are_tracked() -> None:
    """A DPO step's and evaluation's preference figures reach the trackers beside the losses; a supervised
    job's metrics carry none."""
    from offload.step_metrics import StepMetrics
    from trainer.events import EvalEvent, PreferenceMetrics, StepEvent
    from worker.tracking.base import STEP_METRICS, eval_metrics, step_metrics

    pref = PreferenceMetrics(chosen_reward=0.3, rejected_reward=-0.1, reward_margin=0.4, accuracy=0.75)
    engine = StepMetrics(
        step=1, wall_seconds=0.5, compute_seconds=0.4, stall_seconds=0.1, cpu_optimizer_seconds=0.2,
        bytes_device_to_host=0, bytes_host_to_device=0, device_optimizer_state_bytes=0,
    )  # fmt: skip
    step = StepEvent(
        step=1, total_steps=4, epoch=0, loss=0.6, lr=1e-4, tokens=100, tokens_per_second=200.0,
        step_seconds=0.5, stall_seconds=0.1, stall_fraction=0.2, engine=engine, preference=pref,
    )  # fmt: skip
    got = step_metrics(step, on_cuda=False)
    assert set(STEP_METRICS) <= set(got)
    assert got["dpo_reward_margin"] == 0.4 and got["dpo_accuracy"] == 0.75
    assert got["dpo_chosen_reward"] == 0.3 and got["dpo_rejected_reward"] == -0.1
    supervised = step_metrics(StepEvent(**{**step.__dict__, "preference": None}), on_cuda=False)
    assert not [k for k in supervised if k.startswith("dpo_")]
    valid = eval_metrics(EvalEvent(step=1, valid_loss=0.5, valid_tokens=10, preference=pref))
    assert valid == {
        "valid_loss": 0.5,
        "dpo_valid_chosen_reward": 0.3,
        "dpo_valid_rejected_reward": -0.1,
        "dpo_valid_reward_margin": 0.4,
        "dpo_valid_accuracy": 0.75,
    }


def test_a_reinforcement_jobs_rewards_are_tracked() -> None:
    """A reinforcement step's rewards, lengths, grader errors and times reach the trackers, each sub-reward
    under a key MLflow accepts; an evaluation's mean reward as ``rft_valid_reward_mean``."""
    from tests.trainer.rewards import reward_eval, reward_step
    from worker.tracking.base import STEP_METRICS, eval_metrics, metric_key, step_metrics

    got = step_metrics(reward_step(), on_cuda=False)
    assert set(STEP_METRICS) <= set(got)
    assert {k: v for k, v in got.items() if k.startswith("rft_")} == {
        "rft_reward_mean": 0.41,
        "rft_reward_min": 0.0,
        "rft_reward_max": 1.0,
        "rft_completion_tokens_mean": 12.5,
        "rft_grader_errors": 2.0,
        "rft_generation_seconds": 1.5,
        "rft_grading_seconds": 0.25,
        "rft_sub_reward/exact match": 0.5,
        "rft_sub_reward/fuzzy__x__": 0.25,
    }
    assert not [k for k in step_metrics(reward_step(reward=None), on_cuda=False) if k.startswith("rft_")]
    assert eval_metrics(reward_eval()) == {"valid_loss": -0.44, "rft_valid_reward_mean": 0.44}
    assert metric_key("a:b\n" + "c" * 200) == ("a_b_" + "c" * 200)[:100]
