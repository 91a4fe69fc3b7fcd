"""offload.zenflow.accumulation: a window's accumulator holds the window *mean* of the split weights'
gradients (the sum over the window divided by its length; "adaptive": the sum), for host accumulation
(the CPU thread, into ``bufs[acc_i]`` in the parameters' dtype, fp32 for fp16) and device accumulation
(an fp32 device accumulator, copied into the host accumulator once); loss-scaled fp16 gradients are
unscaled in fp32; a skipped step adds nothing; windows alternate between the two host accumulators."""

from __future__ import annotations

import pytest
import torch

from offload.guard import Gate
from offload.host import accumulate_torch
from offload.timing import StepStats
from offload.zenflow.accumulation import Accumulation
from offload.zenflow.layout import HostLayout
from tests.offload.zenflow.support import (
    CPU,
    assert_close,
    config,
    cpu_thread,
    fill_grads,
    host_layout,
    tiny_model,
)

WINDOW = 3
LOSS_SCALE = 2.0**12  # |randn| < 16 stays finite in fp16 times this
#: Error of the window mean against the fp64 mean, relative to the mean of the gradients' magnitudes (each
#: step rounds a partial sum no larger than that): fp32 accumulators; bf16 ones, 3 roundings of at most
#: 2**-9 (twice that here).
RTOL = {torch.float32: 1e-6, torch.float16: 1e-6, torch.bfloat16: 3 * 2.0**-8}


