"""AdamW's arithmetic on the device, as functions over tensors (the class that keeps the state and
calls them is :class:`~offload.zenflow.selective_adamw.SelectiveAdamW`).

- :func:`adamw_` and :func:`adamw_columns_`: references, op by op as torch's single-tensor AdamW, for
  one tensor and for columns with their own step counts (tests compare the batched paths to them).
- :func:`fused_adamw_`: whole tensors, torch's fused kernel (what ``torch.optim.AdamW(fused=True)``
  runs), gated by the step's :class:`~offload.guard.Gate` through ``found_inf``.
- :func:`columns_adamw_`: stacked column groups ``[n, rows, k]`` with per-column bias-correction
  factors (looked up in a :class:`BiasTable`), gated by device tensors: a gated-off update is exact
  no-op arithmetic (neutral decay and moment weights, zero step size), so no host sync is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offload.guard import Gate


@dataclass(frozen=True, slots=True)
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def adamw_(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, h: AdamWHyper
) -> None:
    """One AdamW step in place, op by op as torch's single-tensor path (``step`` counted from 1)."""
    if h.weight_decay != 0:
        p.mul_(1 - h.lr * h.weight_decay)
    m.lerp_(g, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    step_f = float(step)
    bias_correction1 = 1 - h.beta1**step_f
    bias_correction2 = 1 - h.beta2**step_f
    step_size = h.lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(h.eps)
    p.addcdiv_(m, denom, value=-step_size)


def adamw_columns_(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, steps: torch.Tensor, h: AdamWHyper
) -> None:
    """Reference: AdamW on ``[rows, k]`` tensors whose columns have individual step counts ``steps``
    (float64 ``[k]``, counted from 1), bias corrections computed by ``torch.pow`` in fp64."""
    if h.weight_decay != 0:
        p.mul_(1 - h.lr * h.weight_decay)
    m.lerp_(g, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    bc1 = 1 - torch.pow(h.beta1, steps)
    neg_step_size = torch.full_like(bc1, -h.lr).div_(bc1).to(torch.float32)
    bc2_sqrt = (1 - torch.pow(h.beta2, steps)).sqrt().to(torch.float32)
    denom = (v.sqrt() / bc2_sqrt.unsqueeze(0)).add_(h.eps)
    p.addcdiv_(m * neg_step_size.unsqueeze(0), denom)


def _settles(beta: float) -> int:
    """Smallest step ``s`` from which ``1 - beta**s`` is exactly 1.0 in double precision."""
    if beta == 0.0:
        return 1
    s = max(1, math.ceil(-54 * math.log(2) / math.log(beta)) - 2)
    while 1 - beta**s != 1.0:
        s += 1
    return s


class BiasTable:
    """``1 - beta1**s`` and ``sqrt(1 - beta2**s)`` for ``s = 0, 1, ...`` on the device (fp64), each
    computed in Python floats as torch's single-tensor AdamW does; row 0 holds 1.0 (a column that
    has not stepped yet). Grown by doubling as training gets longer, up to the step from which both
    are exactly 1.0 (lookups clamp there)."""

    def __init__(self, beta1: float, beta2: float, device: torch.device) -> None:
        self.beta1, self.beta2, self.device = beta1, beta2, device
        self.limit = max(_settles(beta1), _settles(beta2)) + 1
        self.rows = 0
        self.bc1 = self.bc2_sqrt = torch.ones(1, dtype=torch.float64, device=device)

    def ensure(self, max_step: int) -> None:
        need = min(max_step + 1, self.limit)
        if need <= self.rows:
            return
        rows = min(self.limit, max(256, 1 << (need - 1).bit_length()))
        b1, b2 = self.beta1, self.beta2
        bc1 = [1.0] + [1 - b1 ** float(s) for s in range(1, rows)]
        bc2 = [1.0] + [(1 - b2 ** float(s)) ** 0.5 for s in range(1, rows)]
        host = torch.tensor([bc1, bc2], dtype=torch.float64)
        if self.device.type == "cuda":  # a rare, asynchronous upload from page-locked memory
            dev = host.pin_memory().to(self.device, non_blocking=True)
        else:
            dev = host.to(self.device)
        self.bc1, self.bc2_sqrt, self.rows = dev[0], dev[1], rows

    def lookup(self, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = steps.clamp(max=self.rows - 1)
        return self.bc1.index_select(0, idx), self.bc2_sqrt.index_select(0, idx)


def fused_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    h: AdamWHyper,
    gate: Gate,
) -> None:
    """Whole tensors in one fused call; ``steps`` (fp32 0-dim) count only steps the gate lets through,
    and a skipped step (``found_inf``) leaves every tensor untouched."""
    ok_f = gate.as_(torch.float32)
    torch._foreach_add_(steps, [ok_f] * len(steps))  # (the Tensor overload reads it on the host on CPU)
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=h.lr,
        beta1=h.beta1,
        beta2=h.beta2,
        weight_decay=h.weight_decay,
        eps=h.eps,
        amsgrad=False,
        maximize=False,
        grad_scale=None,
        found_inf=gate.bad_f,
    )


def columns_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    neg_step_sizes: list[torch.Tensor],
    bc2_sqrts: list[torch.Tensor],
    on: torch.Tensor | list[torch.Tensor],
    h: AdamWHyper,
    consts: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """AdamW on fp32 ``[n, rows, k]`` column groups, each column at its own step count.

    ``neg_step_sizes`` and ``bc2_sqrts``: per group ``[n, 1, k]`` factors ``-lr / (1 - beta1**s)``
    (already zero where the update is off) and ``sqrt(1 - beta2**s)``. ``on``: where the update
    applies, one bool tensor for every group or one ``[n, 1, 1]`` mask per group; elsewhere decay and
    moment weights are neutral. ``consts``: fp32 ``(1 - beta1, beta2)`` on the device.
    """
    w1, b2 = consts
    decay = (
        torch.full((), 1 - h.lr * h.weight_decay, dtype=torch.float32, device=w1.device)
        if h.weight_decay != 0
        else w1
    )  # (unused without weight decay)
    if isinstance(on, torch.Tensor):
        if h.weight_decay != 0:
            torch._foreach_mul_(params, torch.where(on, decay, 1.0))
        w = torch.where(on, w1, 0.0)
        for m, g in zip(exp_avgs, grads, strict=True):
            m.lerp_(g, w)
        torch._foreach_mul_(exp_avg_sqs, torch.where(on, b2, 1.0))
    else:
        for gk, p, m, v, g in zip(on, params, exp_avgs, exp_avg_sqs, grads, strict=True):
            if h.weight_decay != 0:
                p.mul_(torch.where(gk, decay, 1.0))
            m.lerp_(g, torch.where(gk, w1, 0.0))
            v.mul_(torch.where(gk, b2, 1.0))
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - h.beta2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    for d, b in zip(denoms, bc2_sqrts, strict=True):
        d.div_(b)
    torch._foreach_add_(denoms, h.eps)
    upd = [torch.mul(m, s) for m, s in zip(exp_avgs, neg_step_sizes, strict=True)]
    torch._foreach_addcdiv_(params, upd, denoms)
