"""Global gradient-norm clipping shared by every mode, so all modes see the same clipped gradient.

Same rule as ``torch.nn.utils.clip_grad_norm_``: ``coef = min(1, max_norm / (total_norm + 1e-6))``,
gradients multiplied in place by ``coef`` (always, so a coefficient of 1.0 is an exact no-op).
Per-parameter norms are accumulated in fp32 whatever the gradient dtype.

With fp16 loss scaling (``inv``: ``1 / scale``, see :mod:`offload.guard`) the fp16 gradients are still
scaled: their norms are multiplied by ``inv`` in fp32, and they are *not* multiplied by ``coef`` in
place (that could underflow them too); the consumers apply ``coef * inv`` (:attr:`Gate.grad_factor`).
Nothing here reads a device value on the host, and no index tensor is built per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from offload.collectives import EngineGroup, Reduced, global_norm

#: Index tensors of :func:`_norm_by_parameter`, built once per (device, positions): the same few every step.
_INDEX: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _index(positions: Sequence[int], device: torch.device) -> torch.Tensor:
    key = (device, tuple(positions))
    t = _INDEX.get(key)
    if t is None:
        if len(_INDEX) > 64:  # another model's layouts: keep the cache bounded
            _INDEX.clear()
        t = _INDEX[key] = torch.tensor(key[1], dtype=torch.int64).to(device)
    return t


def grad_norms(grads: Sequence[torch.Tensor], inv: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 L2 norm of each gradient, stacked (on the gradients' device; one multi-tensor op); fp16
    gradients' norms times ``inv`` when given (still loss-scaled)."""
    norms = list(torch._foreach_norm(list(grads), 2, dtype=torch.float32))
    if inv is not None:
        scaled = [n for n, g in zip(norms, grads, strict=True) if g.dtype == torch.float16]
        if scaled:
            torch._foreach_mul_(scaled, inv)
    return torch.stack(norms)


def _scale_(tensors: list[torch.Tensor], coef: torch.Tensor, inv: torch.Tensor | None) -> None:
    """``t *= coef`` for every tensor, except fp16 ones while they are loss-scaled (``inv`` given)."""
    if inv is not None:
        tensors = [t for t in tensors if t.dtype != torch.float16]
    if tensors:
        torch._foreach_mul_(tensors, coef)


@torch.no_grad()
def clip_(
    grads: list[torch.Tensor],
    max_norm: float | None,
    device: torch.device | None = None,
    *,
    inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip in place. Returns ``(total_norm, coef)`` as device scalars (total before clipping).

    A non-finite total gives a coefficient of 0 or NaN and leaves non-finite gradients: the caller
    skips such a step (:mod:`offload.guard`). ``device``: where the scalars live when ``grads`` is empty.
    ``inv``: fp16 gradients are loss-scaled by ``1 / inv`` (module docstring).
    """
    if not grads:
        z = torch.zeros((), device=device)
        return z, torch.ones((), device=device)
    norms = grad_norms(grads, inv)
    total = torch.linalg.vector_norm(norms)
    if max_norm is None:
        return total, torch.ones((), device=total.device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    _scale_(grads, coef, inv)
    return total, coef


@torch.no_grad()
def clip_reduced_(
    r: Reduced,
    max_norm: float | None,
    device: torch.device,
    ranks: EngineGroup,
    *,
    inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`clip_` over a gradient reduced across a process group's ranks, part replicated and part
    cut into disjoint shards: the total norm adds the replicated squares to every rank's shard squares
    (one scalar all-reduce), the same everywhere; every tensor of ``r`` is scaled alike."""
    if r.norm_parts:
        total = _norm_by_parameter(r, device, ranks, inv)
        if max_norm is None:
            return total, torch.ones((), device=device)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        _scale_([*r.replicated, *r.shards, *r.also], coef, inv)
        return total, coef
    if not r.shards:
        total, coef = clip_(r.replicated, max_norm, device, inv=inv)
        if max_norm is not None and r.also:
            _scale_(r.also, coef, inv)
        return total, coef
    sq = grad_norms(r.shards, inv).square().sum()
    total = global_norm(sq, ranks)
    if r.replicated:
        total = (total.square() + grad_norms(r.replicated, inv).square().sum()).sqrt()
    if max_norm is None:
        return total, torch.ones((), device=total.device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    _scale_([*r.replicated, *r.shards, *r.also], coef, inv)
    return total, coef


def _norm_by_parameter(
    r: Reduced, device: torch.device, ranks: EngineGroup, inv: torch.Tensor | None
) -> torch.Tensor:
    """The total norm as :func:`clip_` computes it in one process (each parameter's norm, then theirs,
    in parameter order), a sharded parameter's squares summed over its pieces and the ranks first: the
    same arithmetic as far as it goes, so the clipping coefficient rounds as one process's does."""
    sharded = [(i, t) for i, t, s in r.norm_parts if s]
    sq = torch.zeros(r.num_params, dtype=torch.float32, device=device)
    if sharded:
        sq.index_add_(
            0,
            _index([i for i, _ in sharded], device),
            grad_norms([t for _, t in sharded], inv).square(),
        )
    dist.all_reduce(sq, group=ranks.group)
    norms = sq.sqrt()
    replicated = [(i, t) for i, t, s in r.norm_parts if not s]
    if replicated:
        norms.index_copy_(
            0, _index([i for i, _ in replicated], device), grad_norms([t for _, t in replicated], inv)
        )
    total: torch.Tensor = torch.linalg.vector_norm(norms)
    return total
