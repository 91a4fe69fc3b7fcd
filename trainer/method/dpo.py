"""Direct preference optimization (Rafailov et al. 2023): the sigmoid loss over a pair's chosen and
rejected completions against a frozen reference model (:class:`DpoTraining`, the method in a run).

For a pair, ``logp`` is the summed log-probability of a completion's learned tokens (its assistant output;
the shared input is masked, :mod:`trainer.data.preference`), ``r = beta * (logp_policy - logp_reference)``
its reward, and the loss ``-log sigmoid(r_chosen - r_rejected)``: log 2 while the policy equals the
reference. A step's loss is the mean over its pairs, whatever its micro-batches and ranks (each
micro-batch's summed pair losses divided by the step's pairs over all ranks, as :mod:`trainer.run.step`
divides by learned tokens). A micro-batch puts its pairs' chosen rows, then their rejected rows, into ONE
padded batch: one forward and one backward per micro-batch, in every engine mode.

The reference, never a second model in memory:

- with LoRA: the same model with the adapter disabled (peft's ``disable_adapter()``), under no_grad, per
  micro-batch;
- without: a pass before training (:func:`reference_table`, before the engine or a checkpoint touches the
  weights) over every training and validation pair, kept in ``<output_dir>/dpo-reference.safetensors``
  keyed by example index with a fingerprint of the data and model, reused on resume.

A step's reward statistics (:class:`trainer.events.PreferenceMetrics`) are read once it is done: one
device sync and, with ranks, one more host all-reduce per step than a supervised job's.

Both references run the forward exactly as training does (same dtype, train mode) and a DPO job trains
without dropout (:func:`disable_dropout`, as TRL does by default: a dropout mask differing between the
policy's and the reference's forward is noise in every reward), so at step 0 the policy's
log-probabilities equal the reference's and the loss is log 2. Packing stays off: each completion is one row, scored on its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract.method import ResolvedDpo, ResolvedMethod
from trainer.data.batching import Batch, collate, rank_part
from trainer.data.example import IGNORE_INDEX, Example, PreferencePair
from trainer.events import EvalEvent, LogEvent, PreferenceMetrics
from trainer.method.base import Batching, MethodSetup
from trainer.run.distributed import DistContext, all_sum

if TYPE_CHECKING:
    import torch

#: What ``beta: "auto"`` resolves to: the DPO paper's (Rafailov et al. 2023) and TRL's default. It is the
#: KL penalty's weight: 0.1 lets the policy move well away from the reference in a few hundred steps
#: (0.5 holds it close, 0.01 lets it drift into degenerate text); no data-dependent rule is known to beat it.
AUTO_DPO_BETA = 0.1
#: The reference log-probabilities of a full fine-tuning DPO job, in its output directory.
REFERENCE_FILE = "dpo-reference.safetensors"


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout of ``model`` off: ``nn.Dropout`` modules (LoRA's included) and the attention
    probability dropout transformers' attention modules read from ``attention_dropout``."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            setattr(module, "attention_dropout", 0.0)  # noqa: B010  # a plain float attribute, not a submodule


@dataclass
class PairBatch:
    """A micro-batch of pairs: ``batch`` holds the chosen rows then the rejected rows."""

    batch: Batch
    #: The pairs' indices in their set (the reference table's keys).
    index: list[int]
    #: Non-padding tokens of both rows of every pair.
    num_tokens: int
    #: What the step's loss averages over: pairs.
    num_learned: int


def pair_micro_batches(
    pairs: list[Example], index: list[int], micro_batch_size: int, *, pad_id: int, device: torch.device
) -> Iterator[PairBatch]:
    """``pairs`` (PreferencePairs, at ``index`` in their set) in micro-batches of ``micro_batch_size`` pairs."""
    for k in range(0, len(pairs), micro_batch_size):
        part = [_pair(p) for p in pairs[k : k + micro_batch_size]]
        b = collate([*part, *(p.rejected for p in part)], pad_id, device)
        yield PairBatch(b, index[k : k + micro_batch_size], b.num_tokens, len(part))


def _pair(ex: Example) -> PreferencePair:
    if not isinstance(ex, PreferencePair):
        raise TypeError("a DPO job's examples are preference pairs")
    return ex


def sequence_logps(model: Any, batch: Batch) -> torch.Tensor:
    """Each row's summed log-probability of its learned tokens (float32, one per row)."""
    import torch.nn.functional as F

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    labels = batch.labels[:, 1:]
    nll = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.sum(dim=1)


