"""Importance-aware column selection for 2-D weights.

Convention (used everywhere in the engine): a 2-D weight has shape ``[rows, cols]`` (``nn.Linear``:
``[out_features, in_features]``; ``nn.Embedding``: ``[num_embeddings, embedding_dim]``). A *column*
is an index into dim 1 (an input channel of a Linear, a hidden channel of an Embedding) and its
importance score is ``sum(|grad|)`` over dim 0. The top ``k = ceil(topk_ratio * cols)`` columns are
selected (at least 1); the index tensor is sorted ascending so gathers walk memory in order and two
selections compare with ``torch.equal``. Parameters that are not 2-D are always selected as a whole.
"""

from __future__ import annotations

import math

import torch


def num_selected(cols: int, topk_ratio: float) -> int:
    """Columns kept on the device for a weight with ``cols`` columns."""
    if cols <= 0:
        return 0
    return min(cols, max(1, math.ceil(topk_ratio * cols - 1e-9)))


def column_scores(grad: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Importance of each column of a 2-D gradient: ``sum |g|`` over dim 0, in fp32, shape ``[cols]``.

    One reduction (the L1 norm of each column), no gradient-sized temporary; ``out`` receives it.
    """
    if grad.dim() != 2:
        raise ValueError(f"column_scores needs a 2-D gradient, got shape {tuple(grad.shape)}")
    scores: torch.Tensor = (
        torch.linalg.vector_norm(grad, 1, dim=0, dtype=torch.float32)
        if out is None
        else torch.linalg.vector_norm(grad, 1, dim=0, dtype=torch.float32, out=out)
    )
    return scores


def remap(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of ``new``'s columns sat in ``old`` (both sorted along the last dim; ``[k]`` or a
    batch of rows ``[n, k]``).

    Returns ``(present, pos)``: ``present[..., j]`` is True when ``new[..., j]`` is also in ``old``'s
    row, and then ``old[..., pos[..., j]] == new[..., j]``; ``pos`` is clamped to a valid index where
    ``present`` is False. Fixed shapes, no host sync.
    """
    if old.shape[-1] == 0:
        return torch.zeros_like(new, dtype=torch.bool), torch.zeros_like(new)
    pos = torch.searchsorted(old, new).clamp_(max=old.shape[-1] - 1)
    present = old.gather(-1, pos) == new
    return present, pos


def union(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sorted union of two sorted index tensors."""
    if a.numel() == 0:
        return b.clone()
    if b.numel() == 0:
        return a.clone()
    out: torch.Tensor = torch.unique(torch.cat([a, b]), sorted=True)
    return out
