"""AdamW on the device for whole tensors and for a selected subset of 2-D weights' columns.

Whole tensors (1-D params, and 2-D weights whose every column is selected): torch's fused AdamW
kernel (``torch._fused_adamw_``, what ``torch.optim.AdamW(fused=True)`` runs), all of them in one
call with ``found_inf`` = "this step is skipped", so they update bitwise like
``torch.optim.AdamW(fused=True)`` and a skipped step leaves them untouched on the device.

Selected columns (see :mod:`offload.selection` for the column convention): column entries of the same
``[rows, k]`` shape and dtype are stacked into a *group* whose moments (and fp32 master, for bf16/fp16
params) are ``[n, rows, k]`` tensors, entry ``j`` at index ``j``. Every column carries its own step
count (a device int64), so after a reselection the columns that stay keep their moments and bias
correction and newly selected ones start from zero moments at step 0. The bias corrections
``1 - beta1**s`` and ``sqrt(1 - beta2**s)`` are looked up per column in tables computed in Python
floats exactly as torch's single-tensor AdamW computes them, and applied as ``[n, 1, k]`` factors:
the column path is the same fixed sequence of multi-tensor and per-group ops on every step, whatever
the step counts (no slow path after a reselection), and each column updates bitwise like
:func:`adamw_` (torch's single-tensor AdamW) at its own step count on CPU (on CUDA up to the
kernels' FMA contraction). Per step and entry the only ops are one gather of the gradient's selected
columns (plus one of the param's, for fp32 params) and one scatter back.

Skipping (:mod:`offload.guard`): every update is gated on the device by the step's :class:`Gate`:
the gathered gradient is zeroed and the decay, moment weights and step size become neutral, so a
skipped step changes nothing, with no host sync. Reselection (:meth:`SelectiveAdamW.reselect`) is
batched per group with fixed shapes, no host sync of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from offload.guard import Gate
from offload.selection import column_scores, remap

_LOW = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def adamw_(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, h: AdamWHyper
) -> None:
    """One AdamW step in place, op by op as torch's single-tensor path (``step`` counted from 1)."""
    if h.weight_decay != 0:
        p.mul_(1 - h.lr * h.weight_decay)
    m.lerp_(g, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    step_f = float(step)
    bias_correction1 = 1 - h.beta1**step_f
    bias_correction2 = 1 - h.beta2**step_f
    step_size = h.lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(h.eps)
    p.addcdiv_(m, denom, value=-step_size)


def adamw_columns_(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, steps: torch.Tensor, h: AdamWHyper
) -> None:
    """Reference: AdamW on ``[rows, k]`` tensors whose columns have individual step counts ``steps``
    (float64 ``[k]``, counted from 1), bias corrections computed by ``torch.pow`` in fp64."""
    if h.weight_decay != 0:
        p.mul_(1 - h.lr * h.weight_decay)
    m.lerp_(g, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    bc1 = 1 - torch.pow(h.beta1, steps)
    neg_step_size = torch.full_like(bc1, -h.lr).div_(bc1).to(torch.float32)
    bc2_sqrt = (1 - torch.pow(h.beta2, steps)).sqrt().to(torch.float32)
    denom = (v.sqrt() / bc2_sqrt.unsqueeze(0)).add_(h.eps)
    p.addcdiv_(m * neg_step_size.unsqueeze(0), denom)


def _settles(beta: float) -> int:
    """Smallest step ``s`` from which ``1 - beta**s`` is exactly 1.0 in double precision."""
    if beta == 0.0:
        return 1
    s = max(1, math.ceil(-54 * math.log(2) / math.log(beta)) - 2)
    while 1 - beta**s != 1.0:
        s += 1
    return s


class _BiasTable:
    """``1 - beta1**s`` and ``sqrt(1 - beta2**s)`` for ``s = 0, 1, ...`` on the device (fp64), each
    computed in Python floats as torch's single-tensor AdamW does; row 0 holds 1.0 (a column that
    has not stepped yet). Grown by doubling as training gets longer, up to the step from which both
    are exactly 1.0 (lookups clamp there)."""

    def __init__(self, beta1: float, beta2: float, device: torch.device) -> None:
        self.beta1, self.beta2, self.device = beta1, beta2, device
        self.limit = max(_settles(beta1), _settles(beta2)) + 1
        self.rows = 0
        self.bc1 = self.bc2_sqrt = torch.ones(1, dtype=torch.float64, device=device)

    def ensure(self, max_step: int) -> None:
        need = min(max_step + 1, self.limit)
        if need <= self.rows:
            return
        rows = min(self.limit, max(256, 1 << (need - 1).bit_length()))
        b1, b2 = self.beta1, self.beta2
        bc1 = [1.0] + [1 - b1 ** float(s) for s in range(1, rows)]
        bc2 = [1.0] + [(1 - b2 ** float(s)) ** 0.5 for s in range(1, rows)]
        host = torch.tensor([bc1, bc2], dtype=torch.float64)
        if self.device.type == "cuda":  # a rare, asynchronous upload from page-locked memory
            dev = host.pin_memory().to(self.device, non_blocking=True)
        else:
            dev = host.to(self.device)
        self.bc1, self.bc2_sqrt, self.rows = dev[0], dev[1], rows

    def lookup(self, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = steps.clamp(max=self.rows - 1)
        return self.bc1.index_select(0, idx), self.bc2_sqrt.index_select(0, idx)


@dataclass(slots=True)
class _Full:
    name: str
    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    #: fp32 copy when the param is bf16/fp16 (None for fp32 params).
    master: torch.Tensor | None
    #: fp32 0-dim step count on the param's device (the fused kernel's ``state_steps``).
    step: torch.Tensor


@dataclass(slots=True)
class _ColSpec:
    """A column entry outside any group (registered or loaded, not yet stacked)."""

    name: str
    param: torch.Tensor
    cols: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    master: torch.Tensor | None
    steps: torch.Tensor  # int64 [k]


@dataclass(slots=True)
class Dropped:
    """What a reselection took from a group: its old columns, which of them were dropped, and their
    newest fp32 values (device tensors; the caller copies the dropped ones into the CPU master)."""

    names: list[str]
    cols: torch.Tensor  # int64 [n, k]: the old selection
    mask: torch.Tensor  # bool [n, k]: old column no longer selected
    values: torch.Tensor  # fp32 [n, rows, k]: the old columns' values


def _views(t: torch.Tensor | None) -> list[torch.Tensor]:
    return [] if t is None else list(t.unbind(0))


class _Group:
    """Column entries of one ``[rows, k]`` shape and param dtype, stacked (see the module doc)."""

    def __init__(self, specs: list[_ColSpec], steps: torch.Tensor, off: int) -> None:
        p0 = specs[0].param
        n, rows, k = len(specs), p0.shape[0], specs[0].cols.numel()
        dev = p0.device
        self.names = [s.name for s in specs]
        self.params = [s.param for s in specs]
        self.n, self.rows, self.k, self.off = n, rows, k, off
        self.low = p0.dtype in _LOW
        self.cols = torch.stack([s.cols for s in specs])
        self.col_views = _views(self.cols)
        self.exp_avg = torch.stack([s.exp_avg for s in specs])
        self.exp_avg_sq = torch.stack([s.exp_avg_sq for s in specs])
        masters = [s.master for s in specs]
        self.master = torch.stack([m for m in masters if m is not None]) if self.low else None
        self.steps = steps.narrow(0, off, n * k).view(n, k)
        self.steps.copy_(torch.stack([s.steps for s in specs]))
        # scratch: the gathered fp32 gradient columns; bf16/fp16 params: a buffer in the param dtype
        # (gather target of the gradient, then source of the scatter); fp32 params: the gathered
        # param columns the update runs on
        self.grad = torch.empty((n, rows, k), dtype=torch.float32, device=dev)
        self.grad_views = _views(self.grad)
        self.lp = torch.empty((n, rows, k), dtype=p0.dtype, device=dev) if self.low else None
        self.lp_views = _views(self.lp)
        self.work: torch.Tensor | None = None
        self.work_views: list[torch.Tensor] = []
        if not self.low:
            self._new_work()
        #: Entries without a gradient at the last prepare() (not updated).
        self.missing: list[int] = []
        #: ``work`` holds every entry's current selected values (fp32 params, after an update).
        self.fresh = False

    def _new_work(self) -> None:
        self.work = torch.empty(
            (self.n, self.rows, self.k), dtype=torch.float32, device=self.params[0].device
        )
        self.work_views = _views(self.work)

    @property
    def target(self) -> torch.Tensor:
        """The fp32 tensor the update runs on (master, or the gathered fp32 columns)."""
        t = self.master if self.master is not None else self.work
        assert t is not None
        return t

    def spec(self, j: int) -> _ColSpec:
        return _ColSpec(
            self.names[j],
            self.params[j],
            self.cols[j].clone(),
            self.exp_avg[j].clone(),
            self.exp_avg_sq[j].clone(),
            None if self.master is None else self.master[j].clone(),
            self.steps[j].clone(),
        )

    def state_bytes(self) -> int:
        ts = (self.exp_avg, self.exp_avg_sq, self.master, self.cols, self.steps)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


class SelectiveAdamW:
    """Device-side AdamW over whole tensors and selected columns of 2-D weights (see module doc).

    All entries live on one device. Per step: :meth:`prepare` (gather the selected gradient columns)
    then :meth:`update`, or :meth:`step` for both.
    """

    def __init__(self, hyper: AdamWHyper) -> None:
        self.hyper = hyper
        self._full: dict[str, _Full] = {}
        self._specs: dict[str, _ColSpec] = {}
        self._groups: list[_Group] = []
        self._where: dict[str, tuple[_Group, int]] = {}
        self._steps: torch.Tensor | None = None  # every group's per-column step counts, flat int64
        self._table: _BiasTable | None = None
        self._calls = 0  # update() calls: no step count is larger
        self._gate: Gate | None = None
        self._device: torch.device | None = None
        self._consts: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32 (1 - beta1, beta2) on the device

    # --- registration ---------------------------------------------------------------------------
    def _on_device(self, param: torch.Tensor) -> None:
        if self._device is None:
            self._device = param.device
        elif param.device != self._device:
            raise ValueError(f"all entries must be on one device: {self._device} and {param.device}")

    def add_full(self, name: str, param: torch.Tensor) -> None:
        """Own the whole of ``param`` (1-D params, and 2-D weights whose every column is selected)."""
        self._on_device(param)
        like = param.detach()
        master = like.float().clone() if like.dtype in _LOW else None
        z = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        step = torch.zeros((), dtype=torch.float32, device=like.device)
        self._full[name] = _Full(name, param, z, z.clone(), master, step)

    def add_columns(
        self, name: str, param: torch.Tensor, cols: torch.Tensor, values: torch.Tensor | None = None
    ) -> None:
        """Own the columns ``cols`` (sorted) of 2-D ``param``, from zero moments at step 0.

        ``values``: fp32 ``[rows, k]`` starting values of those columns for a bf16/fp16 param (e.g. the
        CPU master's, which carry more precision than the device copy); default: the param's own.
        """
        if param.dim() != 2:
            raise ValueError(f"{name}: column selection needs a 2-D weight, got {tuple(param.shape)}")
        self._on_device(param)
        self._unbuild()
        cols = cols.to(device=param.device, dtype=torch.int64)
        rows, k = param.shape[0], cols.numel()
        master = None
        if param.dtype in _LOW:
            src = values if values is not None else param.detach().index_select(1, cols)
            master = src.to(device=param.device, dtype=torch.float32).clone()
        z = torch.zeros((rows, k), dtype=torch.float32, device=param.device)
        steps = torch.zeros(k, dtype=torch.int64, device=param.device)
        self._specs[name] = _ColSpec(name, param, cols, z, z.clone(), master, steps)

    def reset_columns(self) -> None:
        """Forget every column entry (their state included)."""
        self._specs.clear()
        self._groups, self._where, self._steps = [], {}, None

    def _unbuild(self) -> None:
        """Move the groups' entries back into per-entry specs (before registering or loading)."""
        if not self._groups:
            return
        specs = {}
        for grp in self._groups:
            for j in range(grp.n):
                specs[grp.names[j]] = grp.spec(j)
        specs.update(self._specs)
        self._specs = specs
        self._groups, self._where, self._steps = [], {}, None

    def _build(self) -> None:
        """Stack the registered column entries into groups (once, lazily)."""
        if not self._specs:
            return
        self._unbuild()
        by_key: dict[tuple[int, int, torch.dtype], list[_ColSpec]] = {}
        for s in self._specs.values():
            by_key.setdefault((s.param.shape[0], s.cols.numel(), s.param.dtype), []).append(s)
        assert self._device is not None
        total = sum(s.cols.numel() for s in self._specs.values())
        self._steps = torch.zeros(total, dtype=torch.int64, device=self._device)
        off = 0
        for specs in by_key.values():
            grp = _Group(specs, self._steps, off)
            off += grp.n * grp.k
            self._groups.append(grp)
            for j, name in enumerate(grp.names):
                self._where[name] = (grp, j)
        self._specs = {}

    # --- queries --------------------------------------------------------------------------------
    def names(self) -> list[str]:
        self._build()
        return [*self._full, *self._where]

    def columns(self, name: str) -> torch.Tensor | None:
        """The sorted selected columns of ``name`` (None for a whole-tensor entry). The tensor is
        replaced, never mutated, by a reselection, so ``is`` tells whether the selection changed."""
        if name in self._full:
            return None
        self._build()
        grp, j = self._where[name]
        return grp.col_views[j]

    def state_bytes(self) -> int:
        """Device bytes of moments, fp32 masters, step counts and index tensors."""
        self._build()
        total = 0
        for e in self._full.values():
            for t in (e.exp_avg, e.exp_avg_sq, e.master, e.step):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total + sum(g.state_bytes() for g in self._groups)

    def memory_parts(self) -> tuple[dict[str, int], int]:
        """Device bytes by component (:mod:`offload.memory`'s names), and of the column scratch."""
        self._build()

        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        state = {"exp_avg": 0, "exp_avg_sq": 0, "master": 0, "step": 0, "columns": 0}
        for e in self._full.values():
            state["exp_avg"] += size(e.exp_avg)
            state["exp_avg_sq"] += size(e.exp_avg_sq)
            state["master"] += size(e.master)
            state["step"] += size(e.step)
        scratch = 0
        for g in self._groups:
            state["exp_avg"] += size(g.exp_avg)
            state["exp_avg_sq"] += size(g.exp_avg_sq)
            state["master"] += size(g.master)
            state["columns"] += size(g.cols) + size(g.steps)
            scratch += size(g.grad) + size(g.lp) + size(g.work)
        return state, scratch

    # --- the update -----------------------------------------------------------------------------
    def _gate_for(self, gate: Gate | None) -> Gate:
        if gate is not None:
            return gate
        assert self._device is not None
        return Gate.always(self._device)

    @torch.no_grad()
    def step(
        self, lr: float | None = None, gate: Gate | None = None, *, want_sq: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`prepare` then :meth:`update`."""
        sq = self.prepare(gate, want_sq=want_sq)
        self.update(lr)
        return sq

    @torch.no_grad()
    def prepare(
        self, gate: Gate | None = None, *, want_sq: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Gather this step's gradient columns (zero when ``gate`` says skip).

        With ``want_sq`` returns the squared L2 norms of the gradient parts this optimizer uses,
        summed over whole-tensor entries and over column entries (device fp32 scalars, no host sync).
        """
        self._build()
        if self._device is None:
            return None
        gate = self._gate = self._gate_for(gate)
        for grp in self._groups:
            grp.missing = []
            src = grp.lp_views if grp.low else grp.grad_views
            for j, p in enumerate(grp.params):
                g = p.grad
                if g is None:
                    grp.missing.append(j)
                    continue
                cols = grp.col_views[j]
                if g.dtype == src[j].dtype:
                    torch.index_select(g, 1, cols, out=src[j])
                else:
                    src[j].copy_(g.index_select(1, cols))
                if grp.work is not None:
                    torch.index_select(p, 1, cols, out=grp.work_views[j])
            if grp.lp is not None:
                grp.grad.copy_(grp.lp)
            for j in grp.missing:
                grp.grad_views[j].zero_()
            grp.grad.masked_fill_(gate.bad, 0.0)
        if not want_sq:
            return None
        dev = self._device
        fulls = [e.param.grad for e in self._full.values() if e.param.grad is not None]
        full_sq = (
            torch.stack(torch._foreach_norm(fulls, 2, dtype=torch.float32)).square().sum()
            if fulls
            else torch.zeros((), device=dev)
        )
        grads = [grp.grad for grp in self._groups]
        cols_sq = (
            torch.stack(torch._foreach_norm(grads, 2)).square().sum()
            if grads
            else torch.zeros((), device=dev)
        )
        return full_sq, cols_sq

    @torch.no_grad()
    def update(self, lr: float | None = None) -> None:
        """Apply the update gathered by the last :meth:`prepare` (gated by its gate)."""
        gate = self._gate
        self._gate = None
        if gate is None:  # update() without prepare(): gather now
            if self._device is None:
                return
            self.prepare()
            gate, self._gate = self._gate, None
            assert gate is not None
        h = self.hyper if lr is None else replace(self.hyper, lr=lr)
        self._calls += 1
        self._update_full(h, gate)
        if self._groups:
            self._update_groups(h, gate)

    def _update_full(self, h: AdamWHyper, gate: Gate) -> None:
        params, grads, ms, vs, steps = [], [], [], [], []
        low_p, low_m = [], []
        for e in self._full.values():
            g = e.param.grad
            if g is None:
                continue
            if e.master is not None:
                p, g = e.master, g.float()
                low_p.append(e.param)
                low_m.append(e.master)
            else:
                p = e.param
            params.append(p)
            grads.append(g if g.is_contiguous() else g.contiguous())
            ms.append(e.exp_avg)
            vs.append(e.exp_avg_sq)
            steps.append(e.step)
        if not params:
            return
        ok_f = gate.as_(torch.float32)
        torch._foreach_add_(steps, [ok_f] * len(steps))  # (the Tensor overload reads it on the host on CPU)
        torch._fused_adamw_(
            params,
            grads,
            ms,
            vs,
            [],
            steps,
            lr=h.lr,
            beta1=h.beta1,
            beta2=h.beta2,
            weight_decay=h.weight_decay,
            eps=h.eps,
            amsgrad=False,
            maximize=False,
            grad_scale=None,
            found_inf=gate.bad_f,
        )
        if low_p:
            torch._foreach_copy_(low_p, low_m)

    def _update_groups(self, h: AdamWHyper, gate: Gate) -> None:
        groups = self._groups
        steps = self._steps
        assert steps is not None and self._device is not None
        dev = self._device
        if self._table is None:
            self._table = _BiasTable(h.beta1, h.beta2, dev)
        self._table.ensure(self._calls)
        shared = not any(grp.missing for grp in groups)
        if shared:
            gks = [gate.ok] * len(groups)
            steps.add_(gate.as_(torch.int64))
        else:  # some entry has no gradient: it is gated off like a skipped step
            gks = []
            for grp in groups:
                keep = torch.ones((grp.n, 1, 1), dtype=torch.bool, device=dev)
                for j in grp.missing:
                    keep[j].fill_(False)
                gk = torch.logical_and(keep, gate.ok)
                gks.append(gk)
                grp.steps.add_(gk.view(grp.n, 1).to(torch.int64))
        bc1, bc2 = self._table.lookup(steps)
        nss = torch.full_like(bc1, -h.lr).div_(bc1).to(torch.float32)  # -lr / (1 - beta1**s), per column
        bc2f = bc2.to(torch.float32)
        if shared:
            nss = torch.where(gate.ok, nss, 0.0)

        def per_group(flat: torch.Tensor, grp: _Group) -> torch.Tensor:
            return flat.narrow(0, grp.off, grp.n * grp.k).view(grp.n, 1, grp.k)

        nss_g = [per_group(nss, grp) for grp in groups]
        bc2_g = [per_group(bc2f, grp) for grp in groups]
        if not shared:
            nss_g = [torch.where(gk, s, 0.0) for gk, s in zip(gks, nss_g, strict=True)]
        ps = [grp.target for grp in groups]
        ms = [grp.exp_avg for grp in groups]
        vs = [grp.exp_avg_sq for grp in groups]
        gs = [grp.grad for grp in groups]
        # gated constants: neutral (1 or 0) where the update is off
        if self._consts is None:
            self._consts = (
                torch.full((), 1 - h.beta1, dtype=torch.float32, device=dev),
                torch.full((), h.beta2, dtype=torch.float32, device=dev),
            )
        w1, b2 = self._consts
        decay = (
            torch.full((), 1 - h.lr * h.weight_decay, dtype=torch.float32, device=dev)
            if h.weight_decay != 0
            else w1
        )  # (unused without weight decay)
        if shared:
            if h.weight_decay != 0:
                torch._foreach_mul_(ps, torch.where(gate.ok, decay, 1.0))
            w = torch.where(gate.ok, w1, 0.0)
            for m, g in zip(ms, gs, strict=True):
                m.lerp_(g, w)
            torch._foreach_mul_(vs, torch.where(gate.ok, b2, 1.0))
        else:
            for gk, p, m, v, g in zip(gks, ps, ms, vs, gs, strict=True):
                if h.weight_decay != 0:
                    p.mul_(torch.where(gk, decay, 1.0))
                m.lerp_(g, torch.where(gk, w1, 0.0))
                v.mul_(torch.where(gk, b2, 1.0))
        torch._foreach_addcmul_(vs, gs, gs, value=1 - h.beta2)
        denoms = torch._foreach_sqrt(vs)
        for d, b in zip(denoms, bc2_g, strict=True):
            d.div_(b)
        torch._foreach_add_(denoms, h.eps)
        upd = [torch.mul(m, s) for m, s in zip(ms, nss_g, strict=True)]
        torch._foreach_addcdiv_(ps, upd, denoms)
        for grp in groups:
            if grp.lp is not None:
                grp.lp.copy_(grp.target)
                src = grp.lp_views
            else:
                src = grp.work_views
            missing = set(grp.missing)
            for j, p in enumerate(grp.params):
                if j not in missing:
                    p.index_copy_(1, grp.col_views[j], src[j])
            grp.fresh = not missing

    # --- reselection ----------------------------------------------------------------------------
    @torch.no_grad()
    def reselect(
        self,
        new_values: Callable[[list[tuple[list[str], torch.Tensor]]], list[torch.Tensor]] | None = None,
        *,
        fresh: bool = False,
        given_scores: dict[str, torch.Tensor] | None = None,
    ) -> list[Dropped]:
        """Select every column entry's top-k columns from its current gradient, all groups batched.

        Columns kept keep their moments, step counts and fp32 master values; new ones start with zero
        moments at step 0. An entry without a gradient keeps its selection. bf16/fp16 groups take the
        fp32 starting values of new columns from ``new_values([(names, new_cols [n, k]), ...])``
        (fp32 ``[n, rows, k]`` per group, aligned with ``new_cols``; only new columns are read), else
        from the param. ``fresh``: every column counts as new (the first selection after
        registering placeholders); nothing is reported dropped then. ``given_scores``: each entry's column
        scores by name, computed elsewhere (a process group's reduced gradient), instead of its grad's.

        Returns one :class:`Dropped` per group (not ``fresh``). Fixed shapes throughout: no host sync
        here (``new_values`` may need one).
        """
        self._build()
        plans = []
        for grp in self._groups:
            dev = grp.cols.device
            scores = torch.empty((grp.n, grp.params[0].shape[1]), dtype=torch.float32, device=dev)
            for j, p in enumerate(grp.params):
                g = p.grad
                if given_scores is not None and grp.names[j] in given_scores:
                    scores[j].copy_(given_scores[grp.names[j]])
                elif g is None:  # keep the current columns: they score 1, every other one 0
                    scores[j].zero_().index_fill_(0, grp.col_views[j], 1.0)
                else:
                    column_scores(g, out=scores[j])
            new = torch.topk(scores, grp.k, dim=1, sorted=False).indices.sort(dim=1).values
            if fresh:
                present = torch.zeros(new.shape, dtype=torch.bool, device=dev)
                pos = torch.zeros_like(new)
            else:
                present, pos = remap(grp.cols, new)
            plans.append((grp, new, present, pos))
        low = [(grp.names, new) for grp, new, _, _ in plans if grp.low]
        values = iter(new_values(low)) if low and new_values is not None else None
        dropped = []
        for grp, new, present, pos in plans:
            n, rows, k = grp.n, grp.rows, grp.k
            if not fresh:
                kept, _ = remap(new, grp.cols)
                if grp.master is not None:
                    old_vals = grp.master
                elif grp.fresh and grp.work is not None:
                    old_vals = grp.work
                else:
                    old_vals = torch.stack(
                        [
                            p.detach().index_select(1, c).float()
                            for p, c in zip(grp.params, grp.col_views, strict=True)
                        ]
                    )
                dropped.append(Dropped(list(grp.names), grp.cols, torch.logical_not(kept), old_vals))
            idx = pos.unsqueeze(1).expand(n, rows, k)
            here = present.unsqueeze(1)
            grp.exp_avg = torch.where(here, grp.exp_avg.gather(2, idx), 0.0)
            grp.exp_avg_sq = torch.where(here, grp.exp_avg_sq.gather(2, idx), 0.0)
            if grp.master is not None:
                if values is not None:
                    base = next(values)
                else:
                    base = torch.stack(
                        [
                            p.detach().index_select(1, c).float()
                            for p, c in zip(grp.params, new.unbind(0), strict=True)
                        ]
                    )
                grp.master = torch.where(here, grp.master.gather(2, idx), base)
            else:
                grp._new_work()  # the old one went out with the dropped values
            grp.steps.copy_(torch.where(present, grp.steps.gather(1, pos), 0))
            grp.cols = new
            grp.col_views = _views(new)
            grp.fresh = False
        return dropped

    # --- persistence ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, object]]:
        self._build()
        out: dict[str, dict[str, object]] = {}
        for n, e in self._full.items():
            out[n] = {
                "cols": None,
                "exp_avg": e.exp_avg.cpu().clone(),
                "exp_avg_sq": e.exp_avg_sq.cpu().clone(),
                "master": None if e.master is None else e.master.cpu().clone(),
                "steps": int(e.step),
            }
        for grp in self._groups:
            for j, n in enumerate(grp.names):
                out[n] = {
                    "cols": grp.cols[j].cpu().clone(),
                    "exp_avg": grp.exp_avg[j].cpu().clone(),
                    "exp_avg_sq": grp.exp_avg_sq[j].cpu().clone(),
                    "master": None if grp.master is None else grp.master[j].cpu().clone(),
                    "steps": grp.steps[j].cpu().clone(),
                }
        return out

    def load_state_dict(self, sd: dict[str, dict[str, object]]) -> None:
        self._unbuild()
        if set(sd) != set(self._full) | set(self._specs):
            raise ValueError("device optimizer state names do not match this model's parameters")
        top = 0
        for n, s in sd.items():
            cols = s["cols"]
            if (cols is None) != (n in self._full):
                raise ValueError(f"{n}: saved state owns a different part of the parameter")
            dev = self._device
            exp_avg = torch.as_tensor(s["exp_avg"]).to(dev).clone()
            exp_avg_sq = torch.as_tensor(s["exp_avg_sq"]).to(dev).clone()
            master = s["master"]
            master_t = None if master is None else torch.as_tensor(master).to(dev).clone()
            steps = s["steps"]
            if n in self._full:
                e = self._full[n]
                e.exp_avg, e.exp_avg_sq, e.master = exp_avg, exp_avg_sq, master_t
                e.step = torch.full((), float(int(steps)), dtype=torch.float32, device=dev)  # type: ignore[call-overload]
                top = max(top, int(steps))  # type: ignore[call-overload]
                continue
            spec = self._specs[n]
            cols_t = torch.as_tensor(cols).to(device=dev, dtype=torch.int64)
            if isinstance(steps, int):
                steps_t = torch.full((cols_t.numel(),), steps, dtype=torch.int64)
            else:
                steps_t = torch.as_tensor(steps).to(torch.int64)
            top = max(top, int(steps_t.max()) if steps_t.numel() else 0)
            spec.cols, spec.exp_avg, spec.exp_avg_sq, spec.master = cols_t, exp_avg, exp_avg_sq, master_t
            spec.steps = steps_t.to(dev)
        self._calls = max(self._calls, top)
