"""Fused C++ Adam/AdamW for CPU-resident optimizer state: fp32 master, fp32 or bf16 moments.

The kernel (``offload/csrc/cpu_adam.cpp``, ``-O3 -march=native -fopenmp -ffp-contract=off``) is
built when the package is installed and loaded by its path; a job never compiles it (see
:mod:`offload.cpu_adam_build`, and its ``ZENFLOW_CPU_ADAM_JIT=1`` development fallback).  One pass
per element updates the fp32 parameter and both fp32 moments, reading an fp32/bf16/fp16 gradient and
optionally writing the new parameter as bf16/fp16 into a second buffer.  The elementwise math follows
``torch.optim.AdamW``/``Adam`` (single-tensor CPU path) operation by operation and is bitwise equal
to those torch ops except for sqrt, which is correctly rounded here while torch's CPU ``sqrt`` (MKL
VML) may be 1 ulp off; after many steps ours stays within rtol=1e-6/atol=1e-7 of torch.optim.

``adam_step`` releases the GIL while computing and keeps no per-call state, so it may be called from
several Python threads at once (on disjoint buffers). So does ``accumulate``, the zenflow window
accumulation (``acc = alpha * g`` or ``acc += alpha * g`` with an fp32/bf16/fp16 ``g``, bitwise equal
to ATen's ``acc.add_(g.float(), alpha=alpha)``), SIMD and OpenMP like the step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, overload

import torch

from offload import cpu_adam_build
from offload.cpu_adam_build import CpuAdamBuildError

__all__ = [
    "CPUAdamW",
    "CpuAdamBuildError",
    "accumulate",
    "adam_step",
    "get_num_threads",
    "load_extension",
    "set_num_threads",
    "simd_width",
]

_CSRC = cpu_adam_build.CSRC
_SOURCES = list(cpu_adam_build.SOURCES)
_INSTALL_DIR = cpu_adam_build.INSTALL_DIR

_lock = threading.Lock()
_ext: ModuleType | None = None


def load_extension(verbose: bool = False) -> ModuleType:
    """Load the installed extension once per process; thread-safe.

    Raises :class:`CpuAdamBuildError` when it is missing or stale (and JIT is not allowed), or when the
    JIT fallback finds no compiler or ninja or its build fails.
    """
    global _ext
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is None:
            _ext = cpu_adam_build.load(_INSTALL_DIR, _SOURCES, [_CSRC], verbose=verbose)
        return _ext


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    bias_correction: bool = True,
    param_out: torch.Tensor | None = None,
    num_threads: int | None = None,
    rng_seed: int = 0,
    rng_offset: int = 0,
) -> None:
    """One fused Adam(W) step, in place, on contiguous CPU tensors of equal numel (any shape).

    ``param``: fp32. ``exp_avg``, ``exp_avg_sq``: both fp32, or both bf16 (lean moments: computed in
    fp32 from their widened values, ``param`` bitwise as the fp32 path gives for those, and rounded
    back to bf16 stochastically with random bits hashed from ``rng_seed`` and each element's index
    ``rng_offset + i``, so the result depends neither on ``num_threads`` nor on how a buffer is split
    into calls; give each step its own seed). ``grad``: fp32, bf16 or fp16. ``step``: the step
    number after incrementing (1 for the first update). ``adamw=False`` is Adam with L2 weight decay
    (``grad += weight_decay * param``). ``param_out`` (bf16/fp16) receives the updated parameter,
    rounded to nearest even; it may be ``grad`` itself (same dtype), the gradient being read before
    it is overwritten. ``num_threads`` overrides the global thread count for this call.
    """
    ext = _ext if _ext is not None else load_extension()
    ext.adam_step(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param_out,
        int(step),
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adamw),
        bool(bias_correction),
        0 if num_threads is None else int(num_threads),
        int(rng_seed) & ((1 << 63) - 1),
        int(rng_offset),
    )


def accumulate(
    acc: torch.Tensor, src: torch.Tensor, *, alpha: float, first: bool, num_threads: int | None = None
) -> None:
    """``acc = alpha * src`` (``first``) or ``acc += alpha * src`` in place, in one GIL-free pass.

    ``acc``: fp32, or bf16/fp16 when ``src`` has that dtype; ``src``: fp32, bf16 or fp16 of the same
    numel; both contiguous CPU tensors. Same bits as ``torch.mul(src.float(), alpha, out=acc)``
    (``acc.copy_(src)`` when ``alpha`` is 1) / ``acc.add_(src.float(), alpha=alpha)`` (a bf16/fp16
    ``acc``: that fp32 result rounded to nearest even), i.e. :func:`offload.host.accumulate_torch`,
    whatever ``num_threads``; at least as fast as it for every dtype pair (``python -m bench.cpu_adam``).
    """
    ext = _ext if _ext is not None else load_extension()
    ext.accumulate(acc, src, float(alpha), bool(first), 0 if num_threads is None else int(num_threads))


def set_num_threads(n: int) -> None:
    """Global default thread count for ``adam_step`` (0 = follow ``torch.get_num_threads()``)."""
    load_extension().set_num_threads(int(n))


def get_num_threads() -> int:
    """Thread count ``adam_step`` uses when ``num_threads`` is not given."""
    return int(load_extension().get_num_threads())


def simd_width() -> str:
    """Vector ISA compiled in: ``"avx512"``, ``"avx2"`` or ``"scalar"``."""
    return str(load_extension().simd_width())


_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CPUAdamW(torch.optim.Optimizer):
    """AdamW (or Adam with L2 decay, ``adamw_mode=False``) on fp32 CPU params via the fused kernel.

    Hyperparameters are read from each param group at every step (so LR schedulers and per-group
    settings work); groups may also set ``adamw_mode``, ``bias_correction`` and ``num_threads``.
    State per param is ``{"step": float32 scalar tensor, "exp_avg", "exp_avg_sq"}`` as in torch, so
    ``state_dict``/``load_state_dict`` round-trip (also from a ``torch.optim.AdamW`` state dict).

    Low-precision copy-out: :meth:`set_param_out` registers a bf16/fp16 buffer (e.g. pinned) per
    param that every step fills with the updated parameter in the same pass.  These buffers are not
    part of ``state_dict``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        num_threads: int | None = None,
    ) -> None:
        if not float(lr) >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "adamw_mode": adamw_mode,
            "bias_correction": bias_correction,
            "num_threads": num_threads,
        }
        super().__init__(params, defaults)
        self._param_out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                self._check_param(p)
        load_extension()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if not hasattr(self, "_param_out"):
            self._param_out = {}
        for group in self.param_groups:
            group.setdefault("adamw_mode", True)
            group.setdefault("bias_correction", True)
            group.setdefault("num_threads", None)

    @staticmethod
    def _check_param(p: torch.Tensor) -> None:
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise TypeError(f"CPUAdamW needs fp32 CPU parameters, got dtype={p.dtype} device={p.device}")
        if not p.is_contiguous():
            raise ValueError(
                f"CPUAdamW needs contiguous parameters, got strides {p.stride()} for shape {tuple(p.shape)}"
            )

    def set_param_out(self, param: torch.Tensor, out: torch.Tensor | None) -> None:
        """Register (or with ``None`` remove) a bf16/fp16 buffer receiving ``param`` after each step."""
        if out is None:
            self._param_out.pop(id(param), None)
            return
        if out.dtype not in (torch.bfloat16, torch.float16) or out.device.type != "cpu":
            raise TypeError(f"param_out must be a bf16/fp16 CPU tensor, got {out.dtype} on {out.device}")
        if out.numel() != param.numel() or not out.is_contiguous():
            raise ValueError("param_out must be contiguous with the same numel as its param")
        self._param_out[id(param)] = (param, out)

    # torch.optim.Optimizer.step's overloads: no closure, no loss
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimizer step over all params that have a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ext = _ext if _ext is not None else load_extension()
        for group in self.param_groups:
            if group.get("amsgrad", False) or group.get("maximize", False):
                raise NotImplementedError("CPUAdamW supports neither amsgrad nor maximize")
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            nt = group.get("num_threads")
            for p in group["params"]:
                grad = self._checked_grad(p)
                if grad is None:
                    continue
                state = self.state[p]
                step = self._next_step(state, p)
                out = self._param_out.get(id(p))
                ext.adam_step(
                    p,
                    grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    None if out is None or out[0] is not p else out[1],
                    step,
                    lr,
                    float(beta1),
                    float(beta2),
                    float(group["eps"]),
                    float(group["weight_decay"]),
                    bool(group["adamw_mode"]),
                    bool(group["bias_correction"]),
                    0 if nt is None else int(nt),
                )
        return loss

    def _checked_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s gradient as the C++ step takes it (contiguous), None when it has none; raises on a
        sparse gradient, a parameter that is not fp32 on the CPU, or another gradient dtype."""
        grad = p.grad
        if grad is None:
            return None
        if grad.is_sparse:
            raise RuntimeError("CPUAdamW does not support sparse gradients")
        self._check_param(p)
        if grad.dtype not in _GRAD_DTYPES:
            raise TypeError(f"gradient dtype must be fp32/bf16/fp16, got {grad.dtype}")
        return grad if grad.is_contiguous() else grad.contiguous()

    @staticmethod
    def _next_step(state: dict[str, Any], p: torch.Tensor) -> int:
        """The parameter's step count after this step (its state created on its first)."""
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step_t = state["step"]
        if isinstance(step_t, torch.Tensor):
            step_t += 1
            return int(step_t.item())
        state["step"] = step = int(step_t) + 1
        return step
