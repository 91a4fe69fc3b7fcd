"""ZenFlow engine: selection, selective AdamW, mode equivalences, staleness, resume, lifecycle."""

from __future__ import annotations

import gc
import io
import itertools
import threading

import pytest
import torch
from pydantic import ValidationError

from offload.config import EngineConfig
from offload.cpu_thread import CPUThreadError
from offload.engine import ZenFlowEngine
from offload.selection import column_scores, num_selected
from offload.zenflow.adamw import AdamWHyper
from offload.zenflow.selective_adamw import SelectiveAdamW

HYPER = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def _mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(20, 12),
        torch.nn.Linear(12, 24),
        torch.nn.GELU(),
        torch.nn.LayerNorm(24),
        torch.nn.Linear(24, 20),
    ).to(dtype)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randint(0, 20, (16,), generator=g)
    return x, (x * 7 + 3) % 20


def _train_step(model: torch.nn.Module, engine: ZenFlowEngine, i: int):
    x, y = _batch(i)
    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    m = engine.step()
    engine.zero_grad()
    return m


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _run(cfg: EngineConfig, steps: int, seed: int = 0) -> tuple[torch.nn.Module, list]:
    model = _mlp(seed)
    with ZenFlowEngine(model, cfg) as eng:
        metrics = [_train_step(model, eng, i) for i in range(steps)]
    return model, metrics


# --- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"topk_ratio": 0}, "topk_ratio"),
        ({"topk_ratio": 1.5}, "topk_ratio"),
        ({"update_interval": 0}, "update_interval"),
        ({"update_interval": True}, "update_interval"),
        ({"update_interval": 8, "select_interval": 4}, "select_interval"),
        ({"mode": "gpu"}, "mode"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"lr": -1}, "lr"),
        ({"cpu_optimizer_cores_ratio": 0}, "cpu_optimizer_cores_ratio"),
        ({"unknown_knob": 1}, "unknown_knob"),
    ],
)
def test_config_rejects_bad_values_with_field_name(kwargs, field):
    with pytest.raises(ValidationError) as err:
        EngineConfig(**kwargs)
    assert field in str(err.value)


# --- selection ------------------------------------------------------------------------------------
def test_column_selection_picks_largest_gradient_columns():
    g = torch.zeros(5, 10)
    g[:, 7] = 3.0
    g[:, 2] = -2.0
    g[0, 9] = 1.5
    g[:, 4] = 0.1
    scores = column_scores(g)
    assert scores[7].item() == 15.0
    assert sorted(torch.topk(scores, 3).indices.tolist()) == [2, 7, 9]  # what a selection takes
    assert num_selected(10, 0.25) == 3 and num_selected(8, 0.25) == 2 and num_selected(3, 0.01) == 1


def test_engine_selects_only_2d_weights_and_keeps_topk():
    model = _mlp()
    cfg = EngineConfig(mode="zenflow", topk_ratio=0.25, update_interval=2, select_interval=2, **HYPER)
    with ZenFlowEngine(model, cfg) as eng:
        _train_step(model, eng, 0)
        sel = eng.selection()
    names = dict(model.named_parameters())
    assert set(sel) == {"0.weight", "1.weight", "4.weight"}  # 1-D params (biases, LayerNorm) never split
    for n, cols in sel.items():
        assert cols.numel() == num_selected(names[n].shape[1], 0.25)
        assert torch.equal(cols, cols.sort().values)