def _drawn(model: torch.nn.Module, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fresh gradients in ``model``; the values the optimizer should see, in fp64 (fp16: loss-scaled
    gradients, ``LOSS_SCALE`` times these, with one column of values that underflow in fp16 unscaled)."""
    fill_grads(model, seed)
    out = {}
    for n, p in model.named_parameters():
        assert p.grad is not None
        if dtype == torch.float16:
            g = p.grad.float()
            if g.dim() == 2:
                g[:, 0] = 2.0**-22 * (1 + seed / 8)  # 2**-22: below fp16's normal range (2**-14)
            p.grad = (g * LOSS_SCALE).half()
            out[n] = p.grad.double() / LOSS_SCALE
        else:
            out[n] = p.grad.double()
    return out


def _mean(draws: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    return sum(d[name] for d in draws) / len(draws)


def _assert_mean(got: torch.Tensor, draws: list[dict[str, torch.Tensor]], name: str, rtol: float) -> None:
    """``got`` is the window mean of ``name``'s gradients within ``rtol`` of their mean magnitude."""
    scale = sum(d[name].abs() for d in draws) / len(draws)
    err = (got.double() - _mean(draws, name)).abs()
    assert (err <= rtol * scale).all(), float((err / scale).max())


def _host_window(
    lay: HostLayout, acc: Accumulation, model: torch.nn.Module, dtype: torch.dtype, *, acc_i: int, seed: int
) -> list[dict[str, torch.Tensor]]:
    """One window of WINDOW steps accumulated on the host; the gradients drawn."""
    factor = 1 / LOSS_SCALE if dtype == torch.float16 else None
    draws = []
    for i in range(WINDOW):
        draws.append(_drawn(model, seed + i, dtype))
        stats = StepStats()
        staged = acc.stage(stats, None)
        assert stats.bytes_d2h == sum(s.param.grad.numel() * s.param.grad.element_size() for s in lay.splits)
        acc.queue(staged, True, first=i == 0, acc_i=acc_i, factor=factor)
        acc.wait_reads()
    return draws


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_accumulator_holds_the_window_mean(dtype: torch.dtype) -> None:
    """After a window the accumulator is the mean of its gradients (fp16: of the unscaled ones, in fp32,
    tiny values included), in the dtype the layout gives it; the bits are those of the documented
    arithmetic (``alpha = 1/update_interval`` times the factor, summed step by step,
    offload.host.accumulate_torch)."""
    cfg = config(update_interval=WINDOW)
    model = tiny_model(dtype)
    lay = host_layout(model, cfg)
    (store,) = lay.stores
    store.bufs[0].fill_(7.0)  # a stale window's sum: the first step overwrites it
    with cpu_thread() as thread:
        acc = Accumulation(lay, lay.ops, thread, cfg, threads=1, on_device=False)
        draws = _host_window(lay, acc, model, dtype, acc_i=0, seed=0)
    assert store.bufs[0].dtype == (torch.float32 if dtype == torch.float16 else dtype)
    for s in lay.splits:
        got = store.shaped(store.bufs[0], s.index)
        _assert_mean(got, draws, s.name, RTOL[dtype])
    # bit for bit: the same sums through the torch reference path
    alpha = 1 / WINDOW * (1 / LOSS_SCALE if dtype == torch.float16 else 1.0)
    ref = torch.empty_like(store.bufs[0])
    for i in range(WINDOW):
        _drawn(model, i, dtype)  # the same gradients again
        for s in lay.splits:
            assert s.param.grad is not None
            accumulate_torch(store.flat(ref, s.index), s.param.grad.reshape(-1), alpha=alpha, first=i == 0)
    assert torch.equal(store.bufs[0], ref)


def test_host_windows_alternate_accumulators_and_skip_what_is_skipped() -> None:
    """Window v fills ``bufs[v % 2]`` while the other keeps the previous window's mean; a skipped step
    adds nothing; a weight without gradient in a window's first step gets zeros there."""
    cfg = config(update_interval=WINDOW)
    model = tiny_model()
    lay = host_layout(model, cfg)
    (store,) = lay.stores
    with cpu_thread() as thread:
        acc = Accumulation(lay, lay.ops, thread, cfg, threads=1, on_device=False)
        _host_window(lay, acc, model, torch.float32, acc_i=0, seed=0)
        first = store.bufs[0].clone()
        fill_grads(model, 10)
        model[1].weight.grad = None
        acc.queue(acc.stage(StepStats(), None), True, first=True, acc_i=1)
        acc.wait_reads()
        assert torch.equal(store.bufs[0], first)
        one = store.bufs[1].clone()
        w0 = lay.by_name["0.weight"]
        assert_close(store.shaped(one, w0.index), w0.param.grad / WINDOW, rtol=1e-6, atol=0)
        assert not store.shaped(one, lay.by_name["1.weight"].index).any()
        fill_grads(model, 11, scale=float("nan"))  # a skipped step's gradients
        acc.queue(acc.stage(StepStats(), None), False, first=False, acc_i=1)
        acc.wait_reads()
        assert acc.slot_futs == [None, None]
        assert torch.equal(store.bufs[1], one)


def test_adaptive_windows_accumulate_the_sum() -> None:
    """ "adaptive": alpha is 1 (the boundary divides by the window's length, offload.zenflow.window)."""
    cfg = config(update_interval="adaptive", select_interval=4)
    model = tiny_model()
    lay = host_layout(model, cfg)
    (store,) = lay.stores
    with cpu_thread() as thread:
        acc = Accumulation(lay, lay.ops, thread, cfg, threads=1, on_device=False)
        assert acc.alpha == 1.0
        draws = _host_window(lay, acc, model, torch.float32, acc_i=0, seed=0)
    for s in lay.splits:
        total = sum(d[s.name] for d in draws)
        assert_close(store.shaped(store.bufs[0], s.index), total, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_device_accumulator_holds_the_window_mean_and_goes_to_the_host_once(dtype: torch.dtype) -> None:
    """Device accumulation: the fp32 device accumulator is the window mean (fp16: unscaled by the gate's
    factor, in fp32); at the boundary it lands in host accumulator 0 rounded to that buffer's dtype; a
    skipped step adds exact zeros even over non-finite gradients."""
    cfg = config(update_interval=WINDOW, accumulate_on="device")
    model = tiny_model(dtype)
    lay = host_layout(model, cfg, on_device=True)
    (store,) = lay.stores
    acc = Accumulation(lay, lay.ops, None, cfg, threads=1, on_device=True)
    gate = (
        Gate(torch.tensor(True), grad_factor=torch.tensor(1 / LOSS_SCALE))
        if dtype == torch.float16
        else Gate.always(CPU)
    )
    draws = []
    for i in range(WINDOW):
        draws.append(_drawn(model, i, dtype))
        acc.add_on_device(gate, first=i == 0)
        if i == 1:
            kept = [s.dacc.clone() for s in lay.splits if s.dacc is not None]
            fill_grads(model, 99, scale=float("nan"))
            acc.add_on_device(Gate(torch.tensor(False), grad_factor=torch.tensor(0.0)), first=False)
            assert all(torch.equal(s.dacc, k) for s, k in zip(lay.splits, kept, strict=True))
    for s in lay.splits:
        assert s.dacc is not None and s.dacc.dtype == torch.float32
        _assert_mean(s.dacc, draws, s.name, 1e-6)
    stats = StepStats()
    copies = acc.to_host(0, stats)
    for t in copies:
        t.wait()
    assert stats.bytes_d2h == store.bufs[0].numel() * store.bufs[0].element_size()
    for s in lay.splits:
        assert s.dacc is not None
        assert torch.equal(store.shaped(store.bufs[0], s.index), s.dacc.to(store.bufs[0].dtype))


def test_device_accumulator_state_round_trip() -> None:
    cfg = config(update_interval=WINDOW, accumulate_on="device")
    model = tiny_model()
    lay = host_layout(model, cfg, on_device=True)
    acc = Accumulation(lay, lay.ops, None, cfg, threads=1, on_device=True)
    fill_grads(model, 0)
    acc.add_on_device(Gate.always(CPU), first=True)
    saved = acc.device_state()
    assert set(saved) == {s.name for s in lay.splits}
    other_lay = host_layout(tiny_model(), cfg, on_device=True)
    other = Accumulation(other_lay, other_lay.ops, None, cfg, threads=1, on_device=True)
    other.load_device_state(saved)
    for s in other_lay.splits:
        assert s.dacc is not None and torch.equal(s.dacc, lay.by_name[s.name].dacc)
