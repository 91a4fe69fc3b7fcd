"""offload.zenflow.reduction: in a process group the split weights' gradients are reduce-scattered (each
rank gets its shard of the mean, in its host store's flat layout), their selected columns all-reduced back
into ``.grad`` (the rest keeps the rank's own values), the device-owned gradients all-reduced; column
scores and the split gradient's squared norm are those of the whole mean. Two gloo ranks on tiny tensors
(tests/dist_ranks.py), plus the cases that reduce nothing, in this process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from offload.collectives import EngineGroup, shard_range
from offload.selection import column_scores
from offload.timing import StepStats
from offload.zenflow.reduction import ShardReduction
from tests.dist_ranks import run_ranks
from tests.offload.zenflow.support import config, fill_grads, host_layout, named, tiny_model

WORLD = 2
SEL = {"0.weight": [2, 5], "1.weight": [0, 7], "2.weight": [1]}


def _cols(name: str) -> torch.Tensor | None:
    return torch.tensor(SEL[name]) if name in SEL else None


def _plain(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as plain values: a rank's tensors sent through the queue are shared memory that dies with
    the rank (fp32 -> Python float -> fp32 is exact)."""
    return {"values": t.tolist(), "dtype": str(t.dtype)}


def _tensor(p: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(p["values"], dtype=getattr(torch, p["dtype"].removeprefix("torch.")))


def _rank(rank: int, world: int) -> dict[str, Any]:
    """On each rank: the model's gradients drawn from the rank's seed, one step's reduction with a
    selection, one warm-up round's (no selection); plain values back (:func:`_plain`)."""
    import torch.distributed as dist

    ranks = EngineGroup(group=dist.group.WORLD, world=world, rank=rank)
    cfg = config()
    model = tiny_model()
    lay = host_layout(model, cfg, ranks=ranks)
    red = ShardReduction(named(model), lay, lay.ops, ranks, on_device=False)
    fill_grads(model, rank)
    stats = StepStats()
    reduced = red.reduce(stats, _cols, warming=False)
    assert reduced is not None and red.shards is not None
    out: dict[str, Any] = {
        "shard": _plain(red.shards[0]),
        "grads": {n: _plain(p.grad) for n, p in model.named_parameters() if p.grad is not None},
        "replicated": len(reduced.replicated),
        "also": len(reduced.also),
        "num_params": reduced.num_params,
        "span": (lay.stores[0].lo, lay.stores[0].hi),
        "master": _plain(lay.stores[0].master),
        "scores": {n: _plain(t) for n, t in (red.scores(stats) or {}).items()},
        "split_sq": float(red.split_sq()),
        "bytes_reduced": stats.bytes_reduced,
    }
    fill_grads(model, rank)
    warm = red.reduce(StepStats(), None, warming=True)
    assert warm is not None and red.shards is not None
    out["warm_also"] = len(warm.also)
    out["warm_shard"] = _plain(red.shards[0])
    out["warm_split_grad"] = _plain(model[0].weight.grad)
    return out


def _tensors(res: dict[str, Any]) -> dict[str, Any]:
    def back(v: Any) -> Any:
        if isinstance(v, dict) and set(v) == {"values", "dtype"}:
            return _tensor(v)
        return {k: back(x) for k, x in v.items()} if isinstance(v, dict) else v

    return back(res)


def _means() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Each rank's gradients (as the ranks draw them) and their mean."""
    per_rank = []
    for r in range(WORLD):
        model = tiny_model()
        fill_grads(model, r)
        per_rank.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    mean = {n: (per_rank[0][n] + per_rank[1][n]) / WORLD for n in per_rank[0]}
    return mean, per_rank


@pytest.mark.slow  # two spawned processes importing torch: seconds on a loaded 2-core machine
def test_two_ranks_reduce_scatter_the_split_gradients() -> None:
    results = [_tensors(r) for r in run_ranks(_rank, WORLD, timeout=120.0)]
    mean, per_rank = _means()
    splits = ["0.weight", "1.weight", "2.weight"]
    flat = torch.cat([mean[n].reshape(-1) for n in splits])
    params = torch.cat([p.detach().reshape(-1) for n, p in tiny_model().named_parameters() if n in splits])
    for r, res in enumerate(results):
        lo, hi, _ = shard_range(flat.numel(), WORLD, r)
        assert res["span"] == (lo, hi)
        assert torch.equal(res["master"], params[lo:hi])  # the host store holds this rank's shard only
        assert torch.equal(res["shard"], flat[lo:hi])  # this rank's shard of the mean, bit for bit
        assert torch.equal(res["warm_shard"], flat[lo:hi])
        for n in splits:
            got, cols = res["grads"][n], SEL[n]
            rest = [c for c in range(got.shape[1]) if c not in cols]
            assert torch.equal(got[:, cols], mean[n][:, cols]), n  # the device's columns: the mean
            assert torch.equal(got[:, rest], per_rank[r][n][:, rest]), n  # the rest: not reduced
        for n in ("0.bias", "2.bias"):
            assert torch.equal(res["grads"][n], mean[n]), n  # device-owned: all-reduced
        assert (res["replicated"], res["also"], res["num_params"]) == (2, 3, 5)
        assert res["warm_also"] == 0  # a warm-up round selects nothing: only the host's shard
        assert torch.equal(res["warm_split_grad"], per_rank[r]["0.weight"])
        for n in splits:
            expected = column_scores(mean[n]).double()
            assert (res["scores"][n].double() - expected).abs().max() <= 1e-6 * expected.max(), n
        sq = float(sum(mean[n].double().square().sum() for n in splits))
        assert abs(res["split_sq"] - sq) <= 1e-6 * sq
        assert res["bytes_reduced"] > 0
    assert torch.equal(results[0]["scores"]["0.weight"], results[1]["scores"]["0.weight"])  # one selection


def test_no_reduce_scatter_before_the_first_selection_or_with_device_accumulation() -> None:
    """The first selection needs every column's mean and device accumulation a whole-gradient buffer:
    those steps return None (the caller all-reduces every gradient) and leave no shards. Nothing is
    reduced, so a group that is never connected does."""
    ranks = EngineGroup(world=WORLD, rank=0)
    model = tiny_model()
    fill_grads(model, 0)
    lay = host_layout(model, config(), ranks=ranks)
    red = ShardReduction(named(model), lay, lay.ops, ranks, on_device=False)
    red.shards = [torch.zeros(1)]
    assert red.reduce(StepStats(), None, warming=False) is None and red.shards is None
    assert red.scores(StepStats()) is None
    dev_lay = host_layout(model, config(accumulate_on="device"), ranks=ranks, on_device=True)
    dev = ShardReduction(named(model), dev_lay, dev_lay.ops, ranks, on_device=True)
    assert dev.reduce(StepStats(), _cols, warming=False) is None
    none_split = host_layout(model, config(topk_ratio=1.0), ranks=ranks)
    assert (
        ShardReduction(named(model), none_split, none_split.ops, ranks, on_device=False).reduce(
            StepStats(), _cols, warming=True
        )
        is None
    )
