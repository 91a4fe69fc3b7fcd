"""Bad gradients are skipped in every mode and part; fp16 training with dynamic loss scaling."""

from __future__ import annotations

import io
import itertools
import math
from typing import Any

import pytest
import torch

from offload.config import EngineConfig
from offload.engine import ZenFlowEngine
from tests.offload.test_engine import HYPER, _mlp


def _loss(model: torch.nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randint(0, 20, (16,), generator=g)
    return torch.nn.functional.cross_entropy(model(x).float(), (x * 7 + 3) % 20)


def _poison(model: torch.nn.Module, kind: str) -> None:
    """Make this step's global gradient norm non-finite."""
    w = model[1].weight.grad
    if kind == "nan":
        w[0, 0] = float("nan")
    elif kind == "inf":
        w[3, 1] = float("-inf")
    else:  # every element finite, the norm overflows fp32
        w.fill_(3e38)


def _same(a: Any, b: Any, path: str = "") -> None:
    """Recursive equality of two engine states (tensors bitwise); wall-clock fields ignored."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            if k not in ("seconds", "step"):
                _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, path


def _zen(**kw: Any) -> EngineConfig:
    base = {"mode": "zenflow", "topk_ratio": 0.25, "update_interval": 2, "select_interval": 2, **HYPER}
    return EngineConfig(**{**base, **kw})


CONFIGS = {
    "device": EngineConfig(mode="device", **HYPER),
    "offload": EngineConfig(mode="offload", **HYPER),
    "zenflow": _zen(),
    "zenflow-device-acc": _zen(accumulate_on="device"),
    "zenflow-auto": _zen(update_interval="adaptive", max_update_interval=3, select_interval=3),
    "zenflow-warm-up": _zen(full_warm_up_rounds=2),
    "zenflow-no-overlap": _zen(overlap_step=False, update_interval=3, select_interval=3),
}
# Bad steps before good steps 0 (the first step: zenflow's first selection, a warm-up round), 3 (with
# update_interval 2: the step that would end a window) and 4 (the first step of a window).
BAD_BEFORE = (0, 3, 4)
GOOD = 9


@pytest.mark.parametrize("kind", ["nan", "inf", "overflow"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_bad_step_changes_nothing_and_the_next_good_step_proceeds(name: str, kind: str) -> None:
    cfg = CONFIGS[name]
    ref = _mlp()
    with ZenFlowEngine(ref, cfg) as eng:
        for i in range(GOOD):
            _loss(ref, i).backward()
            assert not eng.step().skipped
            eng.zero_grad()
        eng.flush()
        ref_state = eng.state_dict()["mode_state"]
    model = _mlp()
    with ZenFlowEngine(model, cfg) as eng:
        for i in range(GOOD):
            if i in BAD_BEFORE:
                before = eng.state_dict()["mode_state"]  # params, moments, accumulators, counters
                _loss(model, 100 + i).backward()
                _poison(model, kind)
                m = eng.step()
                eng.zero_grad()
                assert m.skipped and m.grad_norm is not None and not math.isfinite(m.grad_norm)
                assert not m.applied_cpu_update
                _same(eng.state_dict()["mode_state"], before)
            _loss(model, i).backward()
            m = eng.step()
            eng.zero_grad()
            assert not m.skipped and math.isfinite(m.grad_norm or 0.0)
        eng.flush()
        state = eng.state_dict()["mode_state"]
        assert eng.global_step == GOOD + len(BAD_BEFORE)  # every call is a step; the bad ones changed nothing
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    _same(state, ref_state)


def test_skipped_steps_do_not_count_towards_windows_or_selection() -> None:
    model = _mlp()
    cfg = _zen(update_interval=3, select_interval=6)
    with ZenFlowEngine(model, cfg) as eng:
        for i in range(5):
            _loss(model, i).backward()
            if i % 2:
                _poison(model, "nan")
            eng.step()
            eng.zero_grad()
        mode = eng._mode
        assert (mode.window, mode.win_len, mode.since_select) == (1, 0, 3)  # 3 good steps: one window


# --- fp16 ----------------------------------------------------------------------------------------------
def _train(dtype: torch.dtype, cfg: EngineConfig, steps: int) -> tuple[float, list[Any]]:
    model = _mlp(dtype=dtype)
    metrics = []
    with ZenFlowEngine(model, cfg) as eng:
        for i in range(steps):
            eng.scale_loss(_loss(model, i % 40)).backward()
            metrics.append(eng.step())
            eng.zero_grad()
        eng.flush()
    with torch.no_grad():
        held_out = sum(_loss(model, i).item() for i in range(40)) / 40
    return held_out, metrics


@pytest.mark.parametrize("mode", ["device", "zenflow"])
def test_fp16_training_with_loss_scaling_matches_fp32(mode: str) -> None:
    cfg = EngineConfig(mode=mode, **HYPER) if mode == "device" else _zen()
    fp32, m32 = _train(torch.float32, cfg, 30)
    fp16, m16 = _train(torch.float16, cfg, 30)
    assert all(m.loss_scale is None for m in m32)
    assert all(m.loss_scale == 2.0**16 for m in m16)  # the default initial scale, nothing overflowed
    assert fp16 < 0.5 * _train(torch.float32, cfg, 1)[0]  # it trained
    assert abs(fp16 - fp32) <= 0.02 * fp32


def test_loss_scale_backs_off_and_grows_like_grad_scaler() -> None:
    """From a scale that overflows fp16, the scale halves on every skipped step; after growth_interval
    finite steps in a row it doubles (torch.amp.GradScaler's rule, checked step by step)."""
    cfg = _zen(loss_scale_init=2.0**24, loss_scale_growth_interval=4)
    held_out, ms = _train(torch.float16, cfg, 40)
    scale, tracker = 2.0**24, 0
    for m in ms:
        assert m.loss_scale == scale
        if m.skipped:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == 4:
                scale, tracker = scale * 2.0, 0
    skipped = sum(m.skipped for m in ms)
    assert ms[0].skipped and 4 <= skipped < 20  # overflowed at first, then trained
    assert any(b.loss_scale > a.loss_scale for a, b in itertools.pairwise(ms))  # it grew too
    fp32, _ = _train(torch.float32, _zen(), 40 - skipped)
    assert abs(held_out - fp32) <= 0.05 * fp32


def test_loss_scale_is_part_of_the_engine_state() -> None:
    cfg = _zen(loss_scale_init=2.0**22, loss_scale_growth_interval=3)
    total, cut = 16, 7
    model = _mlp(dtype=torch.float16)
    with ZenFlowEngine(model, cfg) as eng:
        for i in range(cut):
            eng.scale_loss(_loss(model, i)).backward()
            eng.step()
            eng.zero_grad()
        scale = eng.loss_scale
        buf = io.BytesIO()
        torch.save(eng.state_dict(), buf)
        for i in range(cut, total):
            eng.scale_loss(_loss(model, i)).backward()
            eng.step()
            eng.zero_grad()
        eng.flush()
        final_scale = eng.loss_scale
    assert scale is not None and scale < 2.0**22  # it backed off before the cut
    buf.seek(0)
    restored = _mlp(seed=5, dtype=torch.float16)
    with ZenFlowEngine(restored, cfg) as eng2:
        eng2.load_state_dict(torch.load(buf))
        assert eng2.loss_scale == scale
        for i in range(cut, total):
            eng2.scale_loss(_loss(restored, i)).backward()
            eng2.step()
            eng2.zero_grad()
        eng2.flush()
        assert eng2.loss_scale == final_scale
    for a, b in zip(restored.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_loss_scaling_is_off_for_other_dtypes_unless_asked() -> None:
    with ZenFlowEngine(_mlp(dtype=torch.bfloat16), _zen()) as eng:
        loss = torch.tensor(2.0)
        assert eng.scale_loss(loss) is loss and eng.loss_scale is None
    with ZenFlowEngine(_mlp(), _zen(loss_scaling="dynamic", loss_scale_init=8.0)) as eng:
        assert float(eng.scale_loss(torch.tensor(2.0))) == 16.0 and eng.loss_scale == 8.0
    with ZenFlowEngine(_mlp(dtype=torch.float16), _zen(loss_scaling="off")) as eng:
        assert eng.loss_scale is None
