"""offload.zenflow.adamw: the functional AdamW core against torch.optim.AdamW (bit for bit where the
arithmetic is the same), bias correction and weight decay, per-column step counts, and the gates that make
a skipped step an exact no-op.

torch.optim.AdamW is driven through its functional form (``torch.optim.adamw.adamw``, what
``AdamW.step`` calls with its state): the same arithmetic, without the optimizer class, whose
construction imports torch._dynamo (seconds on a loaded 2-core machine)."""

from __future__ import annotations

import pytest
import torch
from torch.optim.adamw import adamw as torch_adamw

from offload.guard import Gate
from offload.zenflow.adamw import (
    AdamWHyper,
    BiasTable,
    _settles,
    adamw_,
    adamw_columns_,
    columns_adamw_,
    fused_adamw_,
)
from tests.offload.zenflow.support import CPU, HYPER, assert_close

ROWS, COLS = 5, 7


class _TorchAdamW:
    """torch.optim.AdamW's state and step for one tensor (``foreach=False``: the single-tensor path;
    ``fused=True``: the fused kernel)."""

    def __init__(self, p: torch.Tensor, h: AdamWHyper, **kw: bool) -> None:
        self.p, self.h, self.kw = p, h, kw
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(p), torch.zeros_like(p)
        self.step_t = torch.zeros((), dtype=torch.float32)

    def step(self, g: torch.Tensor) -> None:
        h = self.h
        torch_adamw(
            [self.p],
            [g],
            [self.exp_avg],
            [self.exp_avg_sq],
            [],
            [self.step_t],
            amsgrad=False,
            beta1=h.beta1,
            beta2=h.beta2,
            lr=h.lr,
            weight_decay=h.weight_decay,
            eps=h.eps,
            maximize=False,
            **self.kw,
        )


