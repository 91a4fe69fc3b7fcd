"""Lean host moments in the engine (issue 36, item 2, ``host_moments="bf16"``): the host stores hold bf16
moments beside the fp32 master, the memory formula counts them, checkpoints (torch.save and the streamed
format) continue bit for bit, and a resume across the setting converts the moments.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from offload.config import EngineConfig
from offload.engine import ZenFlowEngine
from offload.memory import engine_memory
from offload.state_io import join_tensors, read_safetensors, split_tensors, write_safetensors
from tests.offload.test_engine import HYPER, _mlp, _train_step, _zen_cfg


def _lean_cfgs() -> list[EngineConfig]:
    return [
        _zen_cfg(host_moments="bf16", update_interval=3, select_interval=3, full_warm_up_rounds=2),
        EngineConfig(mode="offload", host_moments="bf16", **HYPER),
    ]


@pytest.mark.parametrize("cfg", _lean_cfgs(), ids=["zenflow", "offload"])
def test_host_moments_are_bf16_and_counted_by_the_formula(cfg):
    model = _mlp()
    shapes = [tuple(p.shape) for p in model.parameters()]
    want = engine_memory(shapes, torch.float32, cfg, device_type="cpu")
    fp32 = engine_memory(
        shapes, torch.float32, cfg.model_copy(update={"host_moments": "fp32"}), device_type="cpu"
    )
    with ZenFlowEngine(model, cfg) as eng:
        stores = [s for s, _ in eng._mode.groups] if cfg.mode == "offload" else eng._mode.layout.stores
        assert {s.exp_avg.dtype for s in stores} == {s.exp_avg_sq.dtype for s in stores} == {torch.bfloat16}
        for i in range(6):
            _train_step(model, eng, i)
        assert eng.memory().host == want.host
    offloaded = want.host["master"] // 4
    assert want.host["exp_avg"] == want.host["exp_avg_sq"] == 2 * offloaded
    assert fp32.host_bytes - want.host_bytes == 4 * offloaded
    for p in model.parameters():
        assert torch.isfinite(p).all()


def _streamed(sd: dict, tmp: Path) -> dict:
    """``sd`` through the streamed checkpoint format (offload.state_io) and back."""
    skeleton, tensors = split_tensors(sd)
    write_safetensors(tmp / "state.safetensors", tensors)
    return join_tensors(skeleton, read_safetensors(tmp / "state.safetensors"))


@pytest.mark.parametrize("cfg", _lean_cfgs(), ids=["zenflow", "offload"])
@pytest.mark.parametrize("via", ["torch.save", "state_io"])
def test_checkpoint_round_trip_continues_bit_for_bit(cfg, via, tmp_path):
    total, cut = 13, 7
    model = _mlp()
    with ZenFlowEngine(model, cfg) as eng:
        for i in range(cut):
            _train_step(model, eng, i)
        if via == "torch.save":
            buf = io.BytesIO()
            torch.save(eng.state_dict(), buf)
            buf.seek(0)
            saved = torch.load(buf)
        else:
            saved = _streamed(eng.state_dict(), tmp_path)
        for i in range(cut, total):
            _train_step(model, eng, i)
        eng.flush()
    restored = _mlp(seed=123)
    with ZenFlowEngine(restored, cfg) as eng2:
        eng2.load_state_dict(saved)
        for i in range(cut, total):
            _train_step(restored, eng2, i)
        eng2.flush()
    for a, b in zip(restored.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def _host_states(eng: ZenFlowEngine) -> list[dict]:
    return [s.state_dict(None) for s in eng._mode.layout.stores]


@pytest.mark.parametrize(("saved", "resumed"), [("bf16", "fp32"), ("fp32", "bf16")])
def test_resume_across_the_setting_converts_the_moments(saved, resumed):
    cut = 7
    model = _mlp()
    with ZenFlowEngine(model, _zen_cfg(host_moments=saved)) as eng:
        for i in range(cut):
            _train_step(model, eng, i)
        sd = eng.state_dict()
        before = _host_states(eng)
    restored = _mlp(seed=123)
    with ZenFlowEngine(restored, _zen_cfg(host_moments=resumed)) as eng2:
        eng2.load_state_dict(sd)
        after = _host_states(eng2)
        want = torch.bfloat16 if resumed == "bf16" else torch.float32
        for a, b in zip(before, after, strict=True):
            assert torch.equal(a["master"], b["master"])
            for key in ("exp_avg", "exp_avg_sq"):
                assert b[key].dtype == want
                # bf16 -> fp32 exactly; fp32 -> bf16 rounded to nearest even, once
                assert torch.equal(b[key], a[key].to(want))
        for i in range(cut, cut + 4):
            _train_step(restored, eng2, i)
        eng2.flush()
    assert all(torch.isfinite(p).all() for p in restored.parameters())


def test_shards_of_bf16_moments_recut_into_one_store() -> None:
    """Resuming with another number of ranks: two ranks' bf16 host states loaded into one store (and its
    fp32 counterpart, converted) hold the same moments, element by element."""
    from offload.device import HostAllocator
    from offload.host import HostStore

    params = [torch.randn(30, 7), torch.randn(11)]
    alloc = HostAllocator(pin=False)
    shards = [HostStore(params, alloc, buffers=1, shard=(r, 2), moments=torch.bfloat16) for r in range(2)]
    for k, s in enumerate(shards):
        s.exp_avg.copy_(torch.randn(s.numel) + k)
        s.exp_avg_sq.copy_(torch.rand(s.numel))
    sds = [s.state_dict(None) for s in shards]
    for moments in (torch.bfloat16, torch.float32):
        whole = HostStore(params, alloc, buffers=1, moments=moments)
        whole.load_shards(sds)
        for key in ("exp_avg", "exp_avg_sq"):
            want = torch.cat([sd[key] for sd in sds])[: whole.numel]
            assert getattr(whole, key).dtype == moments and torch.equal(getattr(whole, key), want.to(moments))
