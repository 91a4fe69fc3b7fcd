"""Batching and loss for the training run: each epoch's example order, an optimizer step's examples cut
into micro-batches (right-padded, or packed by :mod:`trainer.data.packing`), the summed next-token loss and
the validation loss. With N data-parallel ranks each rank takes its contiguous part of a step's examples
(and of the validation set): :func:`rank_part`.

Importing this module does not import torch (the functions do).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from trainer.data.dataset import IGNORE_INDEX, Example
from trainer.data.packing import flatten_rows, pack_rows

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def rank_part(items: list[T], rank: int, world_size: int) -> list[T]:
    """Rank ``rank``'s contiguous part of ``items`` cut into ``world_size`` near-equal parts (sizes differ
    by at most one; the first parts are the smaller ones). The parts, in rank order, are ``items``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    n = len(items)
    return items[n * rank // world_size : n * (rank + 1) // world_size]


def epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    """The example order of one epoch: a permutation from a generator seeded with (seed, epoch)."""
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
    return torch.randperm(num_examples, generator=g).tolist()


@dataclass
class Batch:
    input_ids: torch.Tensor
    #: None for packed rows: the model finds the examples from ``position_ids`` (trainer.data.packing).
    attention_mask: torch.Tensor | None
    labels: torch.Tensor
    #: Non-padding tokens.
    num_tokens: int
    #: Tokens the loss learns (labels not ignored after the next-token shift).
    num_learned: int
    #: Positions restarting per example (packed rows only).
    position_ids: torch.Tensor | None = None


def _to_device(batch: Batch, device: torch.device) -> Batch:
    nb = device.type == "cuda"

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=nb)

    ids, labels = batch.input_ids.to(device, non_blocking=nb), batch.labels.to(device, non_blocking=nb)
    return Batch(
        ids, move(batch.attention_mask), labels, batch.num_tokens, batch.num_learned, move(batch.position_ids)
    )


def _learned(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


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
    return _to_device(Batch(ids, mask, labels, int(mask.sum()), _learned(labels)), device)


def collate_packed(rows: list[list[Example]], pad_id: int, device: torch.device) -> Batch:
    """Rows of whole examples, padding-free within a row (see trainer.data.packing)."""
    packed = flatten_rows(rows, pad_id)
    tokens = sum(len(e.input_ids) for row in rows for e in row)
    batch = Batch(packed.input_ids, None, packed.labels, tokens, _learned(packed.labels), packed.position_ids)
    return _to_device(batch, device)


def micro_batches(
    examples: list[Example],
    micro_batch_size: int,
    *,
    pad_id: int,
    device: torch.device,
    packing: bool = False,
    max_seq_length: int = 0,
) -> Iterator[Batch]:
    """Cut examples (one optimizer step's, or a validation set) into micro-batches of
    ``micro_batch_size`` sequences, each collated when it is reached.

    Unpacked, a sequence is an example (sorted longest first, so similar lengths share the padding);
    packed, it is a row of up to ``max_seq_length`` tokens holding whole examples.
    """
    if packing:
        rows = pack_rows([len(e.input_ids) for e in examples], max_seq_length)
        for k in range(0, len(rows), micro_batch_size):
            yield collate_packed(
                [[examples[i] for i in row] for row in rows[k : k + micro_batch_size]], pad_id, device
            )
        return
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i))
    for k in range(0, len(order), micro_batch_size):
        yield collate([examples[i] for i in order[k : k + micro_batch_size]], pad_id, device)


def loss_sum(model: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token cross-entropies over learned tokens, their count): next-token prediction.

    ``use_cache=False``: no KV cache in training, and transformers detects packed rows only without one.
    """
    import torch.nn.functional as F

    extra = {} if batch.position_ids is None else {"position_ids": batch.position_ids}
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **extra
    ).logits
    logits = logits[:, :-1].float()
    labels = batch.labels[:, 1:]
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total, (labels != IGNORE_INDEX).sum()


def evaluate(
    model: Any,
    examples: list[Example],
    micro_batch_size: int,
    *,
    pad_id: int,
    device: torch.device,
    packing: bool = False,
    max_seq_length: int = 0,
) -> tuple[float, int]:
    """Mean token loss over ``examples`` (no grad, eval mode, no RNG use) and the learned-token count,
    in micro-batches like training (the same memory bound)."""
    s, n = evaluate_sums(
        model,
        examples,
        micro_batch_size,
        pad_id=pad_id,
        device=device,
        packing=packing,
        max_seq_length=max_seq_length,
    )
    return (s / n if n else float("nan")), n


def evaluate_sums(
    model: Any,
    examples: list[Example],
    micro_batch_size: int,
    *,
    pad_id: int,
    device: torch.device,
    packing: bool = False,
    max_seq_length: int = 0,
) -> tuple[float, int]:
    """(summed token loss, learned-token count) over ``examples``: what ranks add up before dividing."""
    import torch

    was_training = model.training
    model.eval()
    s, n = 0.0, 0
    with torch.no_grad():
        for b in micro_batches(
            examples,
            micro_batch_size,
            pad_id=pad_id,
            device=device,
            packing=packing,
            max_seq_length=max_seq_length,
        ):
            ls, c = loss_sum(model, b)
            s += float(ls)
            n += int(c)
    model.train(was_training)
    return s, n