# --- selective AdamW --------------------------------------------------------------------------------
def test_selective_adamw_with_all_columns_equals_torch_adamw():
    """Columns (all selected) update bitwise like torch's single-tensor AdamW, whole tensors like its
    fused AdamW (the kernel they run)."""
    torch.manual_seed(0)
    w0, b0 = torch.randn(6, 9), torch.randn(6)
    ref_w, ref_b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    ref = torch.optim.AdamW([ref_w], foreach=False, **HYPER)
    ref_fused = torch.optim.AdamW([ref_b], fused=True, **HYPER)
    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    opt = SelectiveAdamW(AdamWHyper(HYPER["lr"], 0.9, 0.999, HYPER["eps"], HYPER["weight_decay"]))
    opt.add_columns("w", w, torch.arange(9))
    opt.add_full("b", b)
    gen = torch.Generator().manual_seed(1)
    for _ in range(7):
        gw, gb = torch.randn(6, 9, generator=gen), torch.randn(6, generator=gen)
        ref_w.grad, ref_b.grad, w.grad, b.grad = gw.clone(), gb.clone(), gw.clone(), gb.clone()
        ref.step()
        ref_fused.step()
        opt.step()
    assert torch.equal(w.detach(), ref_w.detach())
    assert torch.equal(b.detach(), ref_b.detach())
    # moments (6x9 + 6, two each), the column index and per-column step counts (int64), b's step (fp32)
    assert opt.state_bytes() == (6 * 9 * 2 + 6 * 2) * 4 + 9 * 8 + 9 * 8 + 4


def test_selective_adamw_reselect_keeps_overlap_and_zeroes_new_columns():
    w = torch.nn.Parameter(torch.randn(4, 6))
    opt = SelectiveAdamW(AdamWHyper(1e-2, 0.9, 0.999, 1e-8, 0.0))
    opt.add_columns("w", w, torch.tensor([1, 3]))
    before = w.detach().clone()
    for _ in range(3):
        w.grad = torch.randn(4, 6)
        opt.step()
    untouched = [0, 2, 4, 5]
    assert torch.equal(w.detach()[:, untouched], before[:, untouched])  # only selected columns move
    grp, j = opt._where["w"]
    m3 = grp.exp_avg[j][:, 1].clone()
    w.grad = torch.randn(4, 6) * torch.tensor([1.0, 1.0, 1.0, 50.0, 1.0, 60.0])  # columns 3, 5 dominate
    (d,) = opt.reselect()
    assert opt.columns("w").tolist() == [3, 5]
    assert d.cols[0].tolist() == [1, 3] and d.mask[0].tolist() == [True, False]  # column 1 dropped
    assert torch.equal(d.values[0][:, 0], w.detach()[:, 1])
    grp, j = opt._where["w"]
    assert torch.equal(grp.exp_avg[j][:, 0], m3)  # column 3 carried over
    assert torch.count_nonzero(grp.exp_avg[j][:, 1]) == 0  # column 5 starts from zero
    assert grp.steps[j].tolist() == [3, 0]
    # mixed step counts: each column updates bitwise like torch's single-tensor AdamW at its own step
    from offload.zenflow.adamw import adamw_

    w.grad = torch.randn(4, 6)
    expect = w.detach().index_select(1, torch.tensor([3, 5])).clone()
    m_ref, v_ref = grp.exp_avg[j].clone(), grp.exp_avg_sq[j].clone()
    g_sel = w.grad.index_select(1, torch.tensor([3, 5]))
    for c, step in enumerate([4, 1]):
        col = expect[:, c : c + 1].clone()
        mj, vj = m_ref[:, c : c + 1].clone(), v_ref[:, c : c + 1].clone()
        adamw_(col, g_sel[:, c : c + 1], mj, vj, step, opt.hyper)
        expect[:, c : c + 1] = col
    opt.step()
    assert grp.steps[j].tolist() == [4, 1]
    assert torch.equal(w.detach()[:, [3, 5]], expect)


# --- mode equivalences ------------------------------------------------------------------------------
def test_zenflow_full_ratio_interval_one_equals_device_adamw():
    # max_grad_norm small enough that clipping is active on every step
    dev, dm = _run(EngineConfig(mode="device", max_grad_norm=0.05, **HYPER), 15)
    zen, zm = _run(  # no core placement: it would give forward/backward fewer threads than device mode's
        EngineConfig(
            mode="zenflow",
            topk_ratio=1.0,
            update_interval=1,
            select_interval=1,
            max_grad_norm=0.05,
            bind_worker_cores=False,
            **HYPER,
        ),
        15,
    )
    assert all(m.grad_norm > 0.05 for m in dm)
    for a, b in zip(zen.parameters(), dev.parameters(), strict=True):
        assert torch.equal(a, b)
    assert zm[-1].device_optimizer_state_bytes == dm[-1].device_optimizer_state_bytes


