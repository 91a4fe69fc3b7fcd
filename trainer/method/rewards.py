"""A rollout graded: each completion's reward (the job's grader, trainer.graders), the group-normalised
advantages GRPO learns from, and the reward statistics a step or an evaluation reports.

A grader never raises: a completion it could not grade gets reward 0 and its error flags, counted in
the statistics. Completions are graded by a small thread pool (a Python grader is a sandboxed process
per call, a model grader a request to a served model), in order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from contract.graders import Grader
from trainer.events import GradedSample, RewardMetrics
from trainer.graders.grading import Grading
from trainer.graders.result import GraderErrors, GradeResult, Sample
from trainer.run.distributed import DistContext, all_sum

#: Graders running at once in one rank.
GRADING_THREADS = 8
#: A group whose rewards are all equal teaches nothing; its advantages are 0, never 0/0.
ADVANTAGE_EPS = 1e-4
#: The boolean flags of GraderErrors, in a fixed order (summed over ranks by position).
ERROR_FLAGS = tuple(k for k, v in asdict(GraderErrors()).items() if isinstance(v, bool))


@dataclass(frozen=True)
class Graded:
    results: list[GradeResult]
    seconds: float

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.results]


def grade_all(
    grader: Grader,
    texts: Sequence[str],
    items: Sequence[Mapping[str, Any]],
    grading: Grading | None = None,
) -> Graded:
    """Each ``texts[i]`` graded against ``items[i]`` (trainer.graders.grade.grade), in order, with the
    run's ``grading`` (None: the sandbox's default limits, no judge, no embeddings)."""
    from trainer.graders.grade import grade

    g = grading or Grading()
    t0 = time.perf_counter()

    def one(k: int) -> GradeResult:
        sample = Sample.of_text(texts[k])
        return grade(grader, sample, items[k], judge=g.judge, limits=g.limits, embed=g.embed)

    with ThreadPoolExecutor(max_workers=max(1, min(GRADING_THREADS, len(texts)))) as pool:
        results = list(pool.map(one, range(len(texts))))
    return Graded(results, time.perf_counter() - t0)


def group_advantages(rewards: Sequence[float], n: int) -> list[float]:
    """Each reward's advantage within its group of ``n`` (one prompt's completions): (r - mean) / (std +
    eps), the sample standard deviation (GRPO's normalisation)."""
    out: list[float] = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        mean = sum(group) / len(group)
        var = sum((r - mean) ** 2 for r in group) / max(1, len(group) - 1)
        out += [(r - mean) / (math.sqrt(var) + ADVANTAGE_EPS) for r in group]
    return out


def error_flags(errors: GraderErrors) -> list[str]:
    """The names of the boolean flags set in ``errors``."""
    d = asdict(errors)
    return [k for k in ERROR_FLAGS if d[k]]


@dataclass
class RewardSums:
    """Rewards and counts of a step's (or an evaluation's) completions on this rank, until
    :meth:`metrics` sums them over the ranks."""

    sub_names: tuple[str, ...] = ()
    total: float = 0.0
    lowest: float = math.inf
    highest: float = -math.inf
    samples: int = 0
    tokens: int = 0
    truncated: int = 0
    errors: int = 0
    flags: dict[str, int] = field(default_factory=dict)
    sub_sums: dict[str, float] = field(default_factory=dict)
    generation_seconds: float = 0.0
    grading_seconds: float = 0.0
    examples: list[GradedSample] = field(default_factory=list)

    def add(self, graded: Graded, lengths: Sequence[int], truncated: Sequence[bool], seconds: float) -> None:
        """A rollout's completions (their token counts and truncation) as graded; ``seconds`` sampling."""
        for r in graded.results:
            self.total += r.reward
            self.lowest, self.highest = min(self.lowest, r.reward), max(self.highest, r.reward)
            flags = error_flags(r.errors)
            self.errors += 1 if flags else 0
            for f in flags:
                self.flags[f] = self.flags.get(f, 0) + 1
            for name in self.sub_names:
                self.sub_sums[name] = self.sub_sums.get(name, 0.0) + float(r.sub_rewards.get(name, 0.0))
        self.samples += len(graded.results)
        self.tokens += sum(lengths)
        self.truncated += sum(truncated)
        self.generation_seconds += seconds
        self.grading_seconds += graded.seconds

    def metrics(self, dist: DistContext | None) -> RewardMetrics:
        """The statistics over every rank's completions (one host all-reduce with ranks)."""
        vals = self._summed(dist)
        n = max(vals["samples"], 1.0)
        gen = vals["generation_seconds"]
        return RewardMetrics(
            reward_mean=vals["total"] / n,
            reward_min=vals["lowest"] if vals["samples"] else 0.0,
            reward_max=vals["highest"] if vals["samples"] else 0.0,
            samples=int(vals["samples"]),
            completion_tokens_mean=vals["tokens"] / n,
            truncated_fraction=vals["truncated"] / n,
            grader_errors=int(vals["errors"]),
            grader_error_flags={k: int(vals[f"flag:{k}"]) for k in ERROR_FLAGS if vals[f"flag:{k}"]},
            sub_rewards={k: vals[f"sub:{k}"] / n for k in self.sub_names},
            generation_seconds=gen,
            grading_seconds=vals["grading_seconds"],
            rollout_tokens_per_second=vals["tokens"] / gen if gen > 0 else 0.0,
            examples=list(self.examples),
        )

    def _summed(self, dist: DistContext | None) -> dict[str, float]:
        """Every count summed over the ranks; the lowest and highest reward each rank's in its own slot."""
        sums: dict[str, float] = {
            "total": self.total,
            "samples": float(self.samples),
            "tokens": float(self.tokens),
            "truncated": float(self.truncated),
            "errors": float(self.errors),
            "generation_seconds": self.generation_seconds,
            "grading_seconds": self.grading_seconds,
            **{f"flag:{k}": float(self.flags.get(k, 0)) for k in ERROR_FLAGS},
            **{f"sub:{k}": self.sub_sums.get(k, 0.0) for k in self.sub_names},
        }
        if dist is None:
            return {**sums, "lowest": self.lowest, "highest": self.highest}
        keys = list(sums)
        ranks = dist.world_size
        slots = [0.0] * (2 * ranks)
        if self.samples:
            slots[dist.rank], slots[ranks + dist.rank] = self.lowest, self.highest
        had = [1.0 if self.samples and r == dist.rank else 0.0 for r in range(ranks)]
        got = all_sum(dist, [sums[k] for k in keys] + slots + had)
        out = dict(zip(keys, got[: len(keys)], strict=True))
        tail = got[len(keys) :]
        present = [r for r in range(ranks) if tail[2 * ranks + r] > 0]
        out["lowest"] = min((tail[r] for r in present), default=0.0)
        out["highest"] = max((tail[ranks + r] for r in present), default=0.0)
        # seconds per rank (the ranks sample and grade at once): their mean, not their sum
        out["generation_seconds"] /= ranks
        out["grading_seconds"] /= ranks
        return out
