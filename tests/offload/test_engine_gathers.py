"""zenflow in a process group, the paths a GPU run takes, on gloo ranks: the all-gathers on the training
thread as with NCCL (``OFFLOAD_TRAINING_THREAD_GATHERS``), a rank whose shard of a store is empty, the
gradient-presence exchange without a host read, the reduce-scatter's reused input."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from offload.collectives import TRAINING_THREAD_GATHERS_ENV
from offload.config import EngineConfig
from offload.engine import ZenFlowEngine
from tests.dist_ranks import run_ranks
from tests.offload.test_engine_distributed import _config as distributed_config

STEPS = 12
BATCH = 8


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return m.to(dtype)


def _config(**kw: Any) -> EngineConfig:
    return distributed_config("zenflow", **kw)


def _batches(n: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 12, generator=g).to(dtype), torch.randn(BATCH, 4, generator=g).to(dtype))
        for _ in range(n)
    ]


def _per_step_weights(rank: int, world: int, dtype: torch.dtype, on_training_thread: bool) -> list[Any]:
    """Each step's consolidated weights (rank 0's view; lists: picklable). Odd steps: every rank asks;
    even steps: every rank saves its state, then rank 0 alone asks (the trainer's checkpoint export)."""
    import torch.distributed as dist

    if on_training_thread:
        os.environ[TRAINING_THREAD_GATHERS_ENV] = "1"
    else:
        os.environ.pop(TRAINING_THREAD_GATHERS_ENV, None)
    model = _model(dtype)
    half = BATCH // world
    part = slice(rank * half, (rank + 1) * half)
    out: list[Any] = []
    with ZenFlowEngine(model, _config(), process_group=dist.group.WORLD) as engine:
        assert engine._mode.layout.training_thread_gathers is on_training_thread  # type: ignore[attr-defined]
        for i, (x, y) in enumerate(_batches(STEPS, dtype)):
            loss = torch.nn.functional.mse_loss(model(x[part]).float(), y[part].float())
            loss.backward()
            engine.step()
            engine.zero_grad()
            if i % 2:
                w = engine.consolidated_state_dict()
            else:
                engine.state_dict()
                w = engine.consolidated_state_dict() if rank == 0 else {}
            out.append({k: v.float().tolist() for k, v in w.items()})
        engine.flush()
        out.append({k: v.float().tolist() for k, v in engine.consolidated_state_dict().items()})
    return out


def _both_paths(rank: int, world: int, dtype: str) -> tuple[list[Any], list[Any]]:
    dt = getattr(torch, dtype)
    return _per_step_weights(rank, world, dt, False), _per_step_weights(rank, world, dt, True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_consolidated_on_the_nccl_path_includes_the_last_window(dtype: str) -> None:
    """With the all-gather on the training thread (NCCL), the weights exported after any step equal
    those of the worker-gather path (gloo), bit for bit: the pending window's result is gathered when
    it is asked for, not one window later. Before the fix they lagged one window behind."""
    results = run_ranks(_both_paths, 2, dtype)
    worker, training = results[0]
    assert len(worker) == len(training) == STEPS + 1
    stale = 0
    for i, (a, b) in enumerate(zip(worker, training, strict=True)):
        assert a.keys() == b.keys() and a, i
        for k in a:
            assert torch.equal(torch.tensor(a[k]), torch.tensor(b[k])), (i, k)
        stale += any(a[k] != worker[i - 1][k] for k in a) if i else 0
    assert stale > 0  # the weights did change from step to step (the comparison meant something)
    assert results[1][1][-1] == worker[-1]  # rank 1 holds the same flushed weights


def _tiny(rank: int, world: int, dtype: str, ring: bool) -> dict[str, list[Any]]:
    """A store of 2 elements (one split [1, 2] weight) on ``world`` ranks: ranks 2.. hold none of it.
    ``ring``: the gradients stream through the page-locked ring as on CUDA (forced on the CPU)."""
    import torch.distributed as dist

    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 1)).to(dt)
    cfg = _config(topk_ratio=0.5, select_interval=2)
    group = dist.group.WORLD if world > 1 else None
    with ZenFlowEngine(model, cfg, process_group=group) as engine:
        mode: Any = engine._mode
        store = mode.layout.stores[0]
        assert (store.numel == 0) == (rank >= 2)
        if ring:
            acc = mode.accumulation
            acc.rings = [
                [torch.empty(max(1, st.numel), dtype=st.dtype) for _ in range(2)] for st in mode.stores
            ]
        g = torch.Generator().manual_seed(1)
        for _ in range(8):
            x = torch.randn(4, 2, generator=g).to(dt)
            model(x).float().pow(2).mean().backward()
            engine.step()
            engine.zero_grad()
        engine.flush()
        engine.state_dict()
        return {k: v.float().tolist() for k, v in engine.consolidated_state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_a_rank_with_an_empty_shard_trains_like_one_process(world: int) -> None:
    """More ranks than a store has elements: the ranks without a piece of it take part in every
    collective and end with the single process's weights (the gradient ring path, which raised
    IndexError on such a rank, included)."""
    single = _tiny(0, 1, "float32", ring=False)
    got = run_ranks(_tiny, world, "float32", True)
    for r in range(world):
        for k in single:
            assert torch.allclose(torch.tensor(got[r][k]), torch.tensor(single[k]), rtol=1e-5, atol=1e-7), (
                r,
                k,
            )


def _presence(rank: int, world: int) -> dict[str, Any]:
    """fill_missing_gradients: three calls where rank 0 has both gradients and rank 1 lacks p1's (reads
    counted), then one with a third parameter no rank has a gradient for."""
    import torch.distributed as dist

    from offload.collectives import EngineGroup, fill_missing_gradients

    ranks = EngineGroup.of(dist.group.WORLD)
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    reads = 0
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> Any:
        nonlocal reads
        reads += 1
        return tolist(self)

    def grads(n: int) -> None:
        for p in params:
            p.grad = None
        params[0].grad = torch.ones(3)
        if rank == 0:
            params[1].grad = torch.full((3,), 2.0)
        fill_missing_gradients(params[:n], ranks)

    torch.Tensor.tolist = counted  # type: ignore[method-assign,assignment]
    try:
        for _ in range(3):
            grads(2)
        two = reads
        grads(3)
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    return {"reads": two, "grads": [None if p.grad is None else p.grad.tolist() for p in params]}


@pytest.mark.slow
def test_fill_missing_gradients_reads_back_only_where_a_gradient_is_missing() -> None:
    """A rank with every gradient makes no host read (the flags' result is not looked at: no sync per
    step on a GPU); the rank without p1's reads and gets a zero one; no rank gets one for p2."""
    r0, r1 = run_ranks(_presence, 2)
    assert r0["reads"] == 0
    assert r1["reads"] == 3  # one per call, there only
    assert r0["grads"] == [[1.0] * 3, [2.0] * 3, None]
    assert r1["grads"] == [[1.0] * 3, [0.0] * 3, None]


def _scatter(rank: int, world: int) -> list[list[float]]:
    """reduce_scatter_flat with a reused flat input against a fresh one, a gradient going missing."""
    import torch.distributed as dist

    from offload.collectives import EngineGroup, FlatBuffer, reduce_scatter_flat

    ranks = EngineGroup.of(dist.group.WORLD)
    numels, offsets, size = [5, 4], [0, 5], 5  # 9 elements, padded to 10
    buf = FlatBuffer(numels, size, world, torch.float32, torch.device("cpu"))
    out: list[list[float]] = []
    for step in range(3):
        grads: list[torch.Tensor | None] = [
            torch.arange(5.0) + 10 * rank + step,
            None if step == 1 else torch.full((2, 2), float(rank + step)),
        ]
        a, b = torch.empty(size), torch.empty(size)
        reduce_scatter_flat(grads, offsets, a, ranks, buf)
        reduce_scatter_flat(grads, offsets, b, ranks)
        out += [a.tolist(), b.tolist()]
    return out


@pytest.mark.slow
def test_reduce_scatter_flat_with_a_reused_input_equals_a_fresh_one() -> None:
    for got in run_ranks(_scatter, 2):
        for i in range(0, len(got), 2):
            assert got[i] == got[i + 1], i
