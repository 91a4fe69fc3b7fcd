"""CPU-side optimizer state for a group of device parameters of one dtype.

One flat fp32 buffer each for the master parameters and the two Adam moments, plus transfer
buffers: ``out`` (the master rounded to the device dtype, written by the C++ step in the same pass;
only when the device dtype is bf16/fp16), ``staging`` slots for gradients copied off the device (in
the gradient's dtype) and fp32 ``acc`` window accumulators (zenflow). Parameter ``i`` occupies
``[offsets[i], offsets[i] + numels[i])`` of every buffer, so one elementwise op covers all of them.
Buffers are page-locked when the device is CUDA (see :mod:`offload.device`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from offload.config import EngineConfig
from offload.device import HostAllocator

_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Elements per accumulation chunk: ATen's fp32 += bf16 with type promotion runs ~10x slower than
# a bf16 -> fp32 copy into a cache-sized scratch followed by a same-dtype add.
_ACC_CHUNK = 1 << 20


def _adam_step() -> Callable[..., None]:
    # resolved per call so tests can patch it; importing offload never builds the extension
    from offload.cpu_adam import adam_step

    return adam_step


class HostStore:
    """Master params, moments and transfer buffers for ``params`` (all of one dtype)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        alloc: HostAllocator,
        *,
        staging_slots: int,
        accumulators: int,
    ) -> None:
        if not params:
            raise ValueError("HostStore needs at least one parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"HostStore needs parameters of one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = params[0].dtype
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        n = self.numel
        self.master = alloc.empty(n, torch.float32)
        for i, p in enumerate(params):
            self.flat(self.master, i).copy_(p.detach().reshape(-1))
        self.exp_avg = alloc.zeros(n, torch.float32)
        self.exp_avg_sq = alloc.zeros(n, torch.float32)
        self.out = alloc.empty(n, self.dtype) if self.dtype in _LOW_PRECISION else None
        if self.out is not None:
            self.out.copy_(self.master)
        self.staging = [alloc.zeros(n, self.dtype) for _ in range(staging_slots)]
        self.acc = [alloc.zeros(n, torch.float32) for _ in range(accumulators)]
        #: Adam step count per parameter (the C++ step takes it explicitly).
        self.steps = [0] * len(params)
        # fp32 scratch for accumulating low-precision gradients chunk by chunk (worker thread only).
        self._tmp = torch.empty(min(n, _ACC_CHUNK), dtype=torch.float32) if self.dtype in _LOW_PRECISION else None

    # --- views ----------------------------------------------------------------------------------
    def flat(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf.narrow(0, self.offsets[i], self.numels[i])

    def shaped(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        return self.flat(buf, i).view(self.shapes[i])

    @property
    def result(self) -> torch.Tensor:
        """The buffer the device copies its new values from (``out`` if low precision, else master)."""
        return self.out if self.out is not None else self.master

    def nbytes(self) -> int:
        bufs = [self.master, self.exp_avg, self.exp_avg_sq, *self.staging, *self.acc]
        if self.out is not None:
            bufs.append(self.out)
        return sum(b.numel() * b.element_size() for b in bufs)

    # --- gradient accumulation ------------------------------------------------------------------
    def accumulate(self, acc_index: int, slot: int, *, alpha: float, first: bool) -> None:
        """``acc = alpha * staging`` (first step of a window) or ``acc += alpha * staging``."""
        acc, src = self.acc[acc_index], self.staging[slot]
        if self._tmp is None:  # fp32 gradients: one pass each
            if first and alpha != 1.0:
                torch.mul(src, alpha, out=acc)
            elif first:
                acc.copy_(src)
            else:
                acc.add_(src, alpha=alpha)
            return
        for lo in range(0, self.numel, _ACC_CHUNK):
            hi = min(self.numel, lo + _ACC_CHUNK)
            a = acc[lo:hi]
            if first:
                a.copy_(src[lo:hi])
                if alpha != 1.0:
                    a.mul_(alpha)
            else:
                t = self._tmp[: hi - lo]
                t.copy_(src[lo:hi])
                a.add_(t, alpha=alpha)

    # --- the CPU optimizer ----------------------------------------------------------------------
    def adam(
        self,
        grad: torch.Tensor,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        num_threads: int,
        chunk: int,
        only: Sequence[int] | None = None,
    ) -> Iterator[int]:
        """AdamW on the params (all, or the indices in ``only``) with gradient buffer ``grad``.

        A generator: it yields the index of a parameter after that parameter is fully updated, and
        otherwise after every ``chunk`` elements, so a cooperative worker can run waiting gradient
        copies in between. Each updated parameter's step count goes up by one.
        """
        step_fn = _adam_step()
        b1, b2 = betas
        for i in range(len(self.numels)) if only is None else only:
            self.steps[i] += 1
            p, g = self.flat(self.master, i), self.flat(grad, i)
            m, v = self.flat(self.exp_avg, i), self.flat(self.exp_avg_sq, i)
            o = None if self.out is None else self.flat(self.out, i)
            n = self.numels[i]
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                step_fn(
                    p[lo:hi],
                    g[lo:hi],
                    m[lo:hi],
                    v[lo:hi],
                    step=self.steps[i],
                    lr=lr,
                    beta1=b1,
                    beta2=b2,
                    eps=eps,
                    weight_decay=weight_decay,
                    adamw=True,
                    param_out=None if o is None else o[lo:hi],
                    num_threads=num_threads,
                )
                if hi < n:
                    yield -1
            yield i

    def adam_now(self, grad: torch.Tensor, *, config: EngineConfig, lr: float, num_threads: int,
                 only: Sequence[int] | None = None) -> float:
        """Run :meth:`adam` to the end in one go with the engine config's betas, eps and weight
        decay; the seconds it took."""
        t0 = time.perf_counter()
        for _ in self.adam(grad, lr=lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
                           num_threads=num_threads, chunk=1 << 62, only=only):
            pass
        return time.perf_counter() - t0

    # --- persistence ----------------------------------------------------------------------------
    def state_dict(self, acc_index: int | None) -> dict[str, object]:
        return {
            "master": self.master.clone(),
            "exp_avg": self.exp_avg.clone(),
            "exp_avg_sq": self.exp_avg_sq.clone(),
            "out": None if self.out is None else self.out.clone(),
            "acc": None if acc_index is None else self.acc[acc_index].clone(),
            "acc_index": acc_index,
            "steps": list(self.steps),
            "numels": list(self.numels),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if list(sd["numels"]) != self.numels:
            raise ValueError("host optimizer state was saved for differently shaped parameters")
        self.master.copy_(sd["master"])
        self.exp_avg.copy_(sd["exp_avg"])
        self.exp_avg_sq.copy_(sd["exp_avg_sq"])
        if self.out is not None:
            out = sd["out"]
            self.out.copy_(out if out is not None else self.master)
        idx = sd["acc_index"]
        if idx is not None and sd["acc"] is not None:
            self.acc[int(idx)].copy_(sd["acc"])
        self.steps = [int(s) for s in sd["steps"]]
