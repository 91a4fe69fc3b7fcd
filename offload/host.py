"""CPU-side optimizer state for a group of device parameters of one dtype.

One flat fp32 buffer for the master parameters, one each for the two Adam moments (fp32, or bf16 with
``moments=torch.bfloat16``: the C++ step rounds them back stochastically, see :mod:`offload.cpu_adam`),
plus ``bufs``: flat
buffers in the parameters' dtype that hold gradients (``offload``: the gradient landing; ``zenflow``:
the window accumulators, see :mod:`offload.memory`). The C++ step reads its gradient from one of them
and, for bf16/fp16 parameters, writes the new parameters rounded to that dtype over it in the same
pass, so that buffer is then the source of the copy back to the device (:meth:`HostStore.result`;
fp32 parameters: the master itself). Parameter ``i`` occupies ``[offsets[i], offsets[i] + numels[i])``
of every buffer, so one elementwise op covers all of them. Buffers are page-locked when the device is
CUDA (see :mod:`offload.device`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise
from typing import Any

import torch

from offload.collectives import shard_range
from offload.config import EngineConfig
from offload.cpu_thread import gil_released
from offload.device import HostAllocator

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
# Elements per chunk of the torch accumulation path (accumulate_torch): ATen's fp32 += bf16 with type
# promotion runs ~10x slower than a bf16 -> fp32 copy into a cache-sized scratch and a same-dtype add.
_ACC_CHUNK = 1 << 20


def moments_dtype(config: EngineConfig) -> torch.dtype:
    """The host moments' dtype ``config.host_moments`` names."""
    return torch.bfloat16 if config.host_moments == "bf16" else torch.float32


def _adam_step() -> Callable[..., None]:
    # resolved per call so tests can patch it; importing offload never builds the extension
    from offload.cpu_adam import adam_step

    return adam_step


def _accumulate() -> Callable[..., None]:
    from offload.cpu_adam import accumulate

    return accumulate


def accumulate_torch(
    acc: torch.Tensor, src: torch.Tensor, *, alpha: float, first: bool, tmp: torch.Tensor | None = None
) -> None:
    """The accumulation in torch ops (the engine's path before the C++ one; a reference and a
    benchmark baseline): fp32 in one op each, bf16/fp16 in 1M-element chunks through fp32 scratch
    ``tmp``, the GIL held between the chunks. A bf16/fp16 ``acc`` gets each chunk's fp32 result
    rounded to nearest even."""
    low_acc = acc.dtype in _LOW_PRECISION
    if src.dtype not in _LOW_PRECISION and not low_acc:
        if first and alpha != 1.0:
            torch.mul(src, alpha, out=acc)
        elif first:
            acc.copy_(src)
        else:
            acc.add_(src, alpha=alpha)
        return
    n = acc.numel()
    if tmp is None:
        tmp = torch.empty(min(n, _ACC_CHUNK), dtype=torch.float32)
    for lo in range(0, n, _ACC_CHUNK):
        hi = min(n, lo + _ACC_CHUNK)
        a = acc[lo:hi]
        if low_acc:
            t = tmp[: hi - lo]
            if first:
                torch.mul(src[lo:hi].float(), alpha, out=t)
            else:
                t.copy_(a)
                t.add_(src[lo:hi].float(), alpha=alpha)
            a.copy_(t)
        elif first:
            a.copy_(src[lo:hi])
            if alpha != 1.0:
                a.mul_(alpha)
        else:
            t = tmp[: hi - lo]
            t.copy_(src[lo:hi])
            a.add_(t, alpha=alpha)


