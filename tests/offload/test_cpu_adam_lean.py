"""Lean host moments (issue 36, item 2): the C++ AdamW with bf16 ``exp_avg``/``exp_avg_sq`` beside fp32
master weights (offload/csrc/cpu_adam.cpp ``adam_update_lean``).

The kernel's contract, checked exactly: each new parameter is bitwise what the fp32 path computes from
the moments widened to fp32, and each new moment is one of the two bf16 values around that path's fp32
moment (stochastic rounding, bits hashed from the seed and the element's index: the same whatever the
thread count or the chunking). Then, over many steps, it stays within bf16 tolerance of a float64
AdamW where round-to-nearest-even moments would not.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from offload import cpu_adam
from tests.support import cpu_adam_extension

HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}


@pytest.fixture(scope="module", autouse=True)
def ext() -> ModuleType:
    return cpu_adam_extension()


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values at and above ``x``'s magnitude truncated to bf16 (both ``x`` when exact)."""
    bits = x.view(torch.int32)
    low = (bits & ~0xFFFF).view(torch.float32)
    high = torch.where(x == low, low, ((bits & ~0xFFFF) + 0x10000).view(torch.float32))
    return low, high


def _lean_state(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    m = (torch.randn(n, generator=gen) * 1e-3).bfloat16()
    v = (torch.rand(n, generator=gen) * 1e-4).bfloat16()
    return p, g, m, v


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 17, 4099, 70_001])
def test_param_is_the_fp32_paths_and_moments_round_to_a_neighbour(grad_dtype, out_dtype, n):
    p, g32, m, v = _lean_state(n)
    g = g32.to(grad_dtype)
    p_ref, m_ref, v_ref = p.clone(), m.float(), v.float()
    out_ref = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    cpu_adam.adam_step(p_ref, g, m_ref, v_ref, step=5, param_out=out_ref, num_threads=2, **HP)
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    cpu_adam.adam_step(p, g, m, v, step=5, param_out=out, num_threads=2, rng_seed=7, **HP)
    assert torch.equal(p, p_ref)
    if out is not None:
        assert torch.equal(out, out_ref)
    for got, want in ((m, m_ref), (v, v_ref)):
        low, high = _bf16_neighbours(want)
        assert ((got.float() == low) | (got.float() == high)).all()
    assert (v.float() >= 0).all()


def test_bits_depend_on_seed_and_index_only():
    n = 300_007
    p, g, m, v = _lean_state(n, seed=1)
    runs = []
    for threads in (1, 2, 3):
        state = (p.clone(), m.clone(), v.clone())
        cpu_adam.adam_step(state[0], g, state[1], state[2], step=3, num_threads=threads, rng_seed=11, **HP)
        runs.append(state)
    chunked = (p.clone(), m.clone(), v.clone())
    for lo in range(0, n, 40_961):  # calls of any length: each element keeps its index in the buffer
        hi = min(n, lo + 40_961)
        cpu_adam.adam_step(
            chunked[0][lo:hi],
            g[lo:hi],
            chunked[1][lo:hi],
            chunked[2][lo:hi],
            step=3,
            num_threads=1,
            rng_seed=11,
            rng_offset=lo,
            **HP,
        )
    runs.append(chunked)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))
    other = (p.clone(), m.clone(), v.clone())
    cpu_adam.adam_step(other[0], g, other[1], other[2], step=3, rng_seed=12, **HP)
    assert not torch.equal(other[1], runs[0][1])  # another seed, other rounding


@pytest.mark.parametrize("fraction", [0.125, 0.5, 0.75])
def test_rounding_is_unbiased(fraction):
    n = 1 << 20
    x = 1.0 + fraction * 2.0**-7  # between two bf16 values (ulp 2^-7 at 1)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    # beta1 = beta2 = 0: m = g and v = g * g exactly in fp32, then rounded
    cpu_adam.adam_step(
        torch.zeros(n), torch.full((n,), x), m, v, step=1, lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8,
        weight_decay=0.0, rng_seed=3,
    )  # fmt: skip
    assert set(m.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    up = (m.float() > 1.0).double().mean().item()
    assert abs(up - fraction) < 5e-3
    assert abs(v.double().mean().item() - x * x) < 1e-4 * x * x


def test_special_values():
    p = torch.zeros(6)
    g = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-30, -1e-30, 0.0])
    m = torch.zeros(6, dtype=torch.bfloat16)
    v = torch.zeros(6, dtype=torch.bfloat16)
    cpu_adam.adam_step(p, g, m, v, step=1, rng_seed=1, **HP)
    bits = v.view(torch.int16)
    assert bits[0].item() == 0x7FC0 and m.view(torch.int16)[0].item() == 0x7FC0  # NaN stays NaN
    assert torch.isinf(v[1:3]).all() and (v[1:3] > 0).all()
    assert (v[3:].float() >= 0).all() and torch.isfinite(v[3:].float()).all()


