"""Reinforcement fine-tuning with GRPO (Shao et al. 2024): a group of completions sampled per prompt
from the current policy, scored by the job's grader, and a clipped policy-gradient step on the
group-normalised advantages (:class:`ReinforcementTraining`, the method in a run).

A step's micro-batches are made by its rollout (:mod:`trainer.method.rollout`: ``samples_per_prompt``
completions of each of its prompts, KV-cached sampling under no_grad), graded
(:mod:`trainer.method.rewards`), each completion's advantage ``(r - mean) / (std + eps)`` within its
prompt's group. The loss of a completion token with log-probability ``lp`` is
``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)`` with ``ratio = exp(lp - lp_sampled)``; the step
takes one update per rollout, so the ratio is 1 in value (``lp_sampled`` is ``lp`` detached) and the
gradient is the policy gradient ``-A * grad lp``. Summed over the completions' tokens and divided by
the step's completion tokens over all ranks (trainer.run.step), every token weighs the same (the
token-level mean, which does not favour short completions as a per-sequence mean does).

The KL penalty (``kl_beta`` > 0, LoRA only) adds ``beta * (exp(d) - d - 1)`` per token, ``d = lp_ref -
lp`` (Schulman's k3 estimator), the reference being the base with the adapter disabled; a full
fine-tune trains KL-free (a reference would be a second copy of the weights). Dropout is off, as for
DPO: the completions' log-probabilities are then the policy's own.

Validation samples ``eval_samples`` completions of each validation prompt with the same seed at every
evaluation (so two evaluations differ by the weights alone) and reports their mean reward; its
``valid_loss`` is the negative mean reward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from contract.method import ResolvedMethod, ResolvedReinforcement
from trainer.data.batching import Batch, collate, rank_part
from trainer.data.example import IGNORE_INDEX, Example, RolloutPrompt
from trainer.events import EvalEvent, GradedSample, RewardMetrics
from trainer.graders.grading import Grading
from trainer.graders.validate import model_graders
from trainer.method.base import Batching, MethodSetup
from trainer.method.dpo import disable_dropout
from trainer.method.rewards import RewardSums, error_flags, grade_all, group_advantages
from trainer.method.rollout import Rollout, Sampling, rollout_seed, sample_completions
from trainer.run.distributed import DistContext

if TYPE_CHECKING:
    import torch


#: Graded completions an evaluation shows in its event.
SHOWN_SAMPLES = 3
#: Characters of a prompt or completion shown in an event.
SHOWN_CHARS = 400


@dataclass
class RolloutBatch:
    """A micro-batch of completions: ``batch`` rows are prompt + completion (labels on the completion's
    tokens only), ``advantages`` one per row."""

    batch: Batch
    advantages: torch.Tensor
    num_tokens: int
    #: The completions' tokens: what the step's loss averages over.
    num_learned: int


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a completion: eos and the chat template's end of turn (found by rendering a
    conversation: once per run, in ``prepare``)."""
    from trainer.data.tokenizer import end_of_turn_token

    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if (eot := end_of_turn_token(tokenizer)) is not None:
        stops.add(int(tokenizer.convert_tokens_to_ids(eot)))
    return tuple(sorted(stops))


def train_seed(seed: int, step: int, index: Sequence[int]) -> int:
    """A training rollout's seed: the run's seed, the optimizer step (0-based over the epochs: the same
    prompts in a later epoch sample afresh) and the prompts' indices (each rank's part its own), so a
    resumed run samples what the uninterrupted one did."""
    return rollout_seed(seed, "train", step, tuple(index))


def _prompt(ex: Example) -> RolloutPrompt:
    if not isinstance(ex, RolloutPrompt):
        raise TypeError("a reinforcement job's examples are prompts")
    return ex


