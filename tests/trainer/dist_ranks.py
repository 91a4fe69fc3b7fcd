"""Run training jobs as N gloo ranks on the CPU, each rank a spawned process (torch.multiprocessing),
for the multi-rank tests. Every rank runs the same list of jobs in order inside one process group (one
start-up for several runs); the test process gets each rank's results back through a queue, and every
wait has a deadline so that a hang fails the test instead of blocking it."""

from __future__ import annotations

import os
import queue
import traceback
from dataclasses import dataclass, field
from typing import Any

from trainer.events import Event
from trainer.run.launch import free_port
from trainer.spec import JobSpec


@dataclass(frozen=True)
class Job:
    spec: JobSpec
    #: Ask to cancel once this many steps ran in this call (on the ranks in ``cancel_ranks``).
    cancel_after: int | None = None
    cancel_ranks: tuple[int, ...] = (0,)


@dataclass
class RankOutcome:
    rank: int
    result: dict[str, Any] | None = None
    #: (event type, step or None, loss or None, the StepEvent's engine rank or None), in order.
    events: list[tuple[str, int | None, float | None, int | None]] = field(default_factory=list)
    error: str | None = None


class _Watch:
    """on_event and should_cancel of one run on one rank."""

    def __init__(self, job: Job, rank: int) -> None:
        self.job, self.rank, self.steps = job, rank, 0
        self.events: list[tuple[str, int | None, float | None, int | None]] = []

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

    def cancel(self) -> bool:
        j = self.job
        return j.cancel_after is not None and self.rank in j.cancel_ranks and self.steps >= j.cancel_after


def _rank_main(rank: int, world: int, port: int, jobs: list[Job], out: Any) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    import torch

    torch.set_num_threads(1)
    from trainer.run.distributed import init_from_env, shutdown
    from trainer.run.loop import run_training

    ctx = init_from_env(device="cpu", timeout_seconds=120)
    try:
        for job in jobs:
            w = _Watch(job, rank)
            o = RankOutcome(rank)
            try:
                o.result = run_training(
                    job.spec, on_event=w, should_cancel=w.cancel, dist=ctx, progress=False
                ).as_dict()
            except Exception as e:
                o.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            o.events = w.events
            out.put(o)
    finally:
        shutdown(ctx)


def run_ranks(jobs: list[Job], world: int = 2, timeout: float = 300) -> list[list[RankOutcome]]:
    """Each job's outcomes, by rank. Raises AssertionError when a rank hangs or dies."""
    import time

    import torch.multiprocessing as mp

    from offload.cpu_adam import load_extension

    load_extension()  # built once here: ranks killed at the deadline mid-build would leave its lock behind
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, jobs, q), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    got: list[RankOutcome] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world * len(jobs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"ranks timed out after {timeout} s with {len(got)} outcomes")
            try:
                got.append(q.get(timeout=min(left, 5)))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise AssertionError(
                        f"rank process died: exit codes {[p.exitcode for p in procs]}"
                    ) from None
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            assert p.exitcode == 0, f"rank exit code {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    by_job: list[list[RankOutcome]] = [[] for _ in jobs]
    counts = [0] * world
    for o in got:  # each rank reports its jobs in order
        by_job[counts[o.rank]].append(o)
        counts[o.rank] += 1
    return [sorted(x, key=lambda o: o.rank) for x in by_job]