@pytest.mark.parametrize(
    ("exp_avg", "exp_avg_sq", "match"),
    [
        (torch.bfloat16, torch.float32, "exp_avg_sq must have exp_avg's dtype"),
        (torch.float32, torch.bfloat16, "exp_avg_sq must have exp_avg's dtype"),
        (torch.float16, torch.float16, "exp_avg must be float32 or bfloat16"),
    ],
)
def test_bad_moment_dtypes(exp_avg, exp_avg_sq, match):
    with pytest.raises(RuntimeError, match=match):
        cpu_adam.adam_step(
            torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=exp_avg), torch.zeros(4, dtype=exp_avg_sq),
            step=1, **HP,
        )  # fmt: skip


def _adamw64(p, g, m, v, step, *, lr, beta1, beta2, eps, weight_decay):
    p.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v / (1 - beta2**step)).sqrt_().add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))


def _rne_step(p, g, m16, v16, step, **hp):
    """The same kernel with round-to-nearest-even moments (fp32 step, then ``.bfloat16()``)."""
    m, v = m16.float(), v16.float()
    cpu_adam.adam_step(p, g, m, v, step=step, num_threads=1, **hp)
    m16.copy_(m)
    v16.copy_(v)


def test_many_steps_stay_within_bf16_tolerance_of_float64():
    """600 AdamW steps (beta2 0.999) on gradients whose scale spans four decades and drops 10x halfway
    (so exp_avg_sq must decay): the lean kernel's parameters and moments against float64 AdamW, with
    the fp32 kernel and round-to-nearest-even bf16 moments for scale."""
    n, steps = 20_000, 600
    gen = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(n, generator=gen) * 2.0) * 1e-3
    p0 = torch.randn(n, generator=gen)
    hp = {**HP, "lr": 1e-3}
    p64, m64, v64 = p0.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    p32, m32, v32 = p0.clone(), torch.zeros(n), torch.zeros(n)
    pl, ml, vl = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    pr, mr, vr = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    late = steps - 100
    marks: list[torch.Tensor] = []
    for t in range(1, steps + 1):
        g = torch.randn(n, generator=gen) * scale * (1.0 if t <= steps // 2 else 0.1)
        _adamw64(p64, g.double(), m64, v64, t, **hp)
        cpu_adam.adam_step(p32, g, m32, v32, step=t, num_threads=1, **hp)
        cpu_adam.adam_step(pl, g, ml, vl, step=t, num_threads=1, rng_seed=t, **hp)
        _rne_step(pr, g, mr, vr, t, **hp)
        if t == late:
            marks = [p64.clone(), p32.clone(), pl.clone(), pr.clone()]

    def update_err(p: torch.Tensor, mark: torch.Tensor) -> float:
        """Relative error of the last 100 steps' update against float64's."""
        d64 = p64 - marks[0]
        return ((p.double() - mark.double() - d64).norm() / d64.norm()).item()

    def v_bias(v: torch.Tensor) -> float:  # mean ratio of sqrt(v) to float64's: the denominator
        return (v.double().sqrt() / v64.sqrt()).mean().item()

    err32, err_lean, err_rne = (update_err(p, mark) for p, mark in zip((p32, pl, pr), marks[1:], strict=True))
    assert err32 < 1e-3
    assert err_lean < 0.03  # bf16 moments: within about 2^-8 per step, unbiased
    assert abs(v_bias(vl) - 1) < 0.01
    assert ((ml.double() - m64).norm() / m64.norm()).item() < 0.02
    # round-to-nearest-even freezes exp_avg_sq once the gradient shrinks: a denominator too large
    assert v_bias(vr) > 1.1 and err_rne > 3 * err_lean