def _grads(n: int, seed: int = 1, shape: tuple[int, ...] = (ROWS, COLS)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


def _consts(h: AdamWHyper) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(1 - h.beta1, dtype=torch.float32), torch.tensor(h.beta2, dtype=torch.float32)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_is_torch_single_tensor_adamw_bit_for_bit(weight_decay: float) -> None:
    """Parameter and both moments after several steps, with and without decoupled weight decay."""
    h = AdamWHyper(HYPER.lr, HYPER.beta1, HYPER.beta2, HYPER.eps, weight_decay)
    p0 = torch.randn(ROWS, COLS)
    ref = _TorchAdamW(p0.clone(), h, foreach=False)
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for step, g in enumerate(_grads(6), start=1):
        ref.step(g.clone())
        adamw_(p, g, m, v, step, h)
    assert float(ref.step_t) == 6.0
    assert torch.equal(p, ref.p)
    assert torch.equal(m, ref.exp_avg)
    assert torch.equal(v, ref.exp_avg_sq)


def test_adamw_first_step_is_bias_corrected_and_decays_the_weight() -> None:
    """From zero moments, step 1's bias correction makes the update ``lr * g / (|g| + eps')`` (about
    ``lr * sign(g)``), after the weight was scaled by ``1 - lr * wd``; without the correction it would be
    ``(1 - beta1) / sqrt(1 - beta2)`` = 3.16 times that."""
    p0 = torch.randn(ROWS, COLS)
    g = torch.randn(ROWS, COLS)
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    adamw_(p, g, m, v, 1, HYPER)
    decayed = p0.double() * (1 - HYPER.lr * HYPER.weight_decay)
    expected = decayed - HYPER.lr * g.double() / (g.double().abs() + HYPER.eps)
    assert_close(p.double(), expected, rtol=0, atol=1e-6)
    assert_close(m, (1 - HYPER.beta1) * g, rtol=1e-6, atol=0)
    assert_close(v, (1 - HYPER.beta2) * g * g, rtol=1e-6, atol=0)


def test_adamw_columns_reference_equals_adamw_at_each_columns_step() -> None:
    """The column reference with per-column step counts equals adamw_ run on each column alone at its own
    count (fp64 torch.pow for the corrections; the same bits as the Python floats here)."""
    p0 = torch.randn(ROWS, COLS)
    m0, v0 = torch.rand(ROWS, COLS) * 0.1, torch.rand(ROWS, COLS) * 0.01
    steps = torch.tensor([1, 2, 3, 7, 40, 1000, 1], dtype=torch.float64)
    g = _grads(1)[0]
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    adamw_columns_(p, g, m, v, steps, HYPER)
    for c in range(COLS):
        pc, mc, vc = p0[:, c].clone(), m0[:, c].clone(), v0[:, c].clone()
        adamw_(pc, g[:, c].clone(), mc, vc, int(steps[c]), HYPER)
        assert torch.equal(p[:, c], pc), c
        assert torch.equal(m[:, c], mc) and torch.equal(v[:, c], vc), c


def _columns_step(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, steps: torch.Tensor, on: torch.Tensor
) -> None:
    """One columns_adamw_ call on a single ``[1, rows, k]`` group, the factors as SelectiveAdamW makes
    them (from a BiasTable; the step size zeroed where the update is off)."""
    table = BiasTable(HYPER.beta1, HYPER.beta2, CPU)
    table.ensure(int(steps.max()))
    bc1, bc2 = table.lookup(steps)
    nss = torch.where(on, torch.full_like(bc1, -HYPER.lr).div_(bc1).to(torch.float32), 0.0)
    k = steps.numel()
    columns_adamw_(
        [p],
        [g],
        [m],
        [v],
        [nss.view(1, 1, k)],
        [bc2.to(torch.float32).view(1, 1, k)],
        on,
        HYPER,
        _consts(HYPER),
    )


def test_columns_adamw_updates_each_column_bitwise_like_adamw_at_its_step() -> None:
    """The batched column path (what the device optimizer runs) against the single-tensor reference, every
    column at its own step count, moments included."""
    p0 = torch.randn(1, ROWS, COLS)
    m0, v0 = torch.rand(1, ROWS, COLS) * 0.1, torch.rand(1, ROWS, COLS) * 0.01
    steps = torch.tensor([1, 2, 3, 5, 8, 300, 2], dtype=torch.int64)
    g = _grads(1, shape=(1, ROWS, COLS))[0]
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    _columns_step(p, g, m, v, steps, torch.tensor(True))
    for c in range(COLS):
        pc, mc, vc = p0[0, :, c].clone(), m0[0, :, c].clone(), v0[0, :, c].clone()
        adamw_(pc, g[0, :, c].clone(), mc, vc, int(steps[c]), HYPER)
        assert torch.equal(p[0, :, c], pc), c
        assert torch.equal(m[0, :, c], mc) and torch.equal(v[0, :, c], vc), c


def test_columns_adamw_gated_off_changes_nothing() -> None:
    """A skipped step (``on`` false, the gradient zeroed as the group's gather does) leaves parameters and
    moments bit for bit as they were: neutral decay and moment weights, zero step size."""
    p0 = torch.randn(1, ROWS, COLS)
    m0, v0 = torch.randn(1, ROWS, COLS) * 0.1, torch.rand(1, ROWS, COLS) * 0.01
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    steps = torch.full((COLS,), 3, dtype=torch.int64)
    _columns_step(p, torch.zeros(1, ROWS, COLS), m, v, steps, torch.tensor(False))
    assert torch.equal(p, p0) and torch.equal(m, m0) and torch.equal(v, v0)


def test_columns_adamw_per_group_masks_gate_entries_separately() -> None:
    """``on`` as one ``[n, 1, 1]`` mask per group: entry 0 updates, entry 1 (off, zero gradient) stays."""
    p0 = torch.randn(2, ROWS, 3)
    m0, v0 = torch.rand(2, ROWS, 3) * 0.1, torch.rand(2, ROWS, 3) * 0.01
    g = torch.randn(2, ROWS, 3)
    g[1] = 0.0
    on = torch.tensor([True, False]).view(2, 1, 1)
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    table = BiasTable(HYPER.beta1, HYPER.beta2, CPU)
    table.ensure(4)
    bc1, bc2 = table.lookup(torch.full((6,), 4, dtype=torch.int64))
    nss = torch.full_like(bc1, -HYPER.lr).div_(bc1).to(torch.float32).view(2, 1, 3)
    nss = torch.where(on, nss, 0.0)
    columns_adamw_([p], [g], [m], [v], [nss], [bc2.float().view(2, 1, 3)], [on], HYPER, _consts(HYPER))
    assert torch.equal(p[1], p0[1]) and torch.equal(m[1], m0[1]) and torch.equal(v[1], v0[1])
    pr, mr, vr = p0[0].clone(), m0[0].clone(), v0[0].clone()
    adamw_(pr, g[0].clone(), mr, vr, 4, HYPER)
    assert torch.equal(p[0], pr) and torch.equal(m[0], mr) and torch.equal(v[0], vr)


def test_fused_adamw_is_torch_fused_adamw_and_a_skipped_step_is_a_no_op() -> None:
    """Whole tensors: bitwise like torch.optim.AdamW(fused=True) over the finite steps; the step counts
    count only those, and a gated-off step in between changes no tensor."""
    p0 = torch.randn(ROWS, COLS)
    ref = _TorchAdamW(p0.clone(), HYPER, fused=True)
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    step = torch.zeros((), dtype=torch.float32)
    skip = Gate(torch.tensor(False))
    for i, g in enumerate(_grads(5)):
        ref.step(g.clone())
        fused_adamw_([p], [g.clone()], [m], [v], [step], HYPER, Gate.always(CPU))
        if i == 2:
            before = (p.clone(), m.clone(), v.clone(), step.clone())
            fused_adamw_([p], [torch.randn(ROWS, COLS)], [m], [v], [step], HYPER, skip)
            assert all(torch.equal(a, b) for a, b in zip(before, (p, m, v, step), strict=True))
    assert float(step) == 5.0
    assert torch.equal(p, ref.p)
    assert torch.equal(m, ref.exp_avg) and torch.equal(v, ref.exp_avg_sq)


def test_bias_table_holds_torchs_python_float_corrections_and_clamps() -> None:
    table = BiasTable(0.9, 0.999, CPU)
    table.ensure(10)
    assert table.rows >= 11
    steps = torch.tensor([0, 1, 2, 10], dtype=torch.int64)
    bc1, bc2 = table.lookup(steps)
    assert bc1.dtype == bc2.dtype == torch.float64
    assert bc1.tolist() == [1.0, *(1 - 0.9 ** float(s) for s in (1, 2, 10))]
    assert bc2.tolist() == [1.0, *((1 - 0.999 ** float(s)) ** 0.5 for s in (1, 2, 10))]
    # past the step where both corrections are exactly 1.0 the table stops growing and lookups clamp
    table.ensure(10**9)
    assert table.rows == table.limit
    far = table.lookup(torch.tensor([10**9], dtype=torch.int64))
    assert far[0].item() == 1.0 and far[1].item() == 1.0


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 0.999])
def test_settles_is_the_first_step_with_exact_one(beta: float) -> None:
    s = _settles(beta)
    assert 1 - beta**s == 1.0
    assert s == 1 or 1 - beta ** (s - 1) != 1.0
