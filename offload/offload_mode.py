"""``offload`` mode: synchronous ZeRO-Offload style.

Every step: all gradients go to the host (one D2H copy into one buffer in the parameters' dtype),
the C++ CPU AdamW updates the fp32 master parameters and moments, writing the new bf16/fp16 values
over the gradient in the same pass (host: 12 + 2 bytes per bf16 parameter, see :mod:`offload.memory`),
and they come back (one H2D copy) straight into the device parameters. The training thread waits for all of it,
so the whole update is stall. In a process group (ZeRO-2 style) the gradients are reduce-scattered:
each rank receives the mean gradient of its 1/N shard of every dtype group's flat layout, updates
that shard's master and moments, and the new values are all-gathered into every replica. The optimizer runs in the training thread on all the engine's cores
(nothing else runs meanwhile). Device optimizer state: none. A skipped step (:mod:`offload.guard`)
moves nothing: the host reads the step's verdict first (synchronous anyway). Loss-scaled fp16
gradients (:mod:`offload.guard`) land scaled; the host step multiplies them by the landed factor in fp32.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from offload.collectives import EngineGroup, Reduced, ShardGather, reduce_scatter_flat
from offload.config import EngineConfig
from offload.device import DeviceOps
from offload.guard import Gate
from offload.host import HostStore, moments_dtype
from offload.memory import EngineMemory
from offload.mode_base import Mode, NamedParams, add_parts, nbytes
from offload.timing import StepStats


def group_by_dtype(named: NamedParams) -> list[list[tuple[str, torch.nn.Parameter]]]:
    groups: dict[torch.dtype, list[tuple[str, torch.nn.Parameter]]] = {}
    for n, p in named:
        groups.setdefault(p.dtype, []).append((n, p))
    return list(groups.values())


class OffloadMode(Mode):
    name = "offload"

    def __init__(
        self,
        named: NamedParams,
        cfg: EngineConfig,
        ops: DeviceOps,
        ranks: EngineGroup | None = None,
        *,
        threads: int,
    ) -> None:
        super().__init__(named, cfg, ops, ranks)
        self.threads = threads
        r = self.ranks
        shard = (r.rank, r.world) if r.distributed else None
        self.groups = [
            (
                HostStore(
                    [p for _, p in g],
                    ops.host,
                    buffers=1,
                    role="gradient",
                    shard=shard,
                    moments=moments_dtype(cfg),
                ),
                g,
            )
            for g in group_by_dtype(named)
        ]
        #: process group: per store, this rank's reduced gradient shard and the replica it is gathered into
        self.grad_shards: list[torch.Tensor] = []
        self.gathers: list[ShardGather] = []
        if r.distributed:
            for store, _ in self.groups:
                self.grad_shards.append(torch.zeros(store.shard_size, dtype=store.dtype, device=ops.device))
                self.gathers.append(ShardGather(store.shard_size, r.world, store.dtype, ops.device))

    @torch.no_grad()
    def reduce(self, stats: StepStats) -> Reduced:
        """Reduce-scatter: each rank receives the mean gradient of its own shard only (half the bytes an
        all-reduce moves; the all-gather of the updated shard after the CPU step is the other half)."""
        out = []
        # The norm per parameter piece, as one process computes it (offload.clipping): one fp32 norm over
        # a whole shard of millions of elements rounds ~1e-4 relative (measured 8e-4 on bench.distributed's
        # small model), and the clipping coefficient with it.
        order = {id(p): i for i, p in enumerate(p for _, p in self.named if p.grad is not None)}
        parts: list[tuple[int, torch.Tensor, bool]] = []
        for (store, group), shard in zip(self.groups, self.grad_shards, strict=True):
            stats.bytes_reduced += reduce_scatter_flat(
                [p.grad for _, p in group], store.full_offsets, shard, self.ranks
            )
            mine = shard.narrow(0, 0, store.numel)
            out.append(mine)
            parts += [
                (order[id(p)], store.flat(mine, i), True)
                for i, (_, p) in enumerate(group)
                if p.grad is not None and store.numels[i]
            ]
        return Reduced([], out, [], parts, len(order))

    @torch.no_grad()
    def step(self, stats: StepStats, lr: float, gate: Gate) -> None:
        stats.synchronous = True
        cfg = self.cfg
        with stats.blocked():
            if not gate.finite():
                return
            factor = gate.host_factor()  # loss-scaled fp16 gradients: 1/scale and the clip (offload.guard)
            for gi, (store, group) in enumerate(self.groups):
                have = [i for i, (_, p) in enumerate(group) if p.grad is not None]
                staging = store.bufs[0]
                pairs: list[tuple[torch.Tensor, torch.Tensor]]
                if self.ranks.distributed:
                    pairs = [(staging, self.grad_shards[gi].narrow(0, 0, store.numel))]
                else:  # the grads in `have`
                    pairs = [(store.flat(staging, i), cast("torch.Tensor", group[i][1].grad)) for i in have]
                t = self.ops.d2h(pairs)
                t.wait()
                stats.bytes_d2h += t.nbytes
                stats.cpu_optimizer_seconds += store.adam_now(
                    staging,
                    config=cfg,
                    lr=lr,
                    num_threads=self.threads,
                    only=have,
                    grad_factor=factor if store.dtype == torch.float16 else None,
                )
                if self.ranks.distributed:
                    self._gather(gi, store, group, have, stats)
                    continue
                t = self.ops.h2d([(group[i][1].data, store.flat(store.result(0), i)) for i in have])
                t.wait()
                stats.bytes_h2d += t.nbytes
            stats.applied_cpu_update = True

    def _gather(
        self,
        gi: int,
        store: HostStore,
        group: list[tuple[str, torch.nn.Parameter]],
        have: list[int],
        stats: StepStats,
    ) -> None:
        """Upload this rank's updated shard, all-gather every rank's, copy the parameters out of it."""
        gather = self.gathers[gi]
        t = self.ops.h2d([(gather.mine.narrow(0, 0, store.numel), store.result(0))])
        t.wait()
        stats.bytes_h2d += t.nbytes
        stats.bytes_gathered += gather.gather(self.ranks.group)
        for i in have:
            p = group[i][1]
            p.data.copy_(gather.view(store.full_offsets[i], p.shape))

    def state_bytes(self) -> int:
        return 0

    def memory(self) -> EngineMemory:
        buffers = {"gather": sum(g.nbytes() for g in self.gathers) + sum(nbytes(t) for t in self.grad_shards)}
        return EngineMemory(
            self.name,
            self.params(),
            host=add_parts([store.parts() for store, _ in self.groups]),
            device_buffers=buffers if self.gathers else {},
        )

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        return {
            "mode": self.name,
            "device_params": self.device_params_state(copy),
            "host": [store.state_dict(None, copy=copy) for store, _ in self.groups],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.load_device_params(sd["device_params"])
        for (store, _), s in zip(self.groups, sd["host"], strict=True):
            store.load_state_dict(s)

    def load_shards(self, sds: list[dict[str, Any]]) -> None:
        self.load_device_params(sds[0]["device_params"])
        for gi, (store, _) in enumerate(self.groups):
            store.load_shards([sd["host"][gi] for sd in sds])

    def close(self) -> None:
        self.ops.release()
