"""Training jobs on N gloo ranks on the CPU, for the multi-rank tests: every rank runs the same list of
jobs in order inside one process group (one start-up for several runs), on the rank harness of
tests/dist_ranks.py (spawned processes, a deadline, each rank's results returned)."""

from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from tests.dist_ranks import run_ranks
from trainer.events import EvalEvent, Event, LogEvent, StepEvent
from trainer.spec import JobSpec


@dataclass(frozen=True)
class Job:
    spec: JobSpec
    #: Ask to cancel once this many steps ran in this call (on the ranks in ``cancel_ranks``). Counted
    #: by polls (the loop asks once before each step): with ranks a step's event comes a step late.
    cancel_after: int | None = None
    cancel_ranks: tuple[int, ...] = (0,)


@dataclass
class RankOutcome:
    rank: int
    result: dict[str, Any] | None = None
    #: (event type, step or None, loss or None, the StepEvent's engine rank or None), in order.
    events: list[tuple[str, int | None, float | None, int | None]] = field(default_factory=list)
    error: str | None = None
    #: All-reduces of the training loop: "step" (one per step, trainer.run.step) and "loop" (the
    #: loss at an evaluation, checkpoint or the end, and the validation sums).
    reductions: dict[str, int] = field(default_factory=dict)
    #: The LogEvents' (message, data), in order.
    logs: list[tuple[str, dict[str, Any] | None]] = field(default_factory=list)
    #: A reinforcement job's reward figures, (event type, step, RewardMetrics as a dict), in order.
    rewards: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)


class _Watch:
    """on_event and should_cancel of one run on one rank."""

    def __init__(self, job: Job, rank: int) -> None:
        self.job, self.rank, self.steps, self.polls = job, rank, 0, 0
        self.events: list[tuple[str, int | None, float | None, int | None]] = []
        self.logs: list[tuple[str, dict[str, Any] | None]] = []
        self.rewards: list[tuple[str, int, dict[str, Any]]] = []

    def __call__(self, ev: Event) -> None:
        engine = getattr(ev, "engine", None)
        self.events.append(
            (
                ev.type,
                getattr(ev, "step", None),
                getattr(ev, "loss", None),
                getattr(engine, "rank", None) if engine is not None else None,
            )
        )
        if ev.type == "step":
            self.steps += 1
        if isinstance(ev, LogEvent):
            self.logs.append((ev.message, ev.data))
        if isinstance(ev, StepEvent | EvalEvent) and ev.reward is not None:
            self.rewards.append((ev.type, ev.step, asdict(ev.reward)))

    def cancel(self) -> bool:
        j = self.job
        ran, self.polls = self.polls, self.polls + 1
        return j.cancel_after is not None and self.rank in j.cancel_ranks and ran >= j.cancel_after


def _train_jobs(rank: int, world: int, jobs: list[Job]) -> list[RankOutcome]:
    """One rank: each job through ``run_training`` in the process group the harness joined."""
    import trainer.method.supervised
    import trainer.run.loop
    import trainer.run.step
    from trainer.run.distributed import init_from_env
    from trainer.run.loop import run_training

    counts: dict[str, int] = {}

    def counting(where: str, real: Any) -> Any:
        def all_sum(*a: Any, **k: Any) -> Any:
            counts[where] = counts.get(where, 0) + 1
            return real(*a, **k)

        return all_sum

    trainer.run.step.all_sum = counting("step", trainer.run.step.all_sum)  # type: ignore[attr-defined]
    trainer.run.loop.all_sum = counting("loop", trainer.run.loop.all_sum)  # type: ignore[attr-defined]
    # a supervised job's validation sums, the loop's too
    supervised = trainer.method.supervised
    supervised.all_sum = counting("loop", supervised.all_sum)  # type: ignore[attr-defined]

    ctx = init_from_env(device="cpu", timeout_seconds=120)  # the harness's group, as a DistContext
    outcomes = []
    for job in jobs:
        w = _Watch(job, rank)
        o = RankOutcome(rank)
        counts.clear()
        try:
            o.result = run_training(
                job.spec, on_event=w, should_cancel=w.cancel, dist=ctx, progress=False
            ).as_dict()
        except Exception as e:
            o.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        o.events, o.logs, o.rewards = w.events, w.logs, w.rewards
        o.reductions = dict(counts)
        outcomes.append(o)
    return outcomes


def train_on_ranks(jobs: list[Job], world: int = 2, timeout: float = 300) -> list[list[RankOutcome]]:
    """Each job's outcomes, by rank. Raises when a rank hangs or dies."""
    by_rank = run_ranks(_train_jobs, world, jobs, timeout=timeout)
    return [[by_rank[r][i] for r in range(world)] for i in range(len(jobs))]
