"""The step's guard: fp16 loss scaling, and the verdict whether this step's gradients may be applied.

A step whose global gradient norm is not finite (an inf or NaN anywhere, or a norm that overflows) is
*skipped* everywhere: no parameter, moment, step count, accumulator or window count changes, and the
next finite step proceeds as if the skipped one had not happened. The verdict is decided on the
device (:class:`Gate`) so that no mode has to wait for it before queuing its update: every device
update is written so that a false verdict makes it an exact no-op (``_fused_adamw_``'s ``found_inf``,
gated scalars in the column path, :func:`zero_if_bad_`), and the host learns the verdict from a
landed copy (:class:`~offload.device.Landing`) once the step's device work is queued, in time for its
own bookkeeping (windows, accumulation, warm-up rounds).

fp16 parameters get dynamic loss scaling (:class:`LossScaler`) with ``torch.amp.GradScaler``'s
semantics: the caller backpropagates ``engine.scale_loss(loss)``; a skipped step multiplies the scale
by ``backoff_factor``, and ``growth_interval`` finite steps in a row multiply it by ``growth_factor``.
fp16 gradients stay scaled: dividing them in place would make small ones subnormal or zero before
any fp32 stage sees them. ``1 / scale`` and the clipping coefficient are folded instead into one
device factor (:attr:`Gate.grad_factor`) that every fp32 stage consuming an fp16 gradient applies:
the norm (:mod:`offload.clipping`), the device AdamW's fp32 gradient copies, the window
accumulation's ``alpha`` and the host step's input (the host reads the factor from the landed copy,
:meth:`Gate.host_factor`, with the verdict: no host sync). Gradients of other dtypes are unscaled and
clipped in place as without loss scaling (fp32 range: nothing underflows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from offload.device import Landing


class Gate:
    """This step's verdict as device tensors (``ok``: the global gradient norm is finite).

    The derived forms are computed once per step on first use. ``finite()`` is the host's copy of
    the verdict, read from ``landing`` (position ``at``) when the engine attached one.
    """

    def __init__(
        self,
        ok: torch.Tensor,
        landing: Landing | None = None,
        at: int = 0,
        *,
        grad_factor: torch.Tensor | None = None,
        factor_at: int | None = None,
    ) -> None:
        self.ok = ok
        self.landing = landing
        self.at = at
        #: fp32 device scalar every fp16 gradient is to be multiplied by (``coef / scale``; 0 on a
        #: skipped step), or None when the gradients are final (no loss scaling, or no fp16 ones).
        self.grad_factor = grad_factor
        self.factor_at = factor_at
        self._as: dict[torch.dtype, torch.Tensor] = {}
        self._bad: torch.Tensor | None = None
        self._bad_f: torch.Tensor | None = None
        self._host: bool | None = None

    @classmethod
    def always(cls, device: torch.device) -> Gate:
        """A gate that lets every update through (standalone use of the optimizers, tests)."""
        g = cls(torch.ones((), dtype=torch.bool, device=device))
        g._host = True
        return g

    def as_(self, dtype: torch.dtype) -> torch.Tensor:
        """``ok`` as 1 / 0 of ``dtype``."""
        t = self._as.get(dtype)
        if t is None:
            t = self._as[dtype] = self.ok.to(dtype)
        return t

    @property
    def bad(self) -> torch.Tensor:
        if self._bad is None:
            self._bad = torch.logical_not(self.ok)
        return self._bad

    @property
    def bad_f(self) -> torch.Tensor:
        """1.0 when the step is skipped (the ``found_inf`` of torch's fused optimizers)."""
        if self._bad_f is None:
            self._bad_f = self.bad.to(torch.float32)
        return self._bad_f

    def finite(self) -> bool:
        """The host's verdict (waits for the landing only if the copy has not landed yet)."""
        if self._host is None:
            if self.landing is None:
                raise RuntimeError("this gate has no host copy of its verdict")
            self._host = self.landing.values()[self.at] != 0.0
        return self._host

    def host_factor(self) -> float | None:
        """:attr:`grad_factor` on the host (from the landing, position ``factor_at``), or None."""
        if self.grad_factor is None:
            return None
        if self.landing is None or self.factor_at is None:
            raise RuntimeError("this gate has no host copy of its gradient factor")
        return self.landing.values()[self.factor_at]

    def factor_for(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The device factor a gradient of ``dtype`` still needs (fp16 only), or None."""
        return self.grad_factor if dtype == torch.float16 else None


def zero_if_bad_(tensors: Sequence[torch.Tensor], gate: Gate) -> None:
    """``t := 0`` for every tensor when the step is bad, else unchanged, in one multi-tensor op per
    element size and no host sync.

    The multi-tensor ops have no ``where``, and arithmetic cannot clear a NaN (NaN * 0 = NaN); the
    tensors' bit patterns multiplied as integers by 1 or 0 can: x * 1 = x exactly, x * 0 = +0.0.
    """
    by_size: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        by_size.setdefault(t.element_size(), []).append(t)
    for size, ts in by_size.items():
        itype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        torch._foreach_mul_([t.view(itype) for t in ts], gate.as_(itype))


class LossScaler:
    """Dynamic loss scale on the device, with ``torch.amp.GradScaler``'s update rule."""

    def __init__(
        self,
        device: torch.device,
        *,
        init_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
    ) -> None:
        self.scale = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale.to(loss.device)

    @torch.no_grad()
    def unscale_(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Divide the gradients other than fp16 by the scale, in place (GradScaler.unscale_'s kernel;
        its inf flag is not needed: the gate reads the norm, which is not finite exactly then), and
        return ``1 / scale`` (fp32 device scalar) for the fp16 ones, which stay scaled (module doc)."""
        inv = self.scale.double().reciprocal().float()
        found = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            if g.dtype != torch.float16:
                by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)
        return inv

    @staticmethod
    def grad_factor(coef: torch.Tensor, inv: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """``coef * inv`` where the step is finite, else 0 (a skipped step's zeroed gradients times a
        NaN coefficient must stay zeros)."""
        return torch.where(ok, coef * inv, 0.0)

    @torch.no_grad()
    def update(self, gate: Gate) -> None:
        torch._amp_update_scale_(
            self.scale,
            self.growth_tracker,
            gate.bad_f,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale.fill_(float(sd["scale"]))
        self.growth_tracker.fill_(int(sd["growth_tracker"]))