class HostStore:
    """Master params, moments and gradient buffers for ``params`` (all of one dtype).

    ``buffers``: how many flat gradient buffers in the params' dtype; ``role`` names them in
    :meth:`parts` (``"gradient"`` or ``"accumulators"``, see :mod:`offload.memory`); ``moments``: the
    moments' dtype (fp32 or bf16).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        alloc: HostAllocator,
        *,
        buffers: int,
        role: str = "gradient",
        shard: tuple[int, int] | None = None,
        moments: torch.dtype = torch.float32,
    ) -> None:
        if not params:
            raise ValueError("HostStore needs at least one parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"HostStore needs parameters of one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = params[0].dtype
        self.low = self.dtype in _LOW_PRECISION
        self.role = role
        self.shapes = [tuple(p.shape) for p in params]
        #: The parameters' sizes and offsets in the store's whole flat layout (``total`` elements).
        self.full_numels = [p.numel() for p in params]
        self.full_offsets = [0]
        for n in self.full_numels[:-1]:
            self.full_offsets.append(self.full_offsets[-1] + n)
        self.total = sum(self.full_numels)
        rank, world = shard if shard is not None else (0, 1)
        #: This rank's shard ``[lo, hi)`` of the flat layout (everything in a single process) and the
        #: padded shard size every rank uses for all-gathers (offload.collectives.shard_range).
        self.rank, self.world = rank, world
        self.lo, self.hi, self.shard_size = shard_range(self.total, world, rank)
        # Each parameter's piece inside the shard: ``offsets``/``numels`` in the buffers (the shard),
        # ``param_starts`` where the piece starts in the parameter's own flat index.
        self.offsets, self.numels, self.param_starts = [], [], []
        for off, n in zip(self.full_offsets, self.full_numels, strict=True):
            a, b = max(off, self.lo), min(off + n, self.hi)
            if a < b:
                self.offsets.append(a - self.lo)
                self.numels.append(b - a)
                self.param_starts.append(a - off)
            else:  # not in this shard: an empty piece where it would sit
                self.offsets.append(min(max(off - self.lo, 0), self.hi - self.lo))
                self.numels.append(0)
                self.param_starts.append(0)
        self.numel = self.hi - self.lo
        n = self.numel
        self.master = alloc.empty(n, torch.float32)
        for i, p in enumerate(params):
            self.flat(self.master, i).copy_(self.piece(p.detach(), i))
        if moments not in _MOMENT_DTYPES:
            raise ValueError(f"HostStore moments must be float32 or bfloat16, got {moments}")
        self.exp_avg = alloc.zeros(n, moments)
        self.exp_avg_sq = alloc.zeros(n, moments)
        #: fp16 window accumulators are fp32 (an fp16 mean of unscaled gradients underflows); the
        #: step's fp16 result then goes into the first half of the fp32 buffer it read (:meth:`result`)
        wide = self.dtype == torch.float16 and role == "accumulators"
        self.bufs = [alloc.zeros(n, torch.float32 if wide else self.dtype) for _ in range(buffers)]
        #: Adam step count per parameter (the C++ step takes it explicitly).
        self.steps = [0] * len(params)

    # --- views ----------------------------------------------------------------------------------
    def flat(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf.narrow(0, self.offsets[i], self.numels[i])

    def piece(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """The elements of ``t`` (shaped like parameter ``i``, e.g. its gradient) that this shard holds,
        flat: the counterpart of ``flat(buf, i)`` (the whole tensor in a single process)."""
        return t.reshape(-1).narrow(0, self.param_starts[i], self.numels[i])

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def shaped(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        if self.numels[i] != self.full_numels[i]:
            raise ValueError("shaped() needs the whole parameter; this store holds a shard of it")
        return self.flat(buf, i).view(self.shapes[i])

    def rows_view(self, buf: torch.Tensor, i: int) -> tuple[torch.Tensor, int, int, int]:
        """Parameter ``i``'s piece of ``buf`` (a 2-D ``[rows, cols]`` parameter) on whole rows:
        ``(rows, r0, start, n)``: a fresh fp32 ``[r1 - r0, cols]`` tensor covering rows ``r0 .. r1`` whose
        flat ``[start, start + n)`` is the piece (zeros elsewhere). Write back with :meth:`unrows`."""
        cols = self.shapes[i][1]
        a, n = self.param_starts[i], self.numels[i]
        r0, r1 = a // cols, -(-(a + n) // cols)
        rows = torch.zeros((r1 - r0) * cols, dtype=torch.float32)
        start = a - r0 * cols
        rows[start : start + n] = self.flat(buf, i)
        return rows.view(r1 - r0, cols), r0, start, n

    def unrows(self, buf: torch.Tensor, i: int, rows: torch.Tensor, start: int, n: int) -> None:
        self.flat(buf, i).copy_(rows.reshape(-1)[start : start + n])

    def result(self, index: int) -> torch.Tensor:
        """The buffer the device copies its new values from after a CPU step that read ``bufs[index]``:
        that buffer (bf16/fp16: the step wrote the rounded parameters over the gradient; an fp32 buffer
        of fp16 parameters: into its first half), else master."""
        return self.grad_buffer(index) if self.low else self.master

    def grad_buffer(self, index: int) -> torch.Tensor:
        """``bufs[index]`` in the parameters' dtype, where a gradient lands as it is (an fp32 buffer of
        fp16 parameters: its first half, where :meth:`result` lies too)."""
        buf = self.bufs[index]
        return buf if buf.dtype == self.dtype else buf.view(self.dtype).narrow(0, 0, self.numel)

    def parts(self) -> dict[str, int]:
        """Bytes by component (the names of :mod:`offload.memory`)."""

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        return {
            "master": size(self.master),
            "exp_avg": size(self.exp_avg),
            "exp_avg_sq": size(self.exp_avg_sq),
            self.role: sum(size(b) for b in self.bufs),
        }

    def nbytes(self) -> int:
        return sum(self.parts().values())

    # --- gradient accumulation ------------------------------------------------------------------
    @staticmethod
    def accumulate(
        acc: torch.Tensor, src: torch.Tensor, *, alpha: float, first: bool, num_threads: int | None = None
    ) -> None:
        """``acc = alpha * src`` (first step of a window) or ``acc += alpha * src`` on flat views of
        equal numel: one pass of the C++ extension (SIMD, OpenMP on ``num_threads``, the GIL released
        throughout), bitwise equal to :func:`accumulate_torch`."""
        with gil_released():
            _accumulate()(acc, src, alpha=alpha, first=first, num_threads=num_threads)

    # --- the CPU optimizer ----------------------------------------------------------------------
    def adam(
        self,
        grad: torch.Tensor,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        num_threads: int,
        chunk: int,
        only: Sequence[int] | None = None,
        grad_factor: float | None = None,
    ) -> Iterator[list[int]]:
        """AdamW on the params (all, or the indices in ``only``) with gradient buffer ``grad`` (one of
        ``bufs``: bf16/fp16 parameters are written over it, see :meth:`result`).

        A generator: after every ``chunk`` elements (and at the end of each parameter) it yields the
        indices of the parameters fully updated since the last yield (maybe none), so a cooperative
        CPU thread can run waiting gradient copies in between and start copying finished parameters back.
        Each updated parameter's step count goes up by one. When all the params are updated and share
        one step count (zenflow's windows), the chunks run over the flat buffers across parameter
        boundaries: one C++ call per chunk, not per parameter (same numbers: the update is elementwise).
        ``grad_factor``: multiply the gradient by it first, in fp32 (a loss-scaled fp16 gradient).
        """
        factor = None if grad_factor is None or grad_factor == 1.0 else float(grad_factor)
        b1, b2 = betas
        hyper = {
            "lr": lr,
            "beta1": b1,
            "beta2": b2,
            "eps": eps,
            "weight_decay": weight_decay,
            "adamw": True,
            "num_threads": num_threads,
        }
        ranges = _AdamRanges(self, grad, factor=factor, hyper=hyper, num_threads=num_threads)
        if only is None and len(set(self.steps)) == 1:
            yield from self._adam_across(ranges, chunk)
        else:
            yield from self._adam_each(ranges, chunk, only)

    def _adam_across(self, ranges: _AdamRanges, chunk: int) -> Iterator[list[int]]:
        """Every parameter at one step count: chunks over the flat buffers, across parameters."""
        self.steps = [s + 1 for s in self.steps]
        step, done = self.steps[0], 0
        for lo in range(0, self.numel, chunk):
            hi = min(self.numel, lo + chunk)
            ranges.run(lo, hi, step)
            finished = []
            while done < len(self.numels) and self.offsets[done] + self.numels[done] <= hi:
                finished.append(done)
                done += 1
            yield finished

    def _adam_each(self, ranges: _AdamRanges, chunk: int, only: Sequence[int] | None) -> Iterator[list[int]]:
        """Parameter by parameter (all, or the indices in ``only``), each at its own step count."""
        for i in range(len(self.numels)) if only is None else sorted(only):
            self.steps[i] += 1
            base, n = self.offsets[i], self.numels[i]
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                ranges.run(base + lo, base + hi, self.steps[i])
                yield [i] if hi == n else []

    def adam_now(
        self,
        grad: torch.Tensor,
        *,
        config: EngineConfig,
        lr: float,
        num_threads: int,
        only: Sequence[int] | None = None,
        grad_factor: float | None = None,
    ) -> float:
        """Run :meth:`adam` to the end in one go with the engine config's betas, eps and weight
        decay; the seconds it took."""
        t0 = time.perf_counter()
        for _ in self.adam(
            grad,
            lr=lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
            num_threads=num_threads,
            chunk=1 << 62,
            only=only,
            grad_factor=grad_factor,
        ):
            pass
        return time.perf_counter() - t0

    # --- persistence ----------------------------------------------------------------------------
    def state_dict(self, acc_index: int | None, *, copy: bool = True) -> dict[str, object]:
        """``acc_index``: the buffer holding a partial window sum to keep (None: none). ``copy=False``:
        the buffers themselves, not clones (a streamed checkpoint writes them from where they are;
        valid until the store changes again)."""

        def out(t: torch.Tensor) -> torch.Tensor:
            return t.clone() if copy else t

        return {
            "master": out(self.master),
            "exp_avg": out(self.exp_avg),
            "exp_avg_sq": out(self.exp_avg_sq),
            "acc": None if acc_index is None else out(self.bufs[acc_index]),
            "acc_index": acc_index,
            "steps": list(self.steps),
            "numels": list(self.full_numels),
            "shard": [self.lo, self.hi],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`. Moments saved in the other dtype are converted: bf16 into fp32
        exactly, fp32 into bf16 rounded to nearest even (a resume across ``host_moments``)."""
        if list(sd["numels"]) != self.full_numels:
            raise ValueError("host optimizer state was saved for differently shaped parameters")
        if list(sd.get("shard", [0, self.total])) != [self.lo, self.hi]:
            raise ValueError("host optimizer state holds another shard; load every rank's state to re-cut it")
        self.master.copy_(sd["master"])
        self.exp_avg.copy_(sd["exp_avg"])
        self.exp_avg_sq.copy_(sd["exp_avg_sq"])
        idx = sd["acc_index"]
        if idx is not None and sd["acc"] is not None:
            self.bufs[int(idx)].copy_(sd["acc"])
        self.steps = [int(s) for s in sd["steps"]]

    def load_shards(self, sds: Sequence[dict[str, Any]]) -> None:
        """Load the states of every shard of a store (any number of ranks, in rank order) and keep
        this store's shard of them: resuming with another number of ranks."""
        for sd in sds:
            if list(sd["numels"]) != self.full_numels:
                raise ValueError("host optimizer state was saved for differently shaped parameters")
        if len({tuple(sd["steps"]) for sd in sds}) != 1 or len({sd["acc_index"] for sd in sds}) != 1:
            raise ValueError("the shards' host optimizer states are not from the same step")
        spans = [tuple(sd.get("shard", [0, self.total])) for sd in sds]
        if spans[0][0] != 0 or spans[-1][1] != self.total or any(a[1] != b[0] for a, b in pairwise(spans)):
            raise ValueError(f"the shards do not cover the parameters: {spans}")

        def mine(key: str, dst: torch.Tensor) -> None:
            # each saved shard's overlap with this one, copied in place (no concatenated copy)
            for sd, (a, b) in zip(sds, spans, strict=True):
                lo, hi = max(a, self.lo), min(b, self.hi)
                if lo < hi:
                    dst[lo - self.lo : hi - self.lo].copy_(torch.as_tensor(sd[key])[lo - a : hi - a])

        mine("master", self.master)
        mine("exp_avg", self.exp_avg)
        mine("exp_avg_sq", self.exp_avg_sq)
        idx = sds[0]["acc_index"]
        if idx is not None and all(sd["acc"] is not None for sd in sds):
            mine("acc", self.bufs[int(idx)])
        self.steps = [int(s) for s in sds[0]["steps"]]

    def restore_result(self, index: int) -> None:
        """Rebuild a CPU step's result in ``bufs[index]`` from the master (bf16/fp16): the step wrote
        exactly the master rounded to nearest even, and nothing changes the master before it is used."""
        if self.low:
            self.result(index).copy_(self.master)


class _AdamRanges:
    """One :meth:`HostStore.adam` call's update of element ranges ``[lo, hi)`` of the flat buffers: the
    gradient scaled by ``factor`` first (when given), the C++ step, and the new parameters where the
    device copies them from (:meth:`HostStore.result`)."""

    def __init__(
        self,
        store: HostStore,
        grad: torch.Tensor,
        *,
        factor: float | None,
        hyper: dict[str, Any],
        num_threads: int,
    ) -> None:
        self.store, self.grad, self.factor = store, grad, factor
        self.hyper, self.num_threads = hyper, num_threads
        self.step_fn = _adam_step()
        #: bf16 moments: their stochastic rounding's bits are hashed from the step and each element's
        #: index in the whole (unsharded) flat layout, so neither threads, chunks nor ranks change them
        self.lean = store.exp_avg.dtype == torch.bfloat16
        # bf16/fp16: the new parameters go over the gradient they came from (grad is one of ``bufs``)
        self.out = store.low and grad.dtype == store.dtype
        # fp16 parameters, fp32 gradient buffer: the results go into the buffer's fp16 view. Its range
        # [lo, hi) overlays the fp32 elements [lo / 2, hi / 2): written by the step itself where those
        # lie below lo (hi <= 2 lo), else right after it (they have been read; ranges run ascending).
        mine = store.low and grad.dtype == torch.float32 and any(b is grad for b in store.bufs)
        self.narrow_out = grad.view(store.dtype).narrow(0, 0, store.numel) if mine else None
        self.scratch = (
            torch.empty(min(store.numel, _ACC_CHUNK), dtype=torch.float32)
            if factor is not None and grad.dtype != torch.float32
            else None
        )

    def run(self, lo: int, hi: int, step: int) -> None:
        piece = _ACC_CHUNK if self.factor is not None else hi - lo  # the scaled gradient is transient
        for a in range(lo, hi, max(1, piece)):
            self._step_range(a, min(hi, a + piece), step)

    def _step_range(self, lo: int, hi: int, step: int) -> None:
        store, factor, narrow_out = self.store, self.factor, self.narrow_out
        g = self.grad[lo:hi]
        src = g
        po = g if self.out else None
        direct = narrow_out is not None and hi <= 2 * lo
        if direct:
            assert narrow_out is not None
            po = narrow_out[lo:hi]
        with gil_released():
            if factor is not None and self.scratch is not None:
                src = self.scratch[: hi - lo]
                _accumulate()(src, g, alpha=factor, first=True, num_threads=self.num_threads)
            elif factor is not None:
                g.mul_(factor)
            self.step_fn(
                store.master[lo:hi],
                src,
                store.exp_avg[lo:hi],
                store.exp_avg_sq[lo:hi],
                step=step,
                param_out=po,
                **self.hyper,
                **({"rng_seed": step, "rng_offset": store.lo + lo} if self.lean else {}),
            )
            if narrow_out is not None and not direct:
                narrow_out[lo:hi].copy_(store.master[lo:hi])
