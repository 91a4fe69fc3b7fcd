"""zenflow's reselection handover (only the dropped columns' values leave the device) and the
``landing_buffers`` switch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from offload.config import EngineConfig
from offload.engine import ZenFlowEngine
from offload.zenflow.handover import Handover


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reselection_copies_only_the_dropped_columns(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """The bytes copied off the device for the CPU master are exactly 4 per row of each dropped column
    (before: the whole old selection, dropped or kept), and the CPU master takes those values."""
    copied: list[int] = []
    real = Handover._copy_off

    def counting(self: Handover, pairs: list[tuple[torch.Tensor, torch.Tensor]], ready: Any) -> None:
        copied.append(sum(src.numel() * src.element_size() for _, src in pairs))
        real(self, pairs, ready)

    monkeypatch.setattr(Handover, "_copy_off", counting)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4)).to(dtype)
    cfg = EngineConfig(
        mode="zenflow",
        lr=1e-2,
        bind_worker_cores=False,
        cpu_threads=1,
        topk_ratio=0.25,
        update_interval=2,
        select_interval=2,
        full_warm_up_rounds=0,
    )
    rows = {n: p.shape[0] for n, p in model.named_parameters()}
    expected, reselections = 0, 0
    g = torch.Generator().manual_seed(1)
    with ZenFlowEngine(model, cfg) as engine:
        mode: Any = engine._mode
        before: dict[str, torch.Tensor] = {}
        for _ in range(16):
            x = torch.randn(8, 16, generator=g).to(dtype)
            model(x).float().pow(2).mean().backward()
            engine.step()
            engine.zero_grad()
            after = mode.selection()
            if before and any(not torch.equal(before[n], after[n]) for n in after):
                reselections += 1
                for n, cols in after.items():
                    dropped = len(set(before[n].tolist()) - set(cols.tolist()))
                    expected += 4 * rows[n] * dropped
            before = after
        stashed = [(st, st.values.clone()) for st in mode.handover.stash_groups]
        engine.flush()
        for st, values in stashed:  # the flush wrote the last stash's dropped columns into the master
            n = len(st.names)
            counts = st.meta[:n].tolist()
            for j, name in enumerate(st.names):
                s = mode.layout.by_name[name]
                master = s.store.shaped(s.store.master, s.index)
                cols = st.meta[n:].view(n, -1)[j, : counts[j]]
                assert torch.equal(master[:, cols], values[j, : counts[j]].t()), name
    assert reselections >= 3
    assert sum(copied) == expected > 0
    k_bytes = sum(4 * rows[n] * len(c) for n, c in before.items())
    assert sum(copied) < reselections * k_bytes  # less than every old column every time


def test_landing_buffers_off_drops_their_device_bytes() -> None:
    """The plan's formula counts the landing buffers on CUDA only with ``landing_buffers`` (2 B per
    split element in bf16); the field is validated (a string is no switch)."""
    from pydantic import ValidationError

    from offload.memory import engine_memory

    shapes = [(64, 32), (32,), (16, 64)]
    split = 64 * 32 + 16 * 64
    on = engine_memory(shapes, torch.bfloat16, EngineConfig(mode="zenflow"), device_type="cuda")
    off = engine_memory(
        shapes, torch.bfloat16, EngineConfig(mode="zenflow", landing_buffers=False), device_type="cuda"
    )
    assert on.device_buffers["landing"] == 2 * split
    assert off.device_buffers["landing"] == 0
    assert on.device_buffer_bytes - off.device_buffer_bytes == 2 * split
    assert on.host == off.host
    with pytest.raises(ValidationError, match="landing_buffers"):
        EngineConfig(landing_buffers="sometimes")  # type: ignore[arg-type]
