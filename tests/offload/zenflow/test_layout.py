"""offload.zenflow.layout: which weights are split (offload.memory.is_split), one host store per
parameter dtype holding them whole (fp32 master and moments per split element, the window accumulators
in the parameters' dtype, fp32 for fp16), its size against offload.memory's formula, and the device-side
buffers of each split weight."""

from __future__ import annotations

import pytest
import torch

from offload.memory import engine_memory, is_split, merged
from offload.selection import num_selected
from tests.offload.zenflow.support import config, host_layout, split_named, tiny_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: Host bytes per split element: 12 (fp32 master, two moments) + the accumulators (offload.memory).
HOST_BYTES = {
    ("host", torch.float32): 12 + 2 * 4,
    ("host", torch.bfloat16): 12 + 2 * 2,
    ("host", torch.float16): 12 + 2 * 4,  # fp32 accumulators: a window's fp16 sum would underflow
    ("device", torch.float32): 12 + 4,
    ("device", torch.bfloat16): 12 + 2,
    ("device", torch.float16): 12 + 4,
}


@pytest.mark.parametrize(
    ("shape", "ratio", "split"),
    [
        ((3, 8), 0.25, True),  # 2 of 8 columns on the device
        ((4, 3), 0.25, True),  # at least one column: 1 of 3
        ((3, 8), 0.9, False),  # ceil(7.2) = 8: every column selected
        ((3, 8), 1.0, False),
        ((5, 1), 0.1, False),  # one column: always selected
        ((8,), 0.25, False),  # 1-D: owned whole by the device
        ((2, 3, 4), 0.25, False),
    ],
)
def test_is_split(shape: tuple[int, ...], ratio: float, split: bool) -> None:
    assert is_split(shape, ratio) is split


def test_split_weights_of_a_model() -> None:
    model = tiny_model()
    assert [n for n, _ in split_named(model, config(topk_ratio=0.25))] == ["0.weight", "1.weight", "2.weight"]
    assert split_named(model, config(topk_ratio=1.0)) == []
    # 0.4: 4 of 8 columns and 2 of 3; 0.7: 6 of 8, but ceil(2.1) = 3 of 3 (that weight is the device's)
    assert len(split_named(model, config(topk_ratio=0.4))) == 3
    assert [n for n, _ in split_named(model, config(topk_ratio=0.7))] == ["0.weight", "1.weight"]


def _mixed() -> torch.nn.Module:
    """A split weight of each dtype (and a second fp32 one), biases off."""
    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        {
            "a": torch.nn.Linear(8, 3, bias=False),
            "h": torch.nn.Linear(8, 2, bias=False).to(torch.bfloat16),
            "f": torch.nn.Linear(4, 5, bias=False).to(torch.float16),
            "b": torch.nn.Linear(8, 4, bias=False),
        }
    )


@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_one_host_store_per_dtype_with_fp32_state_and_accumulators(accumulate_on: str) -> None:
    """fp32 master (the parameters' values) and zero fp32 moments per split element, two accumulators
    with host accumulation (one with device accumulation) in the parameters' dtype, fp32 for fp16; the
    bytes per element as offload.memory documents them, and equal to its formula."""
    model = _mixed()
    cfg = config(accumulate_on=accumulate_on)
    on_device = accumulate_on == "device"
    lay = host_layout(model, cfg, on_device=on_device)
    assert [st.dtype for st in lay.stores] == [torch.float32, torch.bfloat16, torch.float16]
    assert [[s.name for s in lay.members(st)] for st in lay.stores] == [
        ["a.weight", "b.weight"],
        ["h.weight"],
        ["f.weight"],
    ]
    for st in lay.stores:
        members = lay.members(st)
        numel = sum(s.param.numel() for s in members)
        assert st.numel == numel
        for t in (st.master, st.exp_avg, st.exp_avg_sq):
            assert t.dtype == torch.float32 and t.numel() == numel
        assert not st.exp_avg.any() and not st.exp_avg_sq.any()
        for s in members:
            assert torch.equal(st.shaped(st.master, s.index), s.param.detach().float())
        assert len(st.bufs) == (1 if on_device else 2)
        acc_dtype = torch.float32 if st.dtype == torch.float16 else st.dtype
        assert all(b.dtype == acc_dtype and b.numel() == numel for b in st.bufs)
        assert st.nbytes() == HOST_BYTES[(accumulate_on, st.dtype)] * numel
    by_dtype: dict[torch.dtype, list[tuple[int, ...]]] = {}
    for p in model.parameters():
        by_dtype.setdefault(p.dtype, []).append(tuple(p.shape))
    host = merged([engine_memory(s, d, cfg, device_type="cpu") for d, s in by_dtype.items()]).host
    parts: dict[str, int] = {}
    for st in lay.stores:
        for k, v in st.parts().items():
            parts[k] = parts.get(k, 0) + v
    assert parts == {k: v for k, v in host.items() if k != "transfer"}
    assert host["transfer"] == 0  # on a CPU device the gradients are read where they lie


def test_splits_know_their_store_position_k_and_buffers() -> None:
    """Each split weight: its store and index in it, k selected columns, no landing buffer on a CPU
    device, an fp32 zero device accumulator only with device accumulation."""
    model = _mixed()
    cfg = config(topk_ratio=0.25)
    lay = host_layout(model, cfg)
    assert set(lay.by_name) == {"a.weight", "h.weight", "f.weight", "b.weight"}
    for s in lay.splits:
        assert s.k == num_selected(s.param.shape[1], 0.25)
        assert lay.members(s.store)[s.index] is s
        assert s.landing is None and s.dacc is None
    assert lay.by_name["a.weight"].k == 2 and lay.by_name["f.weight"].k == 1
    assert lay.low  # bf16 and fp16 weights: their device columns get an fp32 master
    assert lay.buffer_bytes() == 0 and lay.device_buffers() == {"landing": 0, "accumulator": 0}
    assert lay.gathers == [] and not lay.training_thread_gathers

    dev = host_layout(model, cfg, on_device=True)
    for s in dev.splits:
        assert s.dacc is not None and s.dacc.dtype == torch.float32 and s.dacc.shape == s.param.shape
        assert not s.dacc.any()
    numel = sum(s.param.numel() for s in dev.splits)
    assert dev.buffer_bytes() == 4 * numel
    assert dev.device_buffers() == {"landing": 0, "accumulator": 4 * numel}


def test_an_fp32_only_layout_is_not_low() -> None:
    lay = host_layout(tiny_model(), config())
    assert not lay.low and len(lay.stores) == 1 and len(lay.splits) == 3
