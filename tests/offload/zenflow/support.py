"""The smallest real collaborators of the offload.zenflow modules: the engine's config, the CPU device's
plumbing, a tiny module's split weights, their host layout and a CPU thread (no mocks)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from offload.collectives import EngineGroup
from offload.config import EngineConfig
from offload.cpu_thread import CPUThread
from offload.device import DeviceOps
from offload.memory import is_split
from offload.mode_base import NamedParams
from offload.zenflow.adamw import AdamWHyper
from offload.zenflow.layout import HostLayout

CPU = torch.device("cpu")
#: AdamW with weight decay, large enough a learning rate that every update shows in fp32 and bf16.
HYPER = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def config(**kw: Any) -> EngineConfig:
    """A zenflow config for a tiny model: HYPER's AdamW, one CPU thread, no core binding, no warm-up,
    a reselection every window unless ``select_interval`` is given."""
    base: dict[str, Any] = {
        "mode": "zenflow",
        "lr": HYPER.lr,
        "betas": (HYPER.beta1, HYPER.beta2),
        "eps": HYPER.eps,
        "weight_decay": HYPER.weight_decay,
        "bind_worker_cores": False,
        "cpu_threads": 1,
        "topk_ratio": 0.25,
        "update_interval": 2,
        "full_warm_up_rounds": 0,
        "max_grad_norm": None,
    }
    merged = {**base, **kw}
    if "select_interval" not in merged:
        ui = merged["update_interval"]
        merged["select_interval"] = ui if isinstance(ui, int) else 4
    return EngineConfig(**merged)


def tiny_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """Two split weights of one shape ([3, 8]: 2 of 8 columns at topk 0.25), a third of another ([4, 3]:
    1 of 3), biases (never split)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 3), torch.nn.Linear(8, 3, bias=False), torch.nn.Linear(3, 4)
    ).to(dtype)


def named(model: torch.nn.Module) -> NamedParams:
    return list(model.named_parameters())


def split_named(model: torch.nn.Module, cfg: EngineConfig) -> NamedParams:
    """The weights zenflow splits, as ZenFlowMode picks them."""
    return [(n, p) for n, p in model.named_parameters() if is_split(p.shape, cfg.topk_ratio)]


def host_layout(
    model: torch.nn.Module, cfg: EngineConfig, *, on_device: bool = False, ranks: EngineGroup | None = None
) -> HostLayout:
    return HostLayout(
        split_named(model, cfg),
        cfg,
        DeviceOps(CPU),
        ranks if ranks is not None else EngineGroup(),
        on_device=on_device,
    )


def fill_grads(model: torch.nn.Module, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Give every parameter a fresh gradient from ``seed`` (in its dtype); the fp32 values drawn."""
    gen = torch.Generator().manual_seed(seed)
    drawn = {}
    for n, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen) * scale
        drawn[n] = g
        p.grad = g.to(p.dtype)
    return drawn


@contextmanager
def cpu_thread() -> Iterator[CPUThread]:
    thread = CPUThread(torch_threads=1)
    try:
        yield thread
    finally:
        thread.close()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float) -> None:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise, compared in fp64 (torch.testing's
    assert_close imports torch.distributed.tensor: seconds for a unit test)."""
    a, e = actual.double(), expected.double()
    assert a.shape == e.shape, (a.shape, e.shape)
    bad = (a - e).abs() > atol + rtol * e.abs()
    assert not bad.any(), f"{int(bad.sum())} elements off, max |diff| {float((a - e).abs().max()):.3g}"