class DpoObjective:
    """The loss of a DPO job's micro-batches (``loss``, for :func:`trainer.run.step.optimizer_step`), its
    reference (a table, or the adapter disabled) and each step's reward statistics."""

    def __init__(self, beta: float, table: dict[str, torch.Tensor] | None) -> None:
        self.beta = beta
        self.table = table
        self._stats: torch.Tensor | None = None
        self._pairs = 0

    def reference(self, model: Any, pb: PairBatch, split: str = "train") -> torch.Tensor:
        """The reference log-probabilities of ``pb``'s rows (chosen then rejected)."""
        import torch

        if self.table is not None:
            t = self.table[split][pb.index]
            return torch.cat([t[:, 0], t[:, 1]]).to(pb.batch.input_ids.device)
        with torch.no_grad(), model.disable_adapter():
            return sequence_logps(model, pb.batch)

    def terms(self, policy: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed pair losses, [chosen reward, rejected reward, margin, correct] sums, detached)."""
        import torch
        import torch.nn.functional as F

        k = policy.shape[0] // 2
        chosen = self.beta * (policy[:k] - ref[:k])
        rejected = self.beta * (policy[k:] - ref[k:])
        margin = chosen - rejected
        sums = torch.stack([chosen.sum(), rejected.sum(), margin.sum(), (margin > 0).float().sum()])
        return -F.logsigmoid(margin).sum(), sums.detach()

    def loss(self, model: Any, pb: PairBatch) -> torch.Tensor:
        """The micro-batch's summed pair losses (with grad); its statistics are kept for the step."""
        ref = self.reference(model, pb)
        total, sums = self.terms(sequence_logps(model, pb.batch), ref)
        self._stats = sums if self._stats is None else self._stats + sums
        self._pairs += pb.num_learned
        return total

    def take_step(self, dist: DistContext | None) -> PreferenceMetrics:
        """The step's means over its pairs (all ranks); starts the next step's sums."""
        sums = [float(v) for v in self._stats.tolist()] if self._stats is not None else [0.0] * 4
        totals = all_sum(dist, [*sums, float(self._pairs)])
        self._stats, self._pairs = None, 0
        return _metrics(totals[:4], totals[4])

    def evaluate_sums(
        self, model: Any, pairs: list[Example], index: list[int], micro: int, *, pad_id: int, device: Any
    ) -> list[float]:
        """[summed loss, the four statistic sums, pairs, learned tokens] over ``pairs`` (eval mode, no grad)."""
        import torch

        was_training = model.training
        model.eval()
        out = [0.0] * 7
        with torch.no_grad():
            for pb in pair_micro_batches(pairs, index, micro, pad_id=pad_id, device=device):
                total, sums = self.terms(sequence_logps(model, pb.batch), self.reference(model, pb, "valid"))
                learned = int((pb.batch.labels[:, 1:] != IGNORE_INDEX).sum())
                vals = [
                    float(total),
                    *(float(v) for v in sums.tolist()),
                    float(pb.num_learned),
                    float(learned),
                ]
                out = [a + b for a, b in zip(out, vals, strict=True)]
        model.train(was_training)
        return out


def eval_result(sums: list[float]) -> tuple[float, PreferenceMetrics, int]:
    """(mean loss, metrics, learned tokens) of :meth:`DpoObjective.evaluate_sums` (summed over ranks)."""
    n = sums[5]
    return (sums[0] / n if n else float("nan")), _metrics(sums[1:5], n), int(sums[6])


def _metrics(sums: list[float], pairs: float) -> PreferenceMetrics:
    n = max(pairs, 1.0)
    return PreferenceMetrics(sums[0] / n, sums[1] / n, sums[2] / n, sums[3] / n)


# --- the reference table (full fine-tuning) ---------------------------------------------------------


def _fingerprint(model_name: str, dtype: str, sets: dict[str, list[Example]]) -> str:
    h = hashlib.sha256(f"{model_name}\n{dtype}\n".encode())
    for name, pairs in sets.items():
        h.update(name.encode())
        for p in pairs:
            pp = _pair(p)
            h.update(repr((pp.input_ids, pp.labels, pp.rejected.input_ids, pp.rejected.labels)).encode())
    return h.hexdigest()