def rows_of(prompts: Sequence[RolloutPrompt], rollout: Rollout, n: int) -> list[Example]:
    """Each completion as a training row: its prompt (context) then its tokens (learned)."""
    rows = []
    for k, completion in enumerate(rollout.completions):
        p = prompts[k // n].input_ids
        rows.append(Example([*p, *completion], [IGNORE_INDEX] * len(p) + list(completion)))
    return rows


def token_logps(model: Any, batch: Batch) -> torch.Tensor:
    """Each position's log-probability of its next token (float32, 0 where nothing is learned)."""
    import torch.nn.functional as F

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    labels = batch.labels[:, 1:]
    nll = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none"
    )
    return -nll


class ReinforcementTraining:
    """:class:`trainer.method.base.TrainingMethod` of ``reinforcement`` (see the module doc)."""

    #: The base's reward is the baseline every later evaluation is read against.
    eval_before_training = True

    def __init__(self, m: ResolvedReinforcement) -> None:
        self.m = m
        self.tokenizer: Any = None
        #: The model as the run trains it (the rollouts sample from it; prepared before the engine).
        self.model: Any = None
        self.seed = 0
        self.sharded = False
        self.grading = Grading()
        self.stop_ids: tuple[int, ...] = ()
        self.sums = self._new_sums()

    @classmethod
    def of(cls, resolved: ResolvedMethod) -> ReinforcementTraining:
        assert isinstance(resolved, ResolvedReinforcement)
        return cls(resolved)

    def _new_sums(self) -> RewardSums:
        grader = self.m.grader
        names = tuple(grader.graders) if grader.type == "multi" else ()
        return RewardSums(sub_names=names)

    def prepare(self, setup: MethodSetup) -> None:
        """Dropout off; the tokenizer (completions are graded as text), the run's seed and its graders'
        judge and sandbox limits kept. A grader with model graders and no judge to ask is refused here,
        before a step is trained on rewards of 0."""
        judged = next(model_graders(self.m.grader, "method.grader"), None)
        if judged is not None and setup.grading.judge is None:
            raise ValueError(
                f"{judged[0]}: model graders need a served model to ask, and this run has none (a job's "
                "model graders are judged by the service's serving process: submit it to the API)"
            )
        disable_dropout(setup.model)
        self.model = setup.model
        self.tokenizer, self.seed, self.sharded = setup.tokenizer, setup.batching.hp.seed, setup.sharded
        self.stop_ids = stop_ids(setup.tokenizer)
        self.grading = setup.grading

    def _sampling(self, n: int, b: Batching) -> Sampling:
        return Sampling(
            n=n,
            max_new_tokens=self.m.max_completion_tokens,
            temperature=self.m.temperature,
            pad_id=b.pad_id,
            stop_ids=self.stop_ids,
            synced=self.sharded,
        )

    def _rollout(
        self, prompts: list[RolloutPrompt], n: int, b: Batching, seed: int
    ) -> tuple[Rollout, list[str]]:
        """``n`` completions of each prompt and their text (a rank with no prompt samples nothing, but
        with sharded weights it samples one, unkept: every rank runs the same forwards)."""
        if not prompts and not self.sharded:
            return Rollout([], [], 0.0), []
        ids = [p.input_ids for p in prompts] or [[b.pad_id]]
        rollout = sample_completions(self.model, ids, self._sampling(n, b), device=b.device, seed=seed)
        if not prompts:
            return Rollout([], [], rollout.seconds), []
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in rollout.completions]
        return rollout, texts

    def micro_batches(
        self, examples: list[Example], index: list[int], b: Batching, *, step: int = 0
    ) -> Iterator[RolloutBatch]:
        """The step's rollout, graded, as micro-batches of ``micro_batch_size`` prompts' completions. Its
        seed is the run's seed, the step and the prompts' indices (:func:`train_seed`)."""
        prompts = [_prompt(e) for e in examples]
        n = self.m.samples_per_prompt
        rollout, texts = self._rollout(prompts, n, b, train_seed(self.seed, step, index))
        items = [prompts[k // n].item for k in range(len(texts))]
        graded = grade_all(self.m.grader, texts, items, self.grading)
        self.sums.add(graded, [len(c) for c in rollout.completions], rollout.truncated, rollout.seconds)
        advantages = group_advantages(graded.rewards, n)
        return self._batches(rows_of(prompts, rollout, n), advantages, n * b.hp.micro_batch_size, b)

    def _batches(
        self, rows: list[Example], advantages: list[float], per_batch: int, b: Batching
    ) -> Iterator[RolloutBatch]:
        import torch

        for k in range(0, len(rows), per_batch):
            batch = collate(rows[k : k + per_batch], b.pad_id, b.device)
            adv = torch.tensor(advantages[k : k + per_batch], dtype=torch.float32, device=b.device)
            yield RolloutBatch(batch, adv, batch.num_tokens, batch.num_learned)

    def filler(self, example: Example, b: Batching) -> RolloutBatch:
        """A micro-batch of one row with no advantage, for a rank with fewer micro-batches than the others
        (sharded weights): no rollout, zero loss."""
        import torch

        p = _prompt(example).input_ids
        batch = collate([Example([*p, b.pad_id], [IGNORE_INDEX] * len(p) + [b.pad_id])], b.pad_id, b.device)
        return RolloutBatch(batch, torch.zeros(1, device=b.device), batch.num_tokens, batch.num_learned)

    def loss(self, model: Any, mb: Any) -> torch.Tensor:
        """The micro-batch's summed clipped policy-gradient loss (and KL penalty) over its completion
        tokens."""
        import torch

        rb: RolloutBatch = mb
        learned = (rb.batch.labels[:, 1:] != IGNORE_INDEX).float()
        lp = token_logps(model, rb.batch)
        ratio = torch.exp(lp - lp.detach())
        adv = rb.advantages[:, None]
        eps = self.m.clip_epsilon
        per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
        if self.m.kl_beta > 0:
            with torch.no_grad(), model.disable_adapter():
                ref = token_logps(model, rb.batch)
            d = ref - lp
            per_token = per_token + self.m.kl_beta * (torch.exp(d) - d - 1)
        return (per_token * learned).sum()

    def step_metrics(self, dist: DistContext | None) -> RewardMetrics:
        """The step's rewards over all ranks; starts the next step's sums."""
        metrics = self.sums.metrics(dist)
        self.sums = self._new_sums()
        return metrics

    def evaluate(
        self,
        model: Any,
        valid: list[Example],
        b: Batching,
        dist: DistContext | None,
        sharded: bool,
        step: int,
    ) -> EvalEvent:
        """The validation prompts' mean reward over ``eval_samples`` completions each (each rank its part;
        with sharded weights every rank samples every prompt, alike)."""
        index = list(range(len(valid)))
        split = dist if dist is not None and not sharded else None
        if split is not None:
            index = rank_part(index, split.rank, split.world_size)
        prompts = [_prompt(valid[i]) for i in index]
        n, per = self.m.eval_samples, max(1, b.hp.micro_batch_size)
        sums = self._new_sums()
        for k in range(0, max(len(prompts), 1), per):
            self._eval_part(prompts[k : k + per], index[k : k + per], n, b, sums)
        metrics = sums.metrics(split)
        tokens = round(metrics.completion_tokens_mean * metrics.samples)
        return EvalEvent(step, -metrics.reward_mean, tokens, reward=metrics)

    def _eval_part(
        self, part: list[RolloutPrompt], index: list[int], n: int, b: Batching, sums: RewardSums
    ) -> None:
        """Some validation prompts sampled and graded into ``sums`` (the first few kept to show)."""
        rollout, texts = self._rollout(part, n, b, rollout_seed(self.seed, "eval", tuple(index)))
        items = [part[j // n].item for j in range(len(texts))]
        graded = grade_all(self.m.grader, texts, items, self.grading)
        sums.add(graded, [len(c) for c in rollout.completions], rollout.truncated, rollout.seconds)
        for j in range(min(len(texts), SHOWN_SAMPLES - len(sums.examples))):
            r = graded.results[j]
            prompt = self.tokenizer.decode(part[j // n].input_ids, skip_special_tokens=True)
            flags = error_flags(r.errors)
            sums.examples.append(GradedSample(prompt[-SHOWN_CHARS:], texts[j][:SHOWN_CHARS], r.reward, flags))
