"""offload.row_recut without a process group: FSDP2's row split (``torch.chunk`` along dim 0, ranks past
the last chunk empty), and a state cut for N ranks and joined again is the whole state, for uneven row
counts and host stores' flat layouts alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from offload.row_recut import cut_rows, rows_of, to_whole

SHAPES = [(5, 3), (2,), (7, 2)]  # 5 and 2 rows over 4 ranks: a rank without rows


def _host(tensors: list[torch.Tensor]) -> dict[str, Any]:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return {
        "master": flat,
        "exp_avg": flat * 2,
        "exp_avg_sq": flat * 3,
        "acc": flat * 4,
        "acc_index": 1,
        "steps": [3, 3, 3],
        "numels": [t.numel() for t in tensors],
        "shard": [0, flat.numel()],
    }


def _whole(mode: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    params = {f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(SHAPES)}
    sd: dict[str, Any] = {"mode": mode, "device_params": params}
    if mode == "device":
        sd["masters"] = {}
        sd["optimizer"] = {
            "state": {
                i: {"step": torch.tensor(3.0), "exp_avg": p * 2, "exp_avg_sq": p * 3}
                for i, p in enumerate(params.values())
            },
            "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}],
        }
    else:
        sd["host"] = [_host(list(params.values()))]
    return sd


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_rows_follow_torch_chunk() -> None:
    t = torch.arange(10.0).view(5, 2)
    got = [rows_of(t, r, 4) for r in range(4)]
    assert [x.shape[0] for x in got] == [2, 2, 1, 0] and got[3].shape == (0, 2)
    assert torch.equal(torch.cat(got), t)


@pytest.mark.parametrize("mode", ["device", "offload"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_cut_and_join_is_the_whole_state(mode: str, world: int) -> None:
    whole = _whole(mode)
    shapes = [list(SHAPES)] if mode == "offload" else []
    parts = [{**cut_rows(whole, r, world, shapes), "mode": mode} for r in range(world)]
    p0 = parts[0]["device_params"]["p0"]
    assert p0.shape == rows_of(whole["device_params"]["p0"], 0, world).shape
    if mode == "offload":  # each rank's flat store over its own rows
        assert parts[0]["host"][0]["numels"] == [rows_of(torch.zeros(s), 0, world).numel() for s in SHAPES]
    assert _equal(to_whole(parts, True, shapes), whole)
    # whole states (one process) load into a group unchanged
    assert _equal(to_whole([whole], False, shapes), whole)


def test_replicated_host_slices_join_in_rank_order() -> None:
    whole = _whole("offload")
    h = whole["host"][0]
    n = h["master"].numel()
    cut = n // 3
    parts = []
    for r, (lo, hi) in enumerate([(0, cut), (cut, n)]):
        part = {k: (v[lo:hi] if isinstance(v, torch.Tensor) else v) for k, v in h.items()}
        parts.append({**whole, "host": [{**part, "shard": [lo, hi]}], "rank": r})
    joined = to_whole(parts, False, [list(SHAPES)])
    assert _equal(joined["host"], whole["host"])