def reference_table(
    model: Any,
    sets: dict[str, list[Example]],
    out: Path,
    *,
    model_name: str,
    micro_batch_size: int,
    pad_id: int,
    device: torch.device,
    dist: DistContext | None = None,
    split: bool = True,
) -> tuple[dict[str, torch.Tensor], bool]:
    """Each set's reference log-probabilities, ``(pairs, 2)`` float32 on the CPU (chosen, rejected), and
    whether they were computed now (False: read back from ``out``). Every rank computes its part of each
    set and the parts are summed across ranks (``split``), or every rank computes them all (weights
    sharded: FSDP's gathers need every rank in every pass); rank 0 writes the file."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / REFERENCE_FILE
    fp = _fingerprint(model_name, str(next(model.parameters()).dtype), sets)
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            same = (f.metadata() or {}).get("fingerprint") == fp
        if same:
            return load_file(str(path)), False
    rank, world = (dist.rank, dist.world_size) if dist is not None and split else (0, 1)
    tables: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, pairs in sets.items():
            table = torch.zeros(len(pairs), 2, dtype=torch.float64)
            mine = rank_part(list(range(len(pairs))), rank, world)
            for pb in pair_micro_batches(
                [pairs[i] for i in mine], mine, micro_batch_size, pad_id=pad_id, device=device
            ):
                lp = sequence_logps(model, pb.batch).double().cpu()
                k = pb.num_learned
                table[pb.index, 0], table[pb.index, 1] = lp[:k], lp[k:]
            if dist is not None and split:
                table = torch.tensor(all_sum(dist, table.flatten().tolist()), dtype=torch.float64).view(-1, 2)
            tables[name] = table.float()
    if dist is None or dist.is_main:
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in tables.items()}, str(tmp), metadata={"fingerprint": fp})
        tmp.replace(path)
    return tables, True


class DpoTraining:
    """:class:`trainer.method.base.TrainingMethod` of ``dpo``: pairs in micro-batches, the DPO loss against
    the reference, the reward statistics of each step and validation."""

    eval_before_training = False

    def __init__(self, beta: float) -> None:
        self.objective = DpoObjective(beta, None)

    @classmethod
    def of(cls, resolved: ResolvedMethod) -> DpoTraining:
        assert isinstance(resolved, ResolvedDpo)
        return cls(resolved.beta)

    def prepare(self, setup: MethodSetup) -> None:
        """Dropout off (the policy's and the reference's forwards agree at step 0); a full fine-tune's
        reference table, before the engine or a checkpoint touches the weights (LoRA jobs disable the
        adapter instead). With sharded weights every rank computes every pair (FSDP's gathers)."""
        disable_dropout(setup.model)
        if setup.lora:
            return
        sets = {"train": setup.train, **({"valid": setup.valid} if setup.valid else {})}
        table, computed = reference_table(
            setup.model,
            sets,
            setup.out,
            model_name=setup.model_name,
            micro_batch_size=setup.batching.hp.micro_batch_size,
            pad_id=setup.batching.pad_id,
            device=setup.batching.device,
            dist=setup.dist,
            split=not setup.sharded,
        )
        self.objective.table = table
        how = "computed in a pass before training" if computed else "read back"
        pairs = sum(len(v) for v in sets.values())
        setup.emit(LogEvent(f"DPO reference log-probabilities of {pairs} pairs {how} ({REFERENCE_FILE})"))

    def micro_batches(
        self, examples: list[Example], index: list[int], b: Batching, *, step: int = 0
    ) -> Iterator[PairBatch]:
        return pair_micro_batches(examples, index, b.hp.micro_batch_size, pad_id=b.pad_id, device=b.device)

    def filler(self, example: Example, b: Batching) -> PairBatch:
        return next(self.micro_batches([example], [0], b))

    def loss(self, model: Any, mb: Any) -> torch.Tensor:
        return self.objective.loss(model, mb)

    def step_metrics(self, dist: DistContext | None) -> PreferenceMetrics | None:
        return self.objective.take_step(dist)

    def evaluate(
        self,
        model: Any,
        valid: list[Example],
        b: Batching,
        dist: DistContext | None,
        sharded: bool,
        step: int,
    ) -> EvalEvent:
        """The validation pairs' mean DPO loss and preference metrics (each rank its part; with sharded
        weights every rank runs every pair, as FSDP's gathers need all ranks in every pass)."""
        split = dist if dist is not None and not sharded else None
        index = list(range(len(valid)))
        if split is not None:
            index = rank_part(index, split.rank, split.world_size)
        sums = self.objective.evaluate_sums(
            model, [valid[i] for i in index], index, b.hp.micro_batch_size, pad_id=b.pad_id, device=b.device
        )
        loss, metrics, n = eval_result(all_sum(split, sums))
        return EvalEvent(step, loss, n, metrics)
