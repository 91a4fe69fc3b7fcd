"""Global gradient-norm clipping shared by every mode, so all modes see the same clipped gradient.

Same rule as ``torch.nn.utils.clip_grad_norm_``: ``coef = min(1, max_norm / (total_norm + 1e-6))``,
gradients multiplied in place by ``coef`` (always, so a coefficient of 1.0 is an exact no-op).
Per-parameter norms are accumulated in fp32 whatever the gradient dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from offload.collectives import Ranks, Reduced, global_norm


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
def clip_reduced_(
    r: Reduced, max_norm: float | None, device: torch.device, ranks: Ranks
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`clip_` over a gradient reduced across a process group's ranks, part replicated and part
    cut into disjoint shards: the total norm adds the replicated squares to every rank's shard squares
    (one scalar all-reduce), the same everywhere; every tensor of ``r`` is scaled alike."""
    if r.norm_parts:
        total = _norm_by_parameter(r, device, ranks)
        if max_norm is None:
            return total, torch.ones((), device=device)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_([*r.replicated, *r.shards, *r.also], coef)
        return total, coef
    if not r.shards:
        total, coef = clip_(r.replicated, max_norm, device)
        if max_norm is not None and r.also:
            torch._foreach_mul_(r.also, coef)
        return total, coef
    sq = grad_norms(r.shards).square().sum()
    total = global_norm(sq, ranks)
    if r.replicated:
        total = (total.square() + grad_norms(r.replicated).square().sum()).sqrt()
    if max_norm is None:
        return total, torch.ones((), device=total.device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_([*r.replicated, *r.shards, *r.also], coef)
    return total, coef


def _norm_by_parameter(r: Reduced, device: torch.device, ranks: Ranks) -> torch.Tensor:
    """The total norm as :func:`clip_` computes it in one process (each parameter's norm, then theirs,
    in parameter order), a sharded parameter's squares summed over its pieces and the ranks first: the
    same arithmetic as far as it goes, so the clipping coefficient rounds as one process's does."""
    sharded = [(i, t) for i, t, s in r.norm_parts if s]
    sq = torch.zeros(r.num_params, dtype=torch.float32, device=device)
    if sharded:
        sq.index_add_(
            0,
            torch.tensor([i for i, _ in sharded], device=device),
            grad_norms([t for _, t in sharded]).square(),
        )
    dist.all_reduce(sq, group=ranks.group)
    norms = sq.sqrt()
    replicated = [(i, t) for i, t, s in r.norm_parts if not s]
    if replicated:
        norms.index_copy_(
            0, torch.tensor([i for i, _ in replicated], device=device), grad_norms([t for _, t in replicated])
        )
    total: torch.Tensor = torch.linalg.vector_norm(norms)
    return total