def test_offload_matches_device_adamw():
    dev, dm = _run(EngineConfig(mode="device", **HYPER), 10)
    off, om = _run(EngineConfig(mode="offload", **HYPER), 10)
    for a, b in zip(off.parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    n = sum(p.numel() for p in dev.parameters())
    n_tensors = len(list(dev.parameters()))
    assert dm[-1].device_optimizer_state_bytes == 8 * n + 4 * n_tensors  # moments + fused step counts
    assert om[-1].device_optimizer_state_bytes == 0
    assert om[-1].bytes_device_to_host == 4 * n and om[-1].bytes_host_to_device == 4 * n
    assert all(m.synchronous and m.applied_cpu_update for m in om)


def test_zenflow_holds_less_device_state_than_device_mode():
    _, dm = _run(EngineConfig(mode="device", **HYPER), 3)
    _, zm = _run(
        EngineConfig(mode="zenflow", topk_ratio=0.25, update_interval=2, select_interval=2, **HYPER), 3
    )
    assert 0 < zm[-1].device_optimizer_state_bytes < 0.5 * dm[-1].device_optimizer_state_bytes
    for m in zm:
        assert 0 <= m.stall_seconds <= m.wall_seconds
        assert m.compute_seconds == pytest.approx(m.wall_seconds - m.stall_seconds)
        assert m.bytes_device_to_host > 0


# --- staleness --------------------------------------------------------------------------------------
def _adamw_ref(p, g, m, v, step, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / (1 - b2**step) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1**step))


@pytest.mark.parametrize(
    ("accumulate_on", "scale_cpu_lr"), [("host", True), ("device", True), ("host", False)]
)
def test_unselected_columns_are_exactly_one_window_stale(accumulate_on, scale_cpu_lr):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 6, bias=False)
    w0 = lin.weight.detach().clone()
    interval, lr, wd = 3, 0.05, 0.01
    cfg = EngineConfig(
        mode="zenflow",
        topk_ratio=0.25,
        update_interval=interval,
        select_interval=10**5,
        max_grad_norm=None,
        lr=lr,
        weight_decay=wd,
        accumulate_on=accumulate_on,
        scale_cpu_lr=scale_cpu_lr,
    )
    grads, values = [], []
    with ZenFlowEngine(lin, cfg) as eng:
        for i in range(5 * interval):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            lin(x).square().mean().backward()
            grads.append(lin.weight.grad.clone())
            eng.step()
            eng.zero_grad()
            values.append(lin.weight.detach().clone())
        sel = eng.selection()["weight"]
    unsel = torch.tensor([c for c in range(8) if c not in set(sel.tolist())])
    # Reference: CPU AdamW on each window's mean gradient, one step per window.
    master, m, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    results = []
    for win in range(5):
        g = torch.stack(grads[win * interval : (win + 1) * interval]).mean(0)
        _adamw_ref(master, g, m, v, win + 1, lr * interval if scale_cpu_lr else lr, wd)
        results.append(master.clone())
    for t, val in enumerate(values, start=1):
        done = t // interval  # completed windows
        expect = w0 if done < 2 else results[done - 2]  # window w's result lands at the end of window w+1
        torch.testing.assert_close(val[:, unsel], expect[:, unsel], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(results[0][:, unsel], results[1][:, unsel])  # the check can tell windows apart
    for a, b in itertools.pairwise(values):
        assert not torch.equal(a[:, sel], b[:, sel])  # selected columns move every step


def test_without_overlap_the_window_update_lands_at_its_own_boundary():
    """overlap_step=False: the CPU step of window w runs at its end and is applied at once."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 6, bias=False)
    w0 = lin.weight.detach().clone()
    interval, lr = 3, 0.05
    cfg = EngineConfig(
        mode="zenflow",
        topk_ratio=0.25,
        update_interval=interval,
        select_interval=10**5,
        max_grad_norm=None,
        lr=lr,
        weight_decay=0.0,
        overlap_step=False,
        scale_cpu_lr=False,
    )
    grads, values = [], []
    with ZenFlowEngine(lin, cfg) as eng:
        for i in range(4 * interval):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            lin(x).square().mean().backward()
            grads.append(lin.weight.grad.clone())
            m = eng.step()
            eng.zero_grad()
            values.append(lin.weight.detach().clone())
            assert m.applied_cpu_update == ((i + 1) % interval == 0)
        sel = eng.selection()["weight"]
    unsel = torch.tensor([c for c in range(8) if c not in set(sel.tolist())])
    master, mo, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    for win in range(4):
        _adamw_ref(
            master, torch.stack(grads[win * interval : (win + 1) * interval]).mean(0), mo, v, win + 1, lr, 0.0
        )
        torch.testing.assert_close(
            values[(win + 1) * interval - 1][:, unsel], master[:, unsel], atol=1e-6, rtol=1e-6
        )


def test_cpu_step_uses_the_windows_summed_lr_under_a_schedule():
    """With scale_cpu_lr the CPU's once-per-window step uses the lr summed over the window's steps, not
    the boundary's lr times the window length (which overshoots while the lr warms up)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 6, bias=False)
    w0 = lin.weight.detach().clone()
    interval, windows = 3, 4
    lrs = [0.01 * (t + 1) for t in range(interval * windows)]  # a warm-up ramp
    cfg = EngineConfig(
        mode="zenflow",
        topk_ratio=0.25,
        update_interval=interval,
        select_interval=10**5,
        max_grad_norm=None,
        lr=lrs[0],
        weight_decay=0.0,
        scale_cpu_lr=True,
    )
    grads = []
    with ZenFlowEngine(lin, cfg) as eng:
        for t, lr in enumerate(lrs):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t))
            lin(x).square().mean().backward()
            grads.append(lin.weight.grad.clone())
            eng.set_lr(lr)
            eng.step()
            eng.zero_grad()
        eng.flush()
        sel = set(eng.selection()["weight"].tolist())
    unsel = torch.tensor([c for c in range(8) if c not in sel])
    master, m, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    for win in range(windows):
        part = slice(win * interval, (win + 1) * interval)
        _adamw_ref(master, torch.stack(grads[part]).mean(0), m, v, win + 1, sum(lrs[part]), 0.0)
    torch.testing.assert_close(lin.weight.detach()[:, unsel], master[:, unsel], atol=1e-6, rtol=1e-6)


