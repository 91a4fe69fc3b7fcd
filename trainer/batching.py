"""Batching and loss for the training run: each epoch's example order, right-padded batches, the
summed next-token loss and the validation loss.

Importing this module does not import torch (the functions do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.data import IGNORE_INDEX, Example

if TYPE_CHECKING:
    import torch


def epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    """The example order of one epoch: a permutation from a generator seeded with (seed, epoch)."""
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
    return torch.randperm(num_examples, generator=g).tolist()


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    #: Non-padding tokens.
    num_tokens: int


def collate(examples: list[Example], pad_id: int, device: torch.device, multiple: int = 8) -> Batch:
    """Right-pad a batch to the longest example (rounded up to ``multiple``)."""
    import torch

    longest = max(len(e.input_ids) for e in examples)
    width = (longest + multiple - 1) // multiple * multiple
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    tokens = int(mask.sum())
    nb = device.type == "cuda"
    return Batch(
        ids.to(device, non_blocking=nb), mask.to(device, non_blocking=nb), labels.to(device, non_blocking=nb), tokens
    )


def loss_sum(model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token cross-entropies over learned tokens, their count): next-token prediction."""
    import torch.nn.functional as F

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1].float()
    labels = batch.labels[:, 1:]
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total, (labels != IGNORE_INDEX).sum()


def evaluate(model: Any, examples: list[Example], batch_size: int, pad_id: int, device: torch.device) -> tuple[float, int]:
    """Mean token loss over ``examples`` (no grad, eval mode, no RNG use) and the learned-token count."""
    import torch

    was_training = model.training
    model.eval()
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    s, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(order), batch_size):
            b = collate([examples[j] for j in order[i : i + batch_size]], pad_id, device)
            ls, c = loss_sum(model, b)
            s += float(ls)
            n += int(c)
    model.train(was_training)
    return (s / n if n else float("nan")), n
