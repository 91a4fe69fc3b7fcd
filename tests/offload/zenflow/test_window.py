"""offload.zenflow.window: the CPU AdamW step of a window on its accumulated gradient, and the merge of
its result into the device weights at the next boundary, except the columns in the union of the
selection the window ran under and the current one (the device's values win there, per the rule in
offload/zenflow/__init__.py). Submitting leaves the model alone (the result lands one boundary later:
the staleness), ``merged`` previews a merge without changing anything, the warm-up's synchronous step
updates whole split weights at once, and a saved result in flight is restored."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from offload.collectives import EngineGroup
from offload.config import EngineConfig
from offload.cpu_adam import adam_step
from offload.cpu_thread import CPUThread
from offload.timing import StepStats
from offload.zenflow.adamw import AdamWHyper, adamw_
from offload.zenflow.layout import HostLayout
from offload.zenflow.window import WindowUpdate
from tests.offload.zenflow.support import (
    assert_close,
    config,
    cpu_thread,
    fill_grads,
    host_layout,
    tiny_model,
)

LR = 3e-2
#: The window's selection (S_{v-1}) and the one after the boundary's reselection (S_v), per weight.
OLD = {"0.weight": [0, 1], "1.weight": [2, 3], "2.weight": [0]}
NEW = {"0.weight": [1, 4], "1.weight": [2, 3], "2.weight": [2]}


@pytest.fixture
def thread() -> Iterator[CPUThread]:
    with cpu_thread() as t:
        yield t


@pytest.fixture(autouse=True)
def no_grad() -> Iterator[None]:
    """ZenFlowMode runs the window update under torch.no_grad (the merge writes into leaf parameters)."""
    with torch.no_grad():
        yield


def _update(lay: HostLayout, cfg: EngineConfig, thread: CPUThread) -> WindowUpdate:
    return WindowUpdate(lay, lay.ops, EngineGroup(), thread, cfg, threads=1)


def _fill_accumulator(lay: HostLayout, acc_i: int, seed: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for st in lay.stores:
        st.bufs[acc_i].copy_((torch.randn(st.numel, generator=gen) * scale).to(st.bufs[acc_i].dtype))


def _expected_result(lay: HostLayout, acc_i: int, cfg: EngineConfig) -> dict[str, torch.Tensor]:
    """The CPU step's new weights, per split weight: the C++ AdamW (its step 1) on copies of the master
    and moments with the accumulator's gradient, at LR."""
    out = {}
    for st in lay.stores:
        master = st.master.clone()
        adam_step(
            master,
            st.bufs[acc_i].clone(),
            st.exp_avg.clone(),
            st.exp_avg_sq.clone(),
            step=1,
            lr=LR,
            beta1=cfg.betas[0],
            beta2=cfg.betas[1],
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
        for s in lay.members(st):
            out[s.name] = st.shaped(master, s.index).to(s.param.dtype)
    return out


def _sel(picks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    return {n: torch.tensor(c) for n, c in picks.items()}


def _device_moves(lay: HostLayout) -> dict[str, torch.Tensor]:
    """The device updates its columns meanwhile (every column here, to tell device values from the
    CPU result's); the device's weights after."""
    for s in lay.splits:
        s.param.add_(100.0)
    return {s.name: s.param.detach().clone() for s in lay.splits}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_takes_the_cpu_result_outside_the_union_of_old_and_new_selections(
    dtype: torch.dtype, thread: CPUThread
) -> None:
    """Submitting leaves the model untouched; collecting writes the CPU result (AdamW on the
    accumulator at the given lr) into every column outside ``S_{v-1} | S_v`` and keeps the device's
    values in the union (a column dropped at this boundary included)."""
    cfg = config()
    model = tiny_model(dtype)
    lay = host_layout(model, cfg)
    update = _update(lay, cfg, thread)
    _fill_accumulator(lay, 0, seed=1)
    expected = _expected_result(lay, 0, cfg)
    before = {s.name: s.param.detach().clone() for s in lay.splits}
    pending = update.submit(0, LR, None, _sel(OLD), [])
    thread.wait(pending.future)
    assert all(torch.equal(s.param.detach(), before[s.name]) for s in lay.splits)  # not before the merge
    device = _device_moves(lay)
    new = _sel(NEW)
    stats = StepStats()
    update.collect(pending, stats, new.get)
    assert stats.applied_cpu_update and stats.bytes_h2d > 0
    for s in lay.splits:
        keep = sorted(set(OLD[s.name]) | set(NEW[s.name]))
        rest = [c for c in range(s.param.shape[1]) if c not in keep]
        got = s.param.detach()
        assert torch.equal(got[:, keep], device[s.name][:, keep]), s.name
        assert torch.equal(got[:, rest], expected[s.name][:, rest]), s.name
        assert torch.equal(s.store.shaped(s.store.result(0), s.index), expected[s.name])


def test_the_cpu_step_is_adamw_on_the_window_gradient(thread: CPUThread) -> None:
    """The result against the functional reference (adamw_, torch's single-tensor arithmetic; the C++
    sqrt is correctly rounded, torch's may be 1 ulp off: offload.cpu_adam), weight decay included."""
    cfg = config()
    lay = host_layout(tiny_model(), cfg)
    update = _update(lay, cfg, thread)
    _fill_accumulator(lay, 0, seed=2)
    (st,) = lay.stores
    p, g = st.master.clone(), st.bufs[0].clone()
    adamw_(
        p,
        g,
        torch.zeros_like(p),
        torch.zeros_like(p),
        1,
        AdamWHyper(LR, *cfg.betas, cfg.eps, cfg.weight_decay),
    )
    thread.wait(update.submit(0, LR, None, _sel(OLD), []).future)
    assert_close(st.master, p, rtol=1e-6, atol=1e-7)
    assert st.steps == [1, 1, 1]


def test_scale_divides_the_accumulated_sum_first(thread: CPUThread) -> None:
    """ "adaptive" windows submit their sum with ``scale = 1/n``: the same result as the mean."""
    cfg = config()
    results = []
    for acc_scale, scale in ((1.0, None), (4.0, 0.25)):
        lay = host_layout(tiny_model(), cfg)
        _fill_accumulator(lay, 0, seed=3, scale=acc_scale)
        thread.wait(_update(lay, cfg, thread).submit(0, LR, scale, _sel(OLD), []).future)
        results.append(lay.stores[0].master.clone())
    assert torch.equal(results[0], results[1])


def test_the_result_is_the_window_it_was_submitted_for(thread: CPUThread) -> None:
    """One window stale: the result merged at the boundary after next is the earlier window's; filling
    the other accumulator (the next window) meanwhile does not change it."""
    cfg = config()
    lay = host_layout(tiny_model(torch.bfloat16), cfg)
    update = _update(lay, cfg, thread)
    _fill_accumulator(lay, 0, seed=4)
    expected = _expected_result(lay, 0, cfg)
    pending = update.submit(0, LR, None, _sel(OLD), [])
    _fill_accumulator(lay, 1, seed=5)  # window v + 1 accumulates into the other buffer
    update.collect(pending, StepStats(), _sel(OLD).get)
    for s in lay.splits:
        rest = [c for c in range(s.param.shape[1]) if c not in OLD[s.name]]
        assert torch.equal(s.param.detach()[:, rest], expected[s.name][:, rest])


def test_merged_previews_the_merge_without_changing_the_model(thread: CPUThread) -> None:
    cfg = config()
    model = tiny_model()
    lay = host_layout(model, cfg)
    update = _update(lay, cfg, thread)
    _fill_accumulator(lay, 0, seed=6)
    pending = update.submit(0, LR, None, _sel(OLD), [])
    _device_moves(lay)
    before = {s.name: s.param.detach().clone() for s in lay.splits}
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = _sel(NEW)
    update.merged(pending, out, new.get)
    assert all(torch.equal(s.param.detach(), before[s.name]) for s in lay.splits)
    update.collect(pending, StepStats(), new.get)
    for s in lay.splits:
        assert torch.equal(out[s.name], s.param.detach()), s.name
    assert torch.equal(out["0.bias"], model[0].bias.detach())  # not split: untouched


def test_same_selection_object_keeps_only_it(thread: CPUThread) -> None:
    """No reselection at the boundary (the window's selection is the current one, the same tensor): the
    device keeps exactly those columns."""
    cfg = config()
    lay = host_layout(tiny_model(), cfg)
    update = _update(lay, cfg, thread)
    _fill_accumulator(lay, 0, seed=7)
    expected = _expected_result(lay, 0, cfg)
    sel = _sel(OLD)
    pending = update.submit(0, LR, None, sel, [])
    device = _device_moves(lay)
    update.collect(pending, StepStats(), sel.get)
    for s in lay.splits:
        keep = OLD[s.name]
        rest = [c for c in range(s.param.shape[1]) if c not in keep]
        assert torch.equal(s.param.detach()[:, keep], device[s.name][:, keep])
        assert torch.equal(s.param.detach()[:, rest], expected[s.name][:, rest])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warm_up_step_updates_whole_split_weights_at_once(dtype: torch.dtype, thread: CPUThread) -> None:
    """The synchronous step: every column of every split weight with a gradient becomes the CPU AdamW's
    result now (bf16: the master rounded); a weight without gradient is not stepped."""
    cfg = config(full_warm_up_rounds=1)
    model = tiny_model(dtype)
    lay = host_layout(model, cfg)
    update = _update(lay, cfg, thread)
    fill_grads(model, 8)
    model[1].weight.grad = None
    (st,) = lay.stores
    masters = {s.name: st.shaped(st.master, s.index).clone() for s in lay.splits}
    before = model[1].weight.detach().clone()
    stats = StepStats()
    update.synchronous(stats, LR, None)
    assert stats.applied_cpu_update and stats.cpu_optimizer_seconds > 0
    assert st.steps == [1, 0, 1]
    assert torch.equal(model[1].weight.detach(), before)
    h = AdamWHyper(LR, *cfg.betas, cfg.eps, cfg.weight_decay)
    for name in ("0.weight", "2.weight"):
        s = lay.by_name[name]
        assert s.param.grad is not None
        p = masters[name]
        adamw_(p, s.param.grad.float(), torch.zeros_like(p), torch.zeros_like(p), 1, h)
        assert_close(st.shaped(st.master, s.index), p, rtol=1e-6, atol=1e-7)
        assert torch.equal(s.param.detach(), st.shaped(st.master, s.index).to(dtype))


def test_a_saved_result_in_flight_is_restored(thread: CPUThread) -> None:
    """A state saved with a CPU result in flight keeps the window's selection; restoring it rebuilds the
    bf16 result from the master into its accumulator, and the merge is the same as the original's."""
    cfg = config()
    lay = host_layout(tiny_model(torch.bfloat16), cfg)
    update = _update(lay, cfg, thread)
    _fill_accumulator(lay, 1, seed=9)
    pending = update.submit(1, LR, None, _sel(OLD), [])
    saved = WindowUpdate.pending_state(pending)
    assert saved is not None and {n: c.tolist() for n, c in saved["sel"].items()} == OLD
    (st,) = lay.stores
    result = st.result(1).clone()
    st.bufs[1].fill_(0.0)  # a loaded state's accumulator: not saved (the master is)
    restored = update.restore(saved, 1)
    assert restored.acc_index == 1 and torch.equal(st.result(1), result)
    update.collect(restored, StepStats(), _sel(NEW).get)
    for s in lay.splits:
        rest = [c for c in range(s.param.shape[1]) if c not in set(OLD[s.name]) | set(NEW[s.name])]
        assert torch.equal(s.param.detach()[:, rest], st.shaped(result, s.index)[:, rest])