def test_device_accumulation_matches_host_accumulation():
    host, hm = _run(_zen_cfg(update_interval=3, select_interval=3), 14)
    dev, dm = _run(_zen_cfg(update_interval=3, select_interval=3, accumulate_on="device"), 14)
    for a, b in zip(host.parameters(), dev.parameters(), strict=True):
        assert torch.equal(a, b)
    # host accumulation copies every step's gradient, device accumulation one sum per window
    assert sum(m.bytes_device_to_host for m in dm) < 0.5 * sum(m.bytes_device_to_host for m in hm)
    assert dm[-1].device_buffer_bytes > 0 == hm[-1].device_buffer_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_accumulation_is_the_fp32_sum_rounded_once_per_step(dtype):
    """The window accumulator is in the parameters' dtype, fp32 for fp16 (offload.memory): each step
    adds in fp32 and rounds once, so fp32 and fp16 parameters get the fp32 sum exactly."""
    import offload.host as host
    from offload.device import HostAllocator

    params = [torch.zeros(5, 4, dtype=dtype), torch.zeros(3, dtype=dtype)]
    store = host.HostStore(params, HostAllocator(pin=False), buffers=1, role="accumulators")
    acc_dtype = torch.float32 if dtype == torch.float16 else dtype
    assert store.bufs[0].dtype == acc_dtype
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(store.numel, generator=gen).to(dtype) for _ in range(3)]
    ref = torch.zeros(store.numel)
    for i, g in enumerate(grads):
        store.accumulate(store.bufs[0], g, alpha=1 / 3, first=i == 0)
        ref = (g.float() * (1 / 3) if i == 0 else ref.add(g.float(), alpha=1 / 3)).to(acc_dtype).float()
    assert torch.equal(store.bufs[0].float(), ref)


