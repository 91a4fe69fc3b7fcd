"""``offload`` mode: synchronous ZeRO-Offload style.

Every step: all gradients go to the host (one D2H copy into one buffer in the parameters' dtype),
the C++ CPU AdamW updates the fp32 master parameters and moments, writing the new bf16/fp16 values
over the gradient in the same pass (host: 12 + 2 bytes per bf16 parameter, see :mod:`offload.memory`),
and they come back (one H2D copy) straight into the device parameters. The training thread waits for all of it,
so the whole update is stall. The optimizer runs in the training thread on all the engine's cores
(nothing else runs meanwhile). Device optimizer state: none. A skipped step (:mod:`offload.guard`)
moves nothing: the host reads the step's verdict first (synchronous anyway).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from offload.config import EngineConfig
from offload.device import DeviceOps
from offload.guard import Gate
from offload.host import HostStore
from offload.memory import EngineMemory
from offload.mode_base import Mode, NamedParams, add_parts
from offload.timing import StepStats


def group_by_dtype(named: NamedParams) -> list[list[tuple[str, torch.nn.Parameter]]]:
    groups: dict[torch.dtype, list[tuple[str, torch.nn.Parameter]]] = {}
    for n, p in named:
        groups.setdefault(p.dtype, []).append((n, p))
    return list(groups.values())


class OffloadMode(Mode):
    name = "offload"

    def __init__(self, named: NamedParams, cfg: EngineConfig, ops: DeviceOps, *, threads: int) -> None:
        super().__init__(named, cfg, ops)
        self.threads = threads
        self.groups = [
            (HostStore([p for _, p in g], ops.host, buffers=1, role="gradient"), g)
            for g in group_by_dtype(named)
        ]

    @torch.no_grad()
    def step(self, stats: StepStats, lr: float, gate: Gate) -> None:
        stats.synchronous = True
        cfg = self.cfg
        with stats.blocked():
            if not gate.finite():
                return
            for store, group in self.groups:
                have = [i for i, (_, p) in enumerate(group) if p.grad is not None]
                staging = store.bufs[0]
                pairs = [(store.flat(staging, i), group[i][1].grad) for i in have]
                t = self.ops.d2h(cast("list[tuple[torch.Tensor, torch.Tensor]]", pairs))  # grads in `have`
                t.wait()
                stats.bytes_d2h += t.nbytes
                stats.cpu_optimizer_seconds += store.adam_now(
                    staging, config=cfg, lr=lr, num_threads=self.threads, only=have
                )
                t = self.ops.h2d([(group[i][1].data, store.flat(store.result(0), i)) for i in have])
                t.wait()
                stats.bytes_h2d += t.nbytes
            stats.applied_cpu_update = True

    def state_bytes(self) -> int:
        return 0

    def memory(self) -> EngineMemory:
        return EngineMemory(self.name, self.params(), host=add_parts([store.parts() for store, _ in self.groups]))

    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.name,
            "device_params": self.device_params_state(),
            "host": [store.state_dict(None) for store, _ in self.groups],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.load_device_params(sd["device_params"])
        for (store, _), s in zip(self.groups, sd["host"], strict=True):
            store.load_state_dict(s)

    def close(self) -> None:
        self.ops.release()
