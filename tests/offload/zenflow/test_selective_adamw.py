"""offload.zenflow.selective_adamw: the device optimizer updates exactly the selected columns (each like
the single-tensor AdamW at its own step count) and whole tensors like the fused AdamW, leaves every other
column's value and every moment it does not own untouched, keeps kept columns' state across a
reselection, skips gated-off steps and gradient-less entries, applies the fp16 gradient factor in fp32,
and resumes from its state dict."""

from __future__ import annotations

import pytest
import torch

from offload.guard import Gate
from offload.zenflow.adamw import AdamWHyper, adamw_, fused_adamw_
from offload.zenflow.selective_adamw import SelectiveAdamW
from tests.offload.zenflow.support import CPU, HYPER, assert_close

ROWS, COLS = 4, 6
SEL = torch.tensor([1, 4])


def _grads(n: int, seed: int = 1, shape: tuple[int, ...] = (ROWS, COLS)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


class _Columns:
    """adamw_ on a fixed set of columns of a reference copy, in fp32 (each column's own moments)."""

    def __init__(self, master: torch.Tensor) -> None:
        self.p = master.clone()
        self.m, self.v = torch.zeros_like(master), torch.zeros_like(master)
        self.steps = 0

    def step(self, g: torch.Tensor) -> None:
        self.steps += 1
        adamw_(self.p, g, self.m, self.v, self.steps, HYPER)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selected_columns_update_like_adamw_and_the_others_do_not_move(dtype: torch.dtype) -> None:
    """With a gradient in every column and weight decay on, only the selected columns change: bitwise as
    adamw_ on those columns (bf16: on their fp32 master, the parameter its rounding); the moments are
    ``[rows, k]``, the step counts the number of steps."""
    w0 = torch.randn(ROWS, COLS).to(dtype)
    w = torch.nn.Parameter(w0.clone())
    opt = SelectiveAdamW(HYPER)
    opt.add_columns("w", w, SEL)
    ref = _Columns(w0[:, SEL].float())
    for g in _grads(4):
        w.grad = g.to(dtype)
        opt.step()
        ref.step(w.grad[:, SEL].float())
    others = [c for c in range(COLS) if c not in SEL.tolist()]
    assert torch.equal(w.detach()[:, others], w0[:, others])
    assert torch.equal(w.detach()[:, SEL], ref.p.to(dtype))
    st = opt.state_dict()["w"]
    assert torch.equal(st["cols"], SEL)
    assert torch.equal(st["exp_avg"], ref.m) and torch.equal(st["exp_avg_sq"], ref.v)
    assert st["steps"].tolist() == [4, 4]
    if dtype == torch.float32:
        assert st["master"] is None
    else:
        assert torch.equal(st["master"], ref.p)


def test_whole_tensor_entries_update_like_fused_adamw() -> None:
    """add_full: a 1-D parameter updates as the fused kernel does with its own state (bitwise)."""
    b0 = torch.randn(COLS)
    b = torch.nn.Parameter(b0.clone())
    opt = SelectiveAdamW(HYPER)
    opt.add_full("b", b)
    p, m, v, s = b0.clone(), torch.zeros(COLS), torch.zeros(COLS), torch.zeros(())
    for g in _grads(3, shape=(COLS,)):
        b.grad = g.clone()
        opt.step()
        fused_adamw_([p], [g.clone()], [m], [v], [s], HYPER, Gate.always(CPU))
    assert torch.equal(b.detach(), p)
    st = opt.state_dict()["b"]
    assert st["cols"] is None and st["steps"] == 3
    assert torch.equal(st["exp_avg"], m) and torch.equal(st["exp_avg_sq"], v)


def test_bf16_columns_start_from_the_values_given() -> None:
    """``values``: the fp32 master of a bf16 parameter's columns starts there (e.g. the CPU master's more
    precise values), not from the bf16 parameter."""
    w = torch.nn.Parameter(torch.randn(ROWS, COLS).to(torch.bfloat16))
    start = w.detach()[:, SEL].float() + 1e-3  # off the bf16 grid
    opt = SelectiveAdamW(HYPER)
    opt.add_columns("w", w, SEL, values=start)
    assert torch.equal(opt.state_dict()["w"]["master"], start)
    w.grad = _grads(1)[0].to(torch.bfloat16)
    opt.step()
    ref = _Columns(start)
    ref.step(w.grad[:, SEL].float())
    assert torch.equal(w.detach()[:, SEL], ref.p.to(torch.bfloat16))


def test_reselection_keeps_the_kept_columns_state_and_starts_new_ones_at_zero() -> None:
    """[1, 3] -> [3, 5]: column 3 keeps its moments and step count, column 5 starts at zero moments,
    step 0 (its next step is bias-corrected as a first step); column 1 is reported dropped with its newest
    value; the old index tensor is replaced, not mutated."""
    w = torch.nn.Parameter(torch.randn(ROWS, COLS))
    opt = SelectiveAdamW(HYPER)
    opt.add_columns("w", w, torch.tensor([1, 3]))
    old = opt.columns("w")
    assert old is not None
    grads = _grads(5)
    col3 = _Columns(w.detach()[:, 3].clone())
    for g in grads[:3]:
        w.grad = g
        opt.step()
        col3.step(g[:, 3])
    before = opt.state_dict()["w"]
    scores = torch.zeros(COLS)
    scores[[3, 5]] = 1.0
    (dropped,) = opt.reselect(given_scores={"w": scores})
    assert old.tolist() == [1, 3] and opt.columns("w") is not old
    assert opt.columns("w").tolist() == [3, 5]
    assert dropped.names == ["w"] and dropped.cols.tolist() == [[1, 3]]
    assert dropped.mask.tolist() == [[True, False]]
    assert torch.equal(dropped.values[0], w.detach()[:, [1, 3]])
    st = opt.state_dict()["w"]
    assert st["steps"].tolist() == [3, 0]
    assert torch.equal(st["exp_avg"][:, 0], before["exp_avg"][:, 1])
    assert torch.equal(st["exp_avg_sq"][:, 0], before["exp_avg_sq"][:, 1])
    assert not st["exp_avg"][:, 1].any() and not st["exp_avg_sq"][:, 1].any()
    col5 = _Columns(w.detach()[:, 5].clone())
    w1 = w.detach()[:, 1].clone()
    for g in grads[3:]:
        w.grad = g
        opt.step()
        col3.step(g[:, 3])
        col5.step(g[:, 5])
    assert torch.equal(w.detach()[:, 3], col3.p) and torch.equal(w.detach()[:, 5], col5.p)
    assert torch.equal(w.detach()[:, 1], w1)  # dropped: the device no longer updates it


def test_a_gated_off_step_changes_nothing() -> None:
    """A skipped step (a NaN in the gradients, the gate false) leaves values, moments and step counts of
    whole and column entries bit for bit."""
    w, b = torch.nn.Parameter(torch.randn(ROWS, COLS)), torch.nn.Parameter(torch.randn(COLS))
    opt = SelectiveAdamW(HYPER)
    opt.add_columns("w", w, SEL)
    opt.add_full("b", b)
    w.grad, b.grad = _grads(1)[0], torch.randn(COLS)
    opt.step()
    values, state = (w.detach().clone(), b.detach().clone()), opt.state_dict()
    w.grad, b.grad = torch.full((ROWS, COLS), float("nan")), torch.full((COLS,), float("inf"))
    opt.step(gate=Gate(torch.tensor(False)))
    assert torch.equal(w.detach(), values[0]) and torch.equal(b.detach(), values[1])
    after = opt.state_dict()
    for name in ("w", "b"):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(after[name][key], state[name][key]), (name, key)
    assert after["w"]["steps"].tolist() == [1, 1] and after["b"]["steps"] == 1


def test_an_entry_without_gradient_is_not_updated_in_its_group() -> None:
    """Two weights of one shape share a group; the one without a gradient keeps its values and step
    counts while the other updates as adamw_ would."""
    a, c = torch.nn.Parameter(torch.randn(ROWS, COLS)), torch.nn.Parameter(torch.randn(ROWS, COLS))
    c0 = c.detach().clone()
    opt = SelectiveAdamW(HYPER)
    opt.add_columns("a", a, SEL)
    opt.add_columns("c", c, SEL)
    ref = _Columns(a.detach()[:, SEL].clone())
    for g in _grads(2):
        a.grad = g
        opt.step()
        ref.step(g[:, SEL])
    assert torch.equal(a.detach()[:, SEL], ref.p)
    assert torch.equal(c.detach(), c0)
    st = opt.state_dict()
    assert st["a"]["steps"].tolist() == [2, 2] and st["c"]["steps"].tolist() == [0, 0]
    assert not st["c"]["exp_avg"].any()


def test_want_sq_gives_the_squared_norms_of_the_parts_it_updates() -> None:
    w, b = torch.nn.Parameter(torch.randn(ROWS, COLS)), torch.nn.Parameter(torch.randn(COLS))
    opt = SelectiveAdamW(HYPER)
    opt.add_columns("w", w, SEL)
    opt.add_full("b", b)
    w.grad, b.grad = _grads(1)[0], torch.randn(COLS)
    sq = opt.step(want_sq=True)
    assert sq is not None
    full_sq, cols_sq = sq
    assert_close(full_sq, b.grad.double().square().sum(), rtol=1e-6, atol=0)
    assert_close(cols_sq, w.grad[:, SEL].double().square().sum(), rtol=1e-6, atol=0)


def test_fp16_gradients_are_unscaled_by_the_gate_factor_in_fp32() -> None:
    """Loss-scaled fp16 gradients with the gate's factor ``1/scale`` update columns and whole tensors
    exactly like the unscaled gradients (a power-of-two scale: the fp32 products are exact), fp32
    masters included. A large eps against small gradients: AdamW is otherwise nearly blind to the
    gradient's scale, and a missed factor would not show."""
    scale = 1024.0
    h = AdamWHyper(HYPER.lr, HYPER.beta1, HYPER.beta2, 1e-3, HYPER.weight_decay)
    w0, b0 = torch.randn(ROWS, COLS).half(), torch.randn(COLS).half()
    models = []
    for scaled in (False, True):
        w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
        opt = SelectiveAdamW(h)
        opt.add_columns("w", w, SEL)
        opt.add_full("b", b)
        for gw in _grads(3):
            gw = gw * 1e-3
            gb = gw[0]
            w.grad, b.grad = gw.half(), gb.half()
            gate = Gate.always(CPU)
            if scaled:
                w.grad, b.grad = w.grad * scale, b.grad * scale
                gate = Gate(torch.tensor(True), grad_factor=torch.tensor(1 / scale))
            opt.step(gate=gate)
        st = opt.state_dict()
        models.append((w.detach(), b.detach(), st["w"]["master"], st["b"]["master"]))
    plain, scaled_run = models
    assert not torch.equal(plain[0], w0) and not torch.equal(plain[1], b0)
    assert all(torch.equal(a, b) for a, b in zip(plain, scaled_run, strict=True))


def _optimizer(w: torch.nn.Parameter, b: torch.nn.Parameter, cols: torch.Tensor) -> SelectiveAdamW:
    opt = SelectiveAdamW(HYPER)
    opt.add_columns("w", w, cols)
    opt.add_full("b", b)
    return opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_bit_for_bit(dtype: torch.dtype) -> None:
    """A fresh optimizer loaded from another's state (after a reselection: per-column step counts differ)
    continues exactly as the original."""
    w0, b0 = torch.randn(ROWS, COLS).to(dtype), torch.randn(COLS).to(dtype)
    wa, ba = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    a = _optimizer(wa, ba, SEL)
    grads = _grads(6)
    for g in grads[:3]:
        wa.grad, ba.grad = g.to(dtype), g[0].to(dtype)
        a.step()
        if g is grads[1]:
            scores = torch.zeros(COLS)
            scores[[0, 4]] = 1.0
            a.reselect(given_scores={"w": scores})
    sd = a.state_dict()
    wb, bb = torch.nn.Parameter(wa.detach().clone()), torch.nn.Parameter(ba.detach().clone())
    b = _optimizer(wb, bb, torch.tensor([2, 3]))  # placeholder columns: the state brings its own
    b.load_state_dict(sd)
    assert b.columns("w").tolist() == [0, 4]
    for g in grads[3:]:
        for w, bias, opt in ((wa, ba, a), (wb, bb, b)):
            w.grad, bias.grad = g.to(dtype), g[0].to(dtype)
            opt.step()
    assert torch.equal(wa.detach(), wb.detach()) and torch.equal(ba.detach(), bb.detach())


def test_load_state_dict_rejects_another_models_state() -> None:
    w, b = torch.nn.Parameter(torch.randn(ROWS, COLS)), torch.nn.Parameter(torch.randn(COLS))
    sd = _optimizer(w, b, SEL).state_dict()
    other = SelectiveAdamW(HYPER)
    other.add_columns("w", w, SEL)
    with pytest.raises(ValueError, match="names do not match"):
        other.load_state_dict(sd)
    swapped = SelectiveAdamW(HYPER)
    swapped.add_full("w", w)
    swapped.add_full("b", b)
    with pytest.raises(ValueError, match="different part"):
        swapped.load_state_dict(sd)


def test_registration_rejects_non_2d_columns_and_mixed_devices() -> None:
    opt = SelectiveAdamW(HYPER)
    with pytest.raises(ValueError, match="2-D"):
        opt.add_columns("b", torch.nn.Parameter(torch.randn(COLS)), torch.tensor([0]))
    opt.add_full("b", torch.nn.Parameter(torch.randn(COLS)))
    with pytest.raises(ValueError, match="one device"):
        opt.add_full("m", torch.nn.Parameter(torch.empty(COLS, device="meta")))
