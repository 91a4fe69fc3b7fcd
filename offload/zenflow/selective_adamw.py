"""AdamW on the device for whole tensors and for a selected subset of 2-D weights' columns.

Whole tensors (1-D params, and 2-D weights whose every column is selected): torch's fused AdamW
kernel, all of them in one call with ``found_inf`` = "this step is skipped", so they update bitwise
like ``torch.optim.AdamW(fused=True)`` and a skipped step leaves them untouched on the device.

Selected columns (see :mod:`offload.selection` for the column convention): entries of the same
``[rows, k]`` shape and dtype are stacked into groups (:mod:`offload.zenflow.column_groups`). Every
column carries its own step count (a device int64), so after a reselection the columns that stay keep
their moments and bias correction and newly selected ones start from zero moments at step 0. The bias
corrections are looked up per column in tables computed in Python floats exactly as torch's
single-tensor AdamW computes them: the column path is the same fixed sequence of multi-tensor and
per-group ops on every step, whatever the step counts (no slow path after a reselection), and each
column updates bitwise like :func:`~offload.zenflow.adamw.adamw_` (torch's single-tensor AdamW) at
its own step count on CPU (on CUDA up to the kernels' FMA contraction). Per step and entry the only
ops are one gather of the gradient's selected columns (plus one of the param's, for fp32 params) and
one scatter back.

Loss scaling (:mod:`offload.guard`): fp16 gradients arrive loss-scaled and unclipped; the gate's
gradient factor is applied to their fp32 copies (the gathered columns, a whole tensor's fp32 copy),
never in fp16.

Skipping (:mod:`offload.guard`): every update is gated on the device by the step's :class:`Gate`:
the gathered gradient is zeroed and the decay, moment weights and step size become neutral, so a
skipped step changes nothing, with no host sync. Reselection (:meth:`SelectiveAdamW.reselect`) is
batched per group with fixed shapes, no host sync of its own.

The class keeps the state and the bookkeeping (entries, groups, step counts, gates); the arithmetic
is :mod:`offload.zenflow.adamw`'s, a functional core as in torch.optim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from offload.clipping import grad_norms
from offload.guard import Gate
from offload.mode_base import nbytes
from offload.selection import remap
from offload.zenflow.adamw import AdamWHyper, BiasTable, columns_adamw_, fused_adamw_
from offload.zenflow.column_groups import LOW, ColumnGroup, ColumnSpec, Dropped, stack

NewValues = Callable[[list[tuple[list[str], torch.Tensor]]], list[torch.Tensor]]


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


class SelectiveAdamW:
    """Device-side AdamW over whole tensors and selected columns of 2-D weights (see module doc).

    All entries live on one device. Per step: :meth:`prepare` (gather the selected gradient columns)
    then :meth:`update`, or :meth:`step` for both.
    """

    def __init__(self, hyper: AdamWHyper) -> None:
        self.hyper = hyper
        self._full: dict[str, _Full] = {}
        self._specs: dict[str, ColumnSpec] = {}
        self._groups: list[ColumnGroup] = []
        self._where: dict[str, tuple[ColumnGroup, int]] = {}
        self._steps: torch.Tensor | None = None  # every group's per-column step counts, flat int64
        self._table: BiasTable | None = None
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
        master = like.float().clone() if like.dtype in LOW else None
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
        if param.dtype in LOW:
            src = values if values is not None else param.detach().index_select(1, cols)
            master = src.to(device=param.device, dtype=torch.float32).clone()
        z = torch.zeros((rows, k), dtype=torch.float32, device=param.device)
        steps = torch.zeros(k, dtype=torch.int64, device=param.device)
        self._specs[name] = ColumnSpec(name, param, cols, z, z.clone(), master, steps)

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
        assert self._device is not None
        self._groups, self._steps = stack(list(self._specs.values()), self._device)
        self._where = {name: (grp, j) for grp in self._groups for j, name in enumerate(grp.names)}
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
        total = sum(
            nbytes(t) for e in self._full.values() for t in (e.exp_avg, e.exp_avg_sq, e.master, e.step)
        )
        return total + sum(g.state_bytes() for g in self._groups)

    def memory_parts(self) -> tuple[dict[str, int], int]:
        """Device bytes by component (:mod:`offload.memory`'s names), and of the column scratch."""
        self._build()
        state = {"exp_avg": 0, "exp_avg_sq": 0, "master": 0, "step": 0, "columns": 0}
        for e in self._full.values():
            state["exp_avg"] += nbytes(e.exp_avg)
            state["exp_avg_sq"] += nbytes(e.exp_avg_sq)
            state["master"] += nbytes(e.master)
            state["step"] += nbytes(e.step)
        return state, sum(g.add_memory(state) for g in self._groups)

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
            grp.gather(gate)
        scaled = [grp.grad for grp in self._groups if gate.factor_for(grp.params[0].dtype) is not None]
        if scaled:  # loss-scaled fp16 columns: 1/scale and the clip, in fp32
            assert gate.grad_factor is not None
            torch._foreach_mul_(scaled, gate.grad_factor)
        if not want_sq:
            return None
        dev = self._device
        fulls = [e.param.grad for e in self._full.values() if e.param.grad is not None]
        full_sq = grad_norms(fulls, gate.grad_factor).square().sum() if fulls else torch.zeros((), device=dev)
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
        low_p, low_m, scaled = [], [], []
        for e in self._full.values():
            g = e.param.grad
            if g is None:
                continue
            if e.master is not None:
                p, g = e.master, g.float()
                low_p.append(e.param)
                low_m.append(e.master)
                if gate.factor_for(e.param.dtype) is not None:
                    scaled.append(g)
            else:
                p = e.param
            params.append(p)
            grads.append(g if g.is_contiguous() else g.contiguous())
            ms.append(e.exp_avg)
            vs.append(e.exp_avg_sq)
            steps.append(e.step)
        if not params:
            return
        if scaled:  # fp32 copies of loss-scaled fp16 gradients
            assert gate.grad_factor is not None
            torch._foreach_mul_(scaled, gate.grad_factor)
        fused_adamw_(params, grads, ms, vs, steps, h, gate)
        if low_p:
            torch._foreach_copy_(low_p, low_m)

    def _update_groups(self, h: AdamWHyper, gate: Gate) -> None:
        """Count the steps of the columns the update reaches, look up their bias corrections, run
        :func:`~offload.zenflow.adamw.columns_adamw_` and scatter the new columns back."""
        groups = self._groups
        steps = self._steps
        assert steps is not None and self._device is not None
        dev = self._device
        if self._table is None:
            self._table = BiasTable(h.beta1, h.beta2, dev)
        self._table.ensure(self._calls)
        shared = not any(grp.missing for grp in groups)
        gks: list[torch.Tensor] = []
        if shared:
            steps.add_(gate.as_(torch.int64))
        else:  # some entry has no gradient: it is gated off like a skipped step
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

        def per_group(flat: torch.Tensor, grp: ColumnGroup) -> torch.Tensor:
            return flat.narrow(0, grp.off, grp.n * grp.k).view(grp.n, 1, grp.k)

        nss_g = [per_group(nss, grp) for grp in groups]
        bc2_g = [per_group(bc2f, grp) for grp in groups]
        if not shared:
            nss_g = [torch.where(gk, s, 0.0) for gk, s in zip(gks, nss_g, strict=True)]
        if self._consts is None:
            self._consts = (
                torch.full((), 1 - h.beta1, dtype=torch.float32, device=dev),
                torch.full((), h.beta2, dtype=torch.float32, device=dev),
            )
        columns_adamw_(
            [grp.target for grp in groups],
            [grp.grad for grp in groups],
            [grp.exp_avg for grp in groups],
            [grp.exp_avg_sq for grp in groups],
            nss_g,
            bc2_g,
            gate.ok if shared else gks,
            h,
            self._consts,
        )
        for grp in groups:
            grp.scatter()

    # --- reselection ----------------------------------------------------------------------------
    @torch.no_grad()
    def reselect(
        self,
        new_values: NewValues | None = None,
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
            new = grp.choose(given_scores)
            if fresh:
                present = torch.zeros(new.shape, dtype=torch.bool, device=grp.cols.device)
                pos = torch.zeros_like(new)
            else:
                present, pos = remap(grp.cols, new)
            plans.append((grp, new, present, pos))
        low = [(grp.names, new) for grp, new, _, _ in plans if grp.low]
        values = iter(new_values(low)) if low and new_values is not None else None
        dropped = []
        for grp, new, present, pos in plans:
            base = next(values) if grp.master is not None and values is not None else None
            d = grp.move_to(new, present, pos, base, fresh=fresh)
            if d is not None:
                dropped.append(d)
        return dropped

    # --- persistence ----------------------------------------------------------------------------
    def state_dict(self, copy: bool = True) -> dict[str, dict[str, object]]:
        """The device optimizer's state: CPU copies, or (``copy=False``) its own device tensors, valid until
        the next step, for a checkpoint written one tensor at a time (no host copy of the whole state)."""
        self._build()

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.cpu().clone() if copy else t

        out: dict[str, dict[str, object]] = {}
        for n, e in self._full.items():
            out[n] = {
                "cols": None,
                "exp_avg": own(e.exp_avg),
                "exp_avg_sq": own(e.exp_avg_sq),
                "master": None if e.master is None else own(e.master),
                "steps": int(e.step),
            }
        for grp in self._groups:
            for j, n in enumerate(grp.names):
                out[n] = grp.state(j, copy)
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
            top = max(top, self._specs[n].load(cols, exp_avg, exp_avg_sq, master_t, steps))
        self._calls = max(self._calls, top)
