"""The engine over FSDP2 (``fully_shard`` on a CPU device mesh, gloo ranks): every mode trains each rank's
rows and ends where one process with the whole batch ends; each rank holds 1/N of the parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from offload.config import EngineConfig
from offload.engine import ZenFlowEngine
from tests.dist_ranks import pinned_numerics, run_ranks
from tests.offload.test_engine_distributed import _config as distributed_config

STEPS = 20
BATCH = 8  # the global batch; each rank takes its share


def _model(dtype: torch.dtype, out: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(24, 40),
        torch.nn.Tanh(),
        torch.nn.Linear(40, 40),
        torch.nn.Tanh(),
        torch.nn.Linear(40, out),
    )
    return m.to(dtype)


def _data(dtype: torch.dtype, out: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 24, generator=g).to(dtype), torch.randn(BATCH, out, generator=g).to(dtype))
        for _ in range(STEPS)
    ]


def _config(mode: str, shard: bool, **kw: Any) -> EngineConfig:
    """The replicated tests' settings, clipping small enough to bite (the norm must be the global one)."""
    return distributed_config(mode, **{"max_grad_norm": 0.5, "shard_params": shard, **kw})


def _train(engine: ZenFlowEngine, model: torch.nn.Module, dtype: torch.dtype, part: slice, out: int) -> None:
    for x, y in _data(dtype, out):
        loss = torch.nn.functional.mse_loss(model(x[part]).float(), y[part].float())
        loss.backward()
        engine.step()
        engine.zero_grad()
    engine.flush()


def _shard(model: torch.nn.Module, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _rank_run(
    rank: int,
    world: int,
    out: str,
    mode: str,
    dtype: torch.dtype,
    cfg_kw: dict[str, Any],
    same_data: bool,
    features: int,
) -> None:
    model = _model(dtype, features)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    _shard(model, world)
    share = BATCH // world
    with ZenFlowEngine(model, _config(mode, True, **cfg_kw)) as engine:
        part = slice(None) if same_data else slice(rank * share, (rank + 1) * share)
        _train(engine, model, dtype, part, features)
        local = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[operator]
        m = engine.last_metrics
        assert m is not None
        torch.save(
            {
                "full": full,
                "local_bytes": sum(t.numel() * t.element_size() for t in local.values()),
                "total_bytes": total_bytes,
                "host_bytes": engine.memory().host_bytes,
                "where": (m.world_size, m.rank),
                "metrics_param_bytes": (m.sharded, m.param_bytes),
            },
            Path(out) / f"rank{rank}.pt",
        )


def _single(
    mode: str, dtype: torch.dtype, cfg_kw: dict[str, Any], features: int
) -> tuple[dict[str, torch.Tensor], int]:
    with pinned_numerics():
        model = _model(dtype, features)
        with ZenFlowEngine(model, _config(mode, False, **cfg_kw)) as engine:
            _train(engine, model, dtype, slice(None), features)
            return {n: p.detach().clone() for n, p in model.named_parameters()}, engine.memory().host_bytes


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max()) for k in b)


def _check(
    tmp_path: Path,
    world: int,
    mode: str,
    dtype: torch.dtype,
    cfg_kw: dict[str, Any],
    *,
    same_data: bool = False,
    features: int = 8,
) -> None:
    run_ranks(_rank_run, world, str(tmp_path), mode, dtype, cfg_kw, same_data, features)
    single, single_host = _single(mode, dtype, cfg_kw, features)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert _max_rel(ranks[0]["full"], single) < 1e-5
    for r, st in enumerate(ranks):
        assert st["where"] == (world, r)
        assert st["metrics_param_bytes"] == (True, st["local_bytes"])  # what the step events report
        if features % world:  # uneven rows: FSDP's chunks, the last rank's short (its padding not held)
            continue
        # each rank holds 1/N of the parameters' bytes
        assert st["local_bytes"] * world == st["total_bytes"]
        if mode != "device":  # and 1/N of the host optimizer state
            assert 0.9 / world < st["host_bytes"] / single_host < 1.1 / world


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "cfg_kw"),
    [
        ("device", {}),
        ("offload", {}),
        ("zenflow", {}),
        pytest.param("zenflow", {"accumulate_on": "device"}, marks=pytest.mark.slow),
        pytest.param(
            "zenflow", {"update_interval": "adaptive", "select_interval": "epoch"}, marks=pytest.mark.slow
        ),
    ],
)
def test_two_ranks_sharded_equal_one_process_fp32(tmp_path: Path, mode: str, cfg_kw: dict[str, Any]) -> None:
    _check(tmp_path, 2, mode, torch.float32, cfg_kw)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["device", "offload", "zenflow"])
def test_four_ranks_sharded_equal_one_process_bf16(tmp_path: Path, mode: str) -> None:
    # every rank takes the whole batch: a bf16 forward of a quarter batch rounds otherwise than the whole
    # batch's, while the mean of 4 equal bf16 gradients is exactly each; what is left to differ is the engine's
    _check(tmp_path, 4, mode, torch.bfloat16, {}, same_data=True)


def test_shard_params_must_match_the_model() -> None:
    with pytest.raises(ValueError, match="apply fully_shard first"):
        ZenFlowEngine(_model(torch.float32), _config("device", True))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["offload", "zenflow"])  # the host state's rows (device mode's are FSDP's)
def test_four_ranks_uneven_rows_one_rank_without_any(tmp_path: Path, mode: str) -> None:
    # the head's 6 rows over 4 ranks: 2, 2, 2 and none (its bias too)
    _check(tmp_path, 4, mode, torch.float32, {}, features=6)
