"""offload.zenflow.mode: the step orchestration and the window schedule, driven directly (gradients set by
hand on a tiny module, the CPU device's real parts, no engine): the unselected columns are exactly one
window stale (none with ``overlap_step=False``), a column dropped at a reselection keeps its device value
at the next merge and reaches the CPU master before the next CPU step, the warm-up's synchronous rounds,
skipped steps that change nothing, the reselection schedule ("epoch" included), "adaptive" windows, the
consolidated weights, and the state dict's round trip."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from offload.cpu_adam import adam_step
from offload.device import DeviceOps
from offload.guard import Gate
from offload.host import accumulate_torch
from offload.timing import StepStats
from offload.zenflow.mode import ZenFlowMode
from tests.offload.zenflow.support import CPU, config, named, tiny_model

LR = 1e-2
#: Columns given large gradients, so the selection picks them (k = 2, 2, 1).
A = {"0.weight": [0, 1], "1.weight": [0, 1], "2.weight": [0]}
B = {"0.weight": [5, 6], "1.weight": [5, 6], "2.weight": [2]}
SPLIT = ("0.weight", "1.weight", "2.weight")


@contextmanager
def _zenflow(model: torch.nn.Module, **kw: Any) -> Iterator[ZenFlowMode]:
    mode = ZenFlowMode(named(model), config(**kw), DeviceOps(CPU), threads=1, optimizer_cores=None)
    try:
        yield mode
    finally:
        mode.close()


def _hot_grads(
    model: torch.nn.Module, seed: int, hot: dict[str, list[int]], rest: float = 0.1
) -> dict[str, torch.Tensor]:
    """Small gradients (``rest`` times randn) with 1 added in the ``hot`` columns; the values set."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen) * rest
        if n in hot:
            g[:, hot[n]] += 1.0
        p.grad = g
        out[n] = g.clone()
    return out


def _skip(mode: ZenFlowMode) -> Gate:
    """A skipped step's gate, its verdict on its way to the host as the engine makes it."""
    ok = torch.tensor(False)
    return Gate(ok, mode.ops.read_later([ok]), 0)


def _step(
    mode: ZenFlowMode, model: torch.nn.Module, seed: int, hot: dict[str, list[int]] = A, *, skip: bool = False
) -> dict[str, torch.Tensor]:
    grads = _hot_grads(model, seed, hot, rest=float("nan") if skip else 0.1)
    stats = StepStats()
    mode.step(stats, LR, _skip(mode) if skip else Gate.always(CPU))
    mode.before_zero_grad()
    return grads


def _selection(mode: ZenFlowMode) -> dict[str, list[int]]:
    return {n: c.tolist() for n, c in mode.selection().items()}


def _wait_cpu(mode: ZenFlowMode) -> None:
    assert mode.cpu_thread is not None and mode.pending is not None
    mode.cpu_thread.wait(mode.pending.future)


