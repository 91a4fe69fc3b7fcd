"""offload.zenflow.handover: columns changing hands at a reselection. A newly selected column of a
bf16/fp16 weight starts its fp32 device master from the CPU master (one blocking read for every group; no
values for fp32 weights); a dropped column's newest device value is stashed and written into the CPU
master only when the next boundary applies the stash, and nothing else of the master changes."""

from __future__ import annotations

import pytest
import torch

from offload.collectives import EngineGroup
from offload.timing import StepStats
from offload.zenflow.handover import Handover
from offload.zenflow.layout import HostLayout
from offload.zenflow.selective_adamw import SelectiveAdamW
from tests.offload.zenflow.support import HYPER, config, fill_grads, host_layout, tiny_model


def _handover(lay: HostLayout) -> Handover:
    return Handover(lay, lay.ops, EngineGroup())


def _device_optimizer(lay: HostLayout) -> SelectiveAdamW:
    """The split weights' first k columns on the device."""
    opt = SelectiveAdamW(HYPER)
    for s in lay.splits:
        opt.add_columns(s.name, s.param, torch.arange(s.k))
    return opt


def _scores(lay: HostLayout, picks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    out = {}
    for s in lay.splits:
        sc = torch.zeros(s.param.shape[1])
        sc[picks[s.name]] = 1.0
        out[s.name] = sc
    return out


def _master(lay: HostLayout, name: str) -> torch.Tensor:
    s = lay.by_name[name]
    return s.store.shaped(s.store.master, s.index)


#: The reselection of the tests: ``0.weight`` [0, 1] -> [0, 5] drops column 1 (after a kept one: the stash
#: reorders it first), ``1.weight`` keeps [0, 1], ``2.weight`` [0] -> [2] drops column 0.
PICKS = {"0.weight": [0, 5], "1.weight": [0, 1], "2.weight": [2]}
DROPPED = {"0.weight": [1], "1.weight": [], "2.weight": [0]}


def test_fp32_weights_need_no_values_from_the_master() -> None:
    lay = host_layout(tiny_model(), config())
    assert _handover(lay).values_from_master(StepStats()) is None


def test_new_columns_take_the_cpu_masters_values_in_one_read() -> None:
    """bf16: the values given for each group's new columns are the CPU master's (off the bf16 grid here,
    so not the parameter's), read in one host sync for all groups; the device optimizer's fp32 master of
    a newly selected column starts from them."""
    model = tiny_model(torch.bfloat16)
    lay = host_layout(model, config())
    for s in lay.splits:
        s.store.flat(s.store.master, s.index).add_(1e-3 * torch.arange(s.param.numel()))
    handover = _handover(lay)
    stats = StepStats()
    values = handover.values_from_master(stats)
    assert values is not None
    groups = [(["0.weight", "1.weight"], torch.tensor([[2, 6], [0, 7]])), (["2.weight"], torch.tensor([[1]]))]
    out = values(groups)
    assert lay.ops.host_syncs == 1
    for (names, cols), got in zip(groups, out, strict=True):
        assert got.dtype == torch.float32 and got.shape == (
            len(names),
            lay.by_name[names[0]].param.shape[0],
            cols.shape[1],
        )
        for j, name in enumerate(names):
            assert torch.equal(got[j], _master(lay, name)[:, cols[j]])
    assert stats.bytes_h2d == sum(t.numel() * 4 for t in out)

    opt = _device_optimizer(lay)
    fill_grads(model, 0)
    opt.reselect(handover.values_from_master(StepStats()), given_scores=_scores(lay, PICKS))
    st = opt.state_dict()["0.weight"]
    assert st["cols"].tolist() == [0, 5]
    assert torch.equal(st["master"][:, 1], _master(lay, "0.weight")[:, 5])  # new: the CPU master's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropped_columns_reach_the_cpu_master_when_the_stash_is_applied(dtype: torch.dtype) -> None:
    """After device steps, a reselection's dropped columns are stashed: the CPU master is untouched until
    ``apply``, which writes exactly the dropped columns' newest device values (fp32: the parameter's;
    bf16: the device's fp32 master) and copies only their bytes off the device."""
    model = tiny_model(dtype)
    lay = host_layout(model, config())
    handover = _handover(lay)
    opt = _device_optimizer(lay)
    for seed in range(2):
        fill_grads(model, seed)
        opt.step()
    device_values = {}
    for s in lay.splits:
        st = opt.state_dict()[s.name]
        device_values[s.name] = st["master"] if dtype != torch.float32 else s.param.detach()[:, : s.k].clone()
    masters = {s.name: _master(lay, s.name).clone() for s in lay.splits}
    for d in opt.reselect(handover.values_from_master(StepStats()), given_scores=_scores(lay, PICKS)):
        handover.stash_out(d)
    rows = {s.name: s.param.shape[0] for s in lay.splits}
    assert handover.stash_bytes() == sum(4 * s.param.shape[0] * s.k for s in lay.splits)  # every old column
    assert all(torch.equal(_master(lay, n), m) for n, m in masters.items())  # not before the boundary
    stats = StepStats()
    handover.apply(stats)
    assert stats.bytes_d2h == sum(4 * rows[n] * len(c) for n, c in DROPPED.items())
    for s in lay.splits:
        master, expected = _master(lay, s.name), masters[s.name].clone()
        for c in DROPPED[s.name]:
            expected[:, c] = device_values[s.name][:, c]  # column c sat at position c of the first k
        assert torch.equal(master, expected), s.name
        if DROPPED[s.name]:
            assert not torch.equal(master, masters[s.name])  # the device had moved it
    assert handover.stash_groups == [] and handover.stash_bytes() == 0


def test_stash_state_round_trip() -> None:
    """The stash saved before its boundary (per weight: the dropped columns and their fp32 values) and
    loaded into another handover writes the same values into that layout's master."""
    model = tiny_model()
    lay = host_layout(model, config())
    handover = _handover(lay)
    opt = _device_optimizer(lay)
    fill_grads(model, 0)
    opt.step()
    for d in opt.reselect(None, given_scores=_scores(lay, PICKS)):
        handover.stash_out(d)
    sd = handover.state_dict()
    assert {n: c.tolist() for n, (c, _) in sd.items()} == DROPPED
    for name, (cols, vals) in sd.items():
        assert torch.equal(vals, model.get_parameter(name).detach()[:, cols])
    other = host_layout(tiny_model(), config())
    restored = _handover(other)
    restored.load_state_dict(sd)
    restored.apply(StepStats())
    handover.apply(StepStats())
    for s in lay.splits:
        assert torch.equal(_master(other, s.name), _master(lay, s.name)), s.name
    assert restored.stash == {}