# --- consistency invariants ---------------------------------------------------------------------------
def _zen_cfg(**kw) -> EngineConfig:
    base = {"mode": "zenflow", "topk_ratio": 0.25, "update_interval": 2, "select_interval": 2, **HYPER}
    base.update(kw)
    return EngineConfig(**base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flush_leaves_cpu_master_equal_to_device_outside_selection(dtype):
    model = _mlp(dtype=dtype)
    with ZenFlowEngine(model, _zen_cfg()) as eng:
        for i in range(9):  # reselecting every window, ends mid-window
            _train_step(model, eng, i)
        eng.flush()
        mode = eng._mode
        sel = eng.selection()
        assert mode.pending is None and not mode.handover.stash
        for s in mode.splits:
            cols = torch.tensor([c for c in range(s.param.shape[1]) if c not in set(sel[s.name].tolist())])
            master = s.store.shaped(s.store.master, s.index)
            assert torch.equal(s.param.detach()[:, cols], master[:, cols].to(dtype))
        for p in model.parameters():
            assert torch.isfinite(p.float()).all()


def test_consolidated_state_dict_is_newest_and_leaves_trajectory_alone():
    plain, _ = _run(_zen_cfg(), 11)
    model = _mlp()
    with ZenFlowEngine(model, _zen_cfg()) as eng:
        for i in range(11):
            _train_step(model, eng, i)
            snap = eng.consolidated_state_dict()
            assert set(snap) == {n for n, _ in model.named_parameters()}
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(a, b)
        _train_step(model, eng, 11)  # step 12 ends a window: a result is pending, nothing partial
        snap = eng.consolidated_state_dict()
        assert any(not torch.equal(snap[n], p.detach()) for n, p in model.named_parameters())
        eng.flush()
        for n, p in model.named_parameters():
            assert torch.equal(snap[n], p.detach())


# --- resume --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg",
    [
        _zen_cfg(update_interval=3, select_interval=3, full_warm_up_rounds=2),
        _zen_cfg(update_interval="adaptive", max_update_interval=3, select_interval=4),
        _zen_cfg(overlap_step=False),
        _zen_cfg(accumulate_on="device", full_warm_up_rounds=1),
        EngineConfig(mode="device", **HYPER),
        EngineConfig(mode="offload", **HYPER),
    ],
    ids=["zenflow", "zenflow-auto", "zenflow-no-overlap", "zenflow-device-acc", "device", "offload"],
)
def test_state_dict_round_trip_continues_identically(cfg):
    total, cut = 17, 8  # the cut falls mid-window with a CPU result pending
    model = _mlp()
    with ZenFlowEngine(model, cfg) as eng:
        for i in range(cut):
            _train_step(model, eng, i)
        buf = io.BytesIO()
        torch.save(eng.state_dict(), buf)
        for i in range(cut, total):
            _train_step(model, eng, i)
        eng.flush()
    buf.seek(0)
    restored = _mlp(seed=123)  # different initial weights: everything must come from the state
    with ZenFlowEngine(restored, cfg) as eng2:
        eng2.load_state_dict(torch.load(buf))
        assert eng2.global_step == cut
        for i in range(cut, total):
            _train_step(restored, eng2, i)
        eng2.flush()
    for a, b in zip(restored.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_state_dict_rejects_other_mode():
    model = _mlp()
    with ZenFlowEngine(model, EngineConfig(mode="device", **HYPER)) as eng:
        sd = eng.state_dict()
    with ZenFlowEngine(_mlp(), _zen_cfg()) as eng2, pytest.raises(ValueError, match="mode"):
        eng2.load_state_dict(sd)


def test_dropped_columns_keep_their_device_value_until_the_cpu_takes_over():
    """A column dropped at a reselection was the device's: the CPU result merged at the next boundary
    (computed from the CPU master's stale copy of it) must not overwrite it. It stays put through
    that merge, and only the window after (CPU master := the device value) moves it again."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4, bias=False)
    cfg = _zen_cfg(
        topk_ratio=0.25, update_interval=2, select_interval=2, max_grad_norm=None, weight_decay=0.0
    )
    values, sels = [], []
    with ZenFlowEngine(lin, cfg) as eng:
        for i in range(10):
            scale = torch.ones(8)
            scale[[0, 1] if i < 3 else [6, 7]] = 30.0  # the dominant columns switch in step 4
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) * scale
            lin(x).square().mean().backward()
            eng.step()
            eng.zero_grad()
            values.append(lin.weight.detach().clone())
            sels.append(eng.selection()["weight"].tolist())
    assert sels[2] == [0, 1] and sels[3] == [6, 7]  # reselected at the boundary ending window 2 (step 4)
    dropped = [0, 1]
    at_drop = values[3][:, dropped]
    for t in (4, 5):  # window 3, and its boundary: R_2 lands, but the device value wins for columns 0, 1
        torch.testing.assert_close(values[t][:, dropped], at_drop, atol=0, rtol=0)
    assert not torch.equal(values[7][:, dropped], at_drop)  # R_3 (from the device value) lands at step 8


# --- auto window and epochs -----------------------------------------------------------------------------
def _scaled_linear_run(big: float, steps: int, **cfg_kw) -> ZenFlowEngine:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4, bias=False)
    scale = torch.ones(8)
    scale[:2] = big  # input channels 0, 1 dominate the column gradient norms
    eng = ZenFlowEngine(lin, _zen_cfg(**cfg_kw))
    for i in range(steps):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) * scale
        lin(x).square().mean().backward()
        eng.step()
        eng.zero_grad()
    return eng


def test_auto_update_interval_follows_gradient_mass():
    kw = {
        "update_interval": "adaptive",
        "max_update_interval": 5,
        "select_interval": "epoch",
        "max_grad_norm": None,
    }
    with _scaled_linear_run(30.0, 20, **kw) as skewed:
        assert skewed.selection()["weight"].tolist() == [0, 1]
        assert skewed._mode.window == 4  # unselected mass tiny: every window runs to the bound
    with _scaled_linear_run(1.0, 20, **kw) as flat:
        assert flat._mode.window >= 16  # unselected mass (6 of 8 columns) mostly outweighs: ~1-step windows


def test_select_interval_auto_reselects_on_new_epoch():
    model = _mlp()
    cfg = _zen_cfg(select_interval="epoch", select_interval_fallback=10**5)
    with ZenFlowEngine(model, cfg) as eng:
        for i in range(4):
            _train_step(model, eng, i)
        assert eng._mode.since_select == 4  # no epoch signal: no reselection
        eng.new_epoch()
        for i in range(4, 6):
            _train_step(model, eng, i)
        assert eng._mode.since_select == 0 and not eng._mode.epoch_flag


# --- lifecycle ---------------------------------------------------------------------------------------------
def test_no_thread_leak_with_context_manager_and_del():
    before = threading.active_count()
    _run(_zen_cfg(), 5)
    assert threading.active_count() == before
    model = _mlp()
    eng = ZenFlowEngine(model, _zen_cfg())
    _train_step(model, eng, 0)
    assert threading.active_count() == before + 1
    worker = eng._mode.cpu_thread
    del eng
    gc.collect()
    worker._thread.join(5)
    assert threading.active_count() == before
    eng = ZenFlowEngine(_mlp(), _zen_cfg())
    eng.close()
    eng.close()  # idempotent
    assert threading.active_count() == before


def test_worker_crash_surfaces_in_training_thread(monkeypatch):
    import offload.host as host

    def boom():
        def fail(*args, **kwargs):
            raise RuntimeError("boom in CPU adam")

        return fail

    before = threading.active_count()
    model = _mlp()
    with ZenFlowEngine(model, _zen_cfg()) as eng:
        monkeypatch.setattr(host, "_adam_step", boom)
        with pytest.raises(CPUThreadError) as err:
            for i in range(6):
                _train_step(model, eng, i)
        assert isinstance(err.value.__cause__, RuntimeError)
        assert "boom in CPU adam" in str(err.value.__cause__)
        assert err.value.__cause__.__traceback__ is not None
        with pytest.raises(CPUThreadError):
            eng.flush()
    assert threading.active_count() == before