class _CpuRef:
    """The CPU side by hand: the store's flat fp32 master and moments, a window's mean gradient summed as
    the accumulation does (offload.host.accumulate_torch: the C++ accumulation's bits) and the C++ AdamW."""

    def __init__(self, mode: ZenFlowMode) -> None:
        (self.store,) = mode.stores
        self.names = [s.name for s in mode.layout.members(self.store)]
        self.master = self.store.master.clone()
        self.m, self.v = torch.zeros_like(self.master), torch.zeros_like(self.master)
        self.steps = 0
        self.cfg = mode.cfg

    def step(self, window: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        acc = torch.empty_like(self.master)
        for i, grads in enumerate(window):
            flat = torch.cat([grads[n].reshape(-1) for n in self.names])
            accumulate_torch(acc, flat, alpha=1 / len(window), first=i == 0)
        self.steps += 1
        cfg = self.cfg
        adam_step(
            self.master,
            acc,
            self.m,
            self.v,
            step=self.steps,
            lr=LR,
            beta1=cfg.betas[0],
            beta2=cfg.betas[1],
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
        return self.shaped(self.master)

    def shaped(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: self.store.shaped(flat, i).clone() for i, n in enumerate(self.names)}


def _others(name: str, cols: list[int], width: int) -> list[int]:
    return [c for c in range(width) if c not in cols]


@pytest.mark.parametrize("overlap", [True, False])
def test_unselected_columns_are_one_window_stale(overlap: bool) -> None:
    """Windows of 2 steps, no reselection: window v's CPU result (AdamW on its mean gradient) reaches the
    unselected columns at the end of window v + 1, and nothing else moves them in between;
    ``overlap_step=False`` applies it at the end of window v itself."""
    model = tiny_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    with _zenflow(model, update_interval=2, select_interval=100, overlap_step=overlap) as mode:
        ref = _CpuRef(mode)
        results: list[dict[str, torch.Tensor]] = [initial]
        window: list[dict[str, torch.Tensor]] = []
        for step in range(1, 7):
            window.append(_step(mode, model, step))
            if step % 2 == 0:
                results.append(ref.step(window))
                window = []
            assert _selection(mode) == A
            merged_windows = step // 2 if not overlap else max(0, step // 2 - 1)
            for n in SPLIT:
                p = model.get_parameter(n).detach()
                rest = _others(n, A[n], p.shape[1])
                assert torch.equal(p[:, rest], results[merged_windows][n][:, rest]), (step, n)
                assert not torch.equal(p[:, A[n]], initial[n][:, A[n]])  # the device's, every step


def test_a_dropped_column_keeps_its_device_value_and_reaches_the_master_before_the_next_cpu_step() -> None:
    """A -> B at step 4 (windows of 2, a reselection every 4 steps). At step 6 the merge of window 2's
    result (computed while A was the device's) keeps A's device values (S_{v-1} | S_v); the stash then
    writes them into the CPU master before window 3's CPU step, whose result at step 8 carries them on."""
    model = tiny_model()
    with _zenflow(model, update_interval=2, select_interval=4) as mode:
        (store,) = mode.stores
        for step in range(1, 4):
            _step(mode, model, step, A)
        assert _selection(mode) == A
        _step(mode, model, 4, B)  # its gradient picks B
        assert _selection(mode) == B
        device_a = {n: model.get_parameter(n).detach()[:, A[n]].clone() for n in SPLIT}
        _wait_cpu(mode)  # window 2's result: the master and moments window 3's step starts from
        master, m, v = store.master.clone(), store.exp_avg.clone(), store.exp_avg_sq.clone()
        r2 = {n: store.shaped(master, i) for i, n in enumerate(SPLIT)}
        window3 = [_step(mode, model, 5, B), _step(mode, model, 6, B)]
        for n in SPLIT:
            p = model.get_parameter(n).detach()
            assert torch.equal(p[:, A[n]], device_a[n]), n  # the device's value won the merge
            assert not torch.equal(r2[n][:, A[n]], device_a[n]), n  # (the CPU result differs)
            rest = _others(n, A[n] + B[n], p.shape[1])
            assert torch.equal(p[:, rest], r2[n][:, rest]), n
        # window 3's CPU step, by hand: from the master with A's device values written in
        ref = _CpuRef(mode)
        ref.master, ref.m, ref.v, ref.steps = master.clone(), m, v, 2
        for i, n in enumerate(SPLIT):
            store.shaped(ref.master, i)[:, A[n]] = device_a[n]
        r3 = ref.step(window3)
        _wait_cpu(mode)
        assert torch.equal(store.master, ref.master)
        _step(mode, model, 7, B)
        _step(mode, model, 8, B)
        for n in SPLIT:
            assert torch.equal(model.get_parameter(n).detach()[:, A[n]], r3[n][:, A[n]]), n


def test_warm_up_rounds_update_split_weights_synchronously_and_select_nothing() -> None:
    model = tiny_model()
    with _zenflow(model, update_interval=2, full_warm_up_rounds=1) as mode:
        ref = _CpuRef(mode)
        stats = StepStats()
        grads = _hot_grads(model, 1, A)
        mode.step(stats, LR, Gate.always(CPU))
        assert stats.synchronous and stats.applied_cpu_update
        assert mode.selection() == {} and mode.warm_left == 0
        expected = ref.step([grads])  # the step's own gradient, all columns, now
        for n in SPLIT:
            assert torch.equal(model.get_parameter(n).detach(), expected[n]), n
        _step(mode, model, 2, A)
        assert _selection(mode) == A


def test_skipped_steps_change_nothing_and_are_not_counted() -> None:
    """Skipped steps (non-finite gradients, the gate false) anywhere, the first step included: the
    weights, the selection and the window's count do not move, and the run ends bit for bit as the same
    run without them."""
    runs = []
    for skips in ((), (0, 2, 5)):
        model = tiny_model()
        with _zenflow(model, update_interval=2, select_interval=2) as mode:
            seed = 0
            for i in range(8 + len(skips)):  # 8 finite steps
                if i in skips:
                    before = [p.detach().clone() for p in model.parameters()]
                    state = (mode.started, mode.win_len, mode.window, mode.since_select)
                    _step(mode, model, 99, skip=True)
                    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
                    assert (mode.started, mode.win_len, mode.window, mode.since_select) == state
                    if i == 0:
                        assert mode.selection() == {}  # nothing selected: the next step selects afresh
                    continue
                seed += 1
                _step(mode, model, seed, A if seed < 4 else B)
            assert seed == 8
            mode.flush(StepStats(), LR)
            runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_reselection_every_select_interval_steps() -> None:
    model = tiny_model()
    with _zenflow(model, update_interval=2, select_interval=4) as mode:
        for step in range(1, 9):
            _step(mode, model, step)
            assert mode.reselections == step // 4, step


def test_epoch_reselection_follows_new_epoch_or_the_fallback() -> None:
    """ "epoch": without new_epoch() every ``select_interval_fallback`` steps; once the caller signals
    epochs, at the first boundary after each signal only."""
    model = tiny_model()
    with _zenflow(model, update_interval=2, select_interval="epoch", select_interval_fallback=6) as mode:
        for step in range(1, 7):
            _step(mode, model, step)
        assert mode.reselections == 1  # the fallback, at step 6
        _step(mode, model, 7)
        mode.new_epoch()
        _step(mode, model, 8)
        assert mode.reselections == 2  # the boundary after the signal
        for step in range(9, 21):
            _step(mode, model, step)
        assert mode.reselections == 2  # no fallback once epochs are signalled
        mode.new_epoch()
        _step(mode, model, 21)
        _step(mode, model, 22)
        assert mode.reselections == 3


def test_adaptive_windows_end_on_the_gradient_masses() -> None:
    """A window ends when its summed unselected squared gradient reaches the selected one's mean per
    step, or at ``max_update_interval`` steps."""
    model = tiny_model()
    with _zenflow(model, update_interval="adaptive", max_update_interval=3, select_interval=100) as mode:
        for step in range(1, 4):
            _hot_grads(model, step, A, rest=0.01)  # the unselected mass is negligible
            mode.step(StepStats(), LR, Gate.always(CPU))
            assert mode.window == (step // 3), step  # ends at max_update_interval
        _hot_grads(model, 4, A, rest=3.0)  # the unselected mass outweighs a step of the selected one
        mode.step(StepStats(), LR, Gate.always(CPU))
        assert mode.window == 2 and mode.win_len == 0


def test_consolidated_weights_are_the_flushed_ones() -> None:
    """At a boundary with a result in flight (after a reselection, so the merge keeps two selections):
    ``consolidated()`` and ``consolidated_one()`` give exactly the weights ``flush()`` then makes."""
    model = tiny_model()
    with _zenflow(model, update_interval=2, select_interval=4) as mode:
        for step in range(1, 5):
            _step(mode, model, step, A if step < 4 else B)
        assert mode.pending is not None and mode.win_len == 0
        out = mode.consolidated()
        one = mode.consolidated_one("0.weight")
        mode.flush(StepStats(), LR)
        for n, p in model.named_parameters():
            assert torch.equal(out[n], p.detach()), n
        assert torch.equal(one, out["0.weight"])


def test_state_dict_round_trip_continues_bit_for_bit() -> None:
    """Saved mid-window with a CPU result in flight and a stash pending (after a reselection), loaded into
    a mode over another model's weights, the run continues exactly as the original."""
    a_model, b_model = tiny_model(), tiny_model(seed=5)
    kw = {"update_interval": 2, "select_interval": 4}
    with _zenflow(a_model, **kw) as a, _zenflow(b_model, **kw) as b:
        for step in range(1, 6):
            _step(a, a_model, step, A if step < 4 else B)
        assert a.pending is not None and a.win_len == 1 and a.handover.stash_groups
        b.load_state_dict(a.state_dict())
        assert _selection(b) == _selection(a) == B
        for step in range(6, 10):
            for mode, model in ((a, a_model), (b, b_model)):
                _step(mode, model, step, A if step > 7 else B)
        for mode in (a, b):
            mode.flush(StepStats(), LR)
        for (n, pa), pb in zip(a_model.named_parameters(), b_model.parameters(), strict=True):
            assert torch.equal(pa.detach(), pb.detach()), n
