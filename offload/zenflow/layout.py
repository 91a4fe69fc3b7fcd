"""Where zenflow's split weights live: their host stores, device landing buffers and accumulators.

A *split* weight (2-D, not every column selected) is held whole on the host too: one
:class:`~offload.host.HostStore` per parameter dtype (fp32 master, fp32 moments, the window
accumulators in the parameters' dtype; in a process group this rank's 1/N shard of it). On the device
each split weight may have a *landing* buffer the CPU result is prefetched into (CUDA, with
``landing_buffers``), which in a process group is a view of the replica every rank's updated shard is all-gathered into
(:class:`~offload.collectives.ShardGather`), and with ``accumulate_on="device"`` an fp32 accumulator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from offload.collectives import EngineGroup, ShardGather
from offload.config import EngineConfig
from offload.cpu_thread import gil_released
from offload.device import DeviceOps
from offload.host import HostStore, moments_dtype
from offload.mode_base import NamedParams, nbytes
from offload.offload_mode import group_by_dtype
from offload.selection import num_selected

#: A split weight's selected columns by name (the device optimizer's ``columns``).
Columns = Callable[[str], torch.Tensor | None]


@dataclass(slots=True)
class Split:
    name: str
    param: torch.nn.Parameter
    store: HostStore
    index: int  # position inside ``store``
    k: int
    landing: torch.Tensor | None  # device buffer the CPU result is prefetched into (CUDA)
    dacc: torch.Tensor | None  # fp32 device accumulator (accumulate_on="device")


class HostLayout:
    """The split weights, grouped by dtype into host stores (see the module docstring)."""

    def __init__(
        self, named: NamedParams, cfg: EngineConfig, ops: DeviceOps, ranks: EngineGroup, *, on_device: bool
    ) -> None:
        self.ops, self.ranks = ops, ranks
        self.splits: list[Split] = []
        self.stores: list[HostStore] = []
        #: per store in a process group: the replica buffer every rank's updated shard is gathered into
        self.gathers: list[ShardGather] = []
        for group in group_by_dtype(named):
            # host accumulation fills window v+1's accumulator while the CPU thread reads window v's
            accs = 1 if on_device else 2
            store = HostStore(
                [p for _, p in group],
                ops.host,
                buffers=accs,
                role="accumulators",
                shard=(ranks.rank, ranks.world) if ranks.distributed else None,
                moments=moments_dtype(cfg),
            )
            self.stores.append(store)
            gather = (
                ShardGather(store.shard_size, ranks.world, store.dtype, ops.device)
                if ranks.distributed
                else None
            )
            if gather is not None:
                self.gathers.append(gather)
            for i, (n, p) in enumerate(group):
                like = p.detach()
                if gather is not None:  # the landing buffers are views of the gathered replica
                    landing: torch.Tensor | None = gather.view(store.full_offsets[i], like.shape)
                else:  # CUDA: prefetched into (unless the job has no room for them: landing_buffers)
                    landing = torch.empty_like(like) if ops.is_cuda and cfg.landing_buffers else None
                dacc = torch.zeros(like.shape, dtype=torch.float32, device=like.device) if on_device else None
                k = num_selected(p.shape[1], cfg.topk_ratio)
                self.splits.append(Split(n, p, store, i, k, landing, dacc))
        self.by_name = {s.name: s for s in self.splits}
        #: per gathered store: recorded after its last all-gather (on the stream of the thread that ran it)
        self.gathered: list[torch.cuda.Event | None] = [None] * len(self.gathers)
        #: some split weight is bf16/fp16 (its device columns then get an fp32 master)
        self.low = any(s.param.dtype != torch.float32 for s in self.splits)

    def members(self, store: HostStore) -> list[Split]:
        """The split weights ``store`` holds, in its order."""
        return [s for s in self.splits if s.store is store]

    def buffer_bytes(self) -> int:
        """Device bytes of the landing buffers (in a process group: the replica) and accumulators."""
        total = sum(g.nbytes() for g in self.gathers)
        for s in self.splits:
            for t in (s.dacc,) if self.gathers else (s.landing, s.dacc):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def device_buffers(self) -> dict[str, int]:
        """The same by component (:mod:`offload.memory`'s names)."""
        landing = (
            sum(g.nbytes() for g in self.gathers)
            if self.gathers
            else sum(nbytes(s.landing) for s in self.splits)
        )
        return {"landing": landing, "accumulator": sum(nbytes(s.dacc) for s in self.splits)}

    # --- the replica (process group) --------------------------------------------------------------
    @property
    def training_thread_gathers(self) -> bool:
        """The all-gathers run on the training thread (NCCL; see :class:`~offload.collectives.EngineGroup`)."""
        return bool(self.gathers) and self.ranks.training_thread_gathers

    def gather_results(self, acc_i: int, group: Any = None) -> int:
        """Upload this rank's updated shard of every store and all-gather every rank's into the
        replica the landing buffers view (on the CPU thread's own group unless ``group``)."""
        return sum(self.gather_store(si, acc_i, group) for si in range(len(self.stores)))

    def upload_shard(self, si: int, acc_i: int, after: torch.cuda.Event | None = None) -> None:
        """This rank's updated shard into its slot of the replica (H2D stream, after ``after``: the
        last merge, recorded after the all-gather that read the slot; default that all-gather itself,
        which is queued, not finished, when the gathering thread returns); returns once it has landed."""
        store, gather = self.stores[si], self.gathers[si]
        ev = after if after is not None else self.gathered[si]
        t = self.ops.h2d([(gather.mine.narrow(0, 0, store.numel), store.result(acc_i))], after=ev)
        with gil_released():
            t.wait()

    def gather_store(self, si: int, acc_i: int, group: Any = None) -> int:
        self.upload_shard(si, acc_i)
        return self.all_gather(si, group)

    def all_gather(self, si: int, group: Any = None) -> int:
        """All-gather store ``si``'s replica on the calling thread's stream (on ``group``, default the
        side group). The training thread's compute stream waits for it before reading the replica
        (:meth:`replica_ready`): an event, not a host sync."""
        n = self.gathers[si].gather(self.ranks.side if group is None else group)
        self.gathered[si] = self.ops.record()
        return n

    def replica_ready(self) -> None:
        """Order the compute stream after the last all-gather of every store (CUDA; no host wait)."""
        for ev in self.gathered:
            self.ops.compute_wait(ev)
