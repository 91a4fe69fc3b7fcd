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
semantics: the caller backpropagates ``engine.scale_loss(loss)``; the step unscales the gradients
before clipping; a skipped step multiplies the scale by ``backoff_factor``, and ``growth_interval``
finite steps in a row multiply it by ``growth_factor``.
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

    def __init__(self, ok: torch.Tensor, landing: Landing | None = None, at: int = 0) -> None:
        self.ok = ok
        self.landing = landing
        self.at = at
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
    def unscale_(self, grads: Sequence[torch.Tensor]) -> None:
        """Divide the gradients by the scale (GradScaler.unscale_'s kernel; its inf flag is not needed:
        the gate reads the norm of the unscaled gradients, which is not finite exactly then)."""
        if not grads:
            return
        inv = self.scale.double().reciprocal().float()
        found = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)

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
