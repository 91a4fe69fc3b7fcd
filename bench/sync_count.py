"""Counting what makes the training thread wait for the device (bench.engine_ops).

:class:`OpCounter` counts the ATen ops one thread dispatches and the host syncs among them;
:func:`profile_counts` reads a ``torch.profiler`` trace for the CUDA runtime calls that block the
training thread (and only that thread).
"""

from __future__ import annotations

import statistics
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: Ops that make the host wait for the device when they read device memory.
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "item",
        "equal",
        "nonzero",
        "nonzero_static",
        "is_nonzero",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "masked_select",
        "allclose",
        "_assert_async",
    }
)
COPY_OPS = frozenset({"copy_", "_to_copy", "_foreach_copy_", "_copy_from"})


class _Pinned:
    """Stands for the page-locked result of a ``_to_copy(..., pin_memory=True)``."""

    @staticmethod
    def is_pinned() -> bool:
        return True


_PINNED = _Pinned()


def copy_blocks(dst: Any, src: torch.Tensor, non_blocking: bool, dst_device: torch.device) -> bool:
    """Whether a copy from ``src`` to ``dst_device`` (into ``dst``, or a new tensor when None) makes
    the host wait: a copy between host and device memory that is not ``non_blocking``, or whose host
    side is pageable (CUDA stages those synchronously)."""
    if torch.device(dst_device) == src.device:
        return False
    if not non_blocking:
        return True
    host = dst if torch.device(dst_device).type == "cpu" else src
    return host is None or not bool(host.is_pinned())


def _is_bool_index(func_name: str, args: tuple[Any, ...]) -> bool:
    if func_name not in ("index", "index_put_", "index_put", "_index_put_impl_"):
        return False
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or [])


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops, and the host syncs among them, dispatched by the thread that entered it.

    ``is_host``: whether a tensor is host memory (a sync op touching only host memory is no sync).
    """

    def __init__(self, is_host: Callable[[torch.Tensor], bool] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.thread = threading.get_ident()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.views = 0
        self.host_ops = 0
        self._is_host = is_host or (lambda t: False)
        # outputs of host-only ops are host memory too (tracked by object: addresses get reused)
        self._derived: dict[int, weakref.ref[torch.Tensor]] = {}

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._derived.get(id(t))
        return (ref is not None and ref() is t) or self._is_host(t)

    def _sync(self, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name in SYNC_OPS or _is_bool_index(name, args):
            return not all(self.is_host(t) for t in tensors)
        if name not in COPY_OPS:
            return False
        nb = bool(kwargs.get("non_blocking", False))
        if name == "_to_copy":
            dev = kwargs.get("device")
            if dev is None:
                return False
            pinned = kwargs.get("pin_memory") and torch.device(dev).type == "cpu"
            return copy_blocks(_PINNED if pinned else None, args[0], nb, dev)
        nb = nb or bool(args[2] if len(args) > 2 else False)
        if name == "_foreach_copy_":
            return any(copy_blocks(d, s, nb, d.device) for d, s in zip(args[0], args[1], strict=False))
        return len(args) > 1 and copy_blocks(args[0], args[1], nb, args[0].device)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if threading.get_ident() != self.thread:
            return func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host_only = bool(tensors) and all(self.is_host(t) for t in tensors)
        if func.is_view:
            self.views += 1
        elif host_only:
            self.host_ops += 1
        if self._sync(name, func, tuple(args), kwargs):
            self.syncs[name] += 1
        out = func(*args, **kwargs)
        if host_only:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._derived[id(t)] = weakref.ref(t)
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def kernels(self) -> int:
        return self.total - self.views - self.host_ops

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())


_SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpy",
    "cudaMemcpy2D",
    "cudaMemcpyFromSymbol",
    "cudaMemcpyToSymbol",
)


def profile_counts(events: list[Any], kinds: dict[str, str]) -> dict[str, Any]:
    """Per kind of step: mean CUDA kernel launches, blocking runtime calls and milliseconds spent
    in them inside ``engine.step()``, on the training thread only.

    ``events``: the profiler's events (``prof.events()``); ``kinds`` maps each profiled step's
    record_function label to its kind. The label's thread is the training thread: events of other
    threads in the same time range (the CPU optimizer thread's copies and waits) are left out."""
    labels = [e for e in events if e.name in kinds]
    acc: dict[str, dict[str, list[float]]] = {}
    for lab in labels:
        lo, hi = lab.time_range.start, lab.time_range.end
        inside = [
            e
            for e in events
            if e is not lab
            and e.thread == lab.thread
            and lo <= e.time_range.start <= hi
            and e.name.startswith(("cuda", "cu"))
        ]
        launches = sum(e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")) for e in inside)
        blocking = [e for e in inside if e.name in _SYNC_CALLS]
        d = acc.setdefault(kinds[lab.name], {"launches": [], "blocking_calls": [], "blocked_ms": []})
        d["launches"].append(launches)
        d["blocking_calls"].append(len(blocking))
        d["blocked_ms"].append(sum(e.time_range.end - e.time_range.start for e in blocking) / 1e3)
    return {
        k: {m: statistics.fmean(v) for m, v in d.items()} | {"steps": len(d["launches"])}
        for k, d in acc.items()
    }
