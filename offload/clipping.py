"""Global gradient-norm clipping shared by every mode, so all modes see the same clipped gradient.

Same rule as ``torch.nn.utils.clip_grad_norm_``: ``coef = min(1, max_norm / (total_norm + 1e-6))``,
gradients multiplied in place by ``coef`` (always, so a coefficient of 1.0 is an exact no-op).
Per-parameter norms are accumulated in fp32 whatever the gradient dtype.
"""

from __future__ import annotations

import torch

from offload.collectives import Ranks, global_norm


def grad_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """fp32 L2 norm of each gradient, stacked (on the gradients' device; one multi-tensor op)."""
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))


@torch.no_grad()
def clip_(
    grads: list[torch.Tensor], max_norm: float | None, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip in place. Returns ``(total_norm, coef)`` as device scalars (total before clipping).

    A non-finite total gives a coefficient of 0 or NaN and leaves non-finite gradients: the caller
    skips such a step (:mod:`offload.guard`). ``device``: where the scalars live when ``grads`` is empty.
    """
    if not grads:
        z = torch.zeros((), device=device)
        return z, torch.ones((), device=device)
    norms = grad_norms(grads)
    total = torch.linalg.vector_norm(norms)
    if max_norm is None:
        return total, torch.ones((), device=total.device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
    return total, coef


@torch.no_grad()
def clip_sharded_(
    shards: list[torch.Tensor], max_norm: float | None, device: torch.device, ranks: Ranks
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`clip_` over a gradient cut into disjoint shards across a process group's ranks: the
    total norm is the square root of every rank's summed squares (one all-reduce), the same everywhere."""
    sq = grad_norms(shards).square().sum() if shards else torch.zeros((), device=device)
    total = global_norm(sq, ranks)
    if max_norm is None:
        return total, torch.ones((), device=total.device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if shards:
        torch._foreach_mul_(shards, coef)
    return total, coef
