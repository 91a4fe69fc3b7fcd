"""The device optimizer's column entries, stacked into groups (see :mod:`offload.selection` for the
column convention).

Column entries of the same ``[rows, k]`` shape and dtype form a :class:`ColumnGroup` whose moments
(and fp32 master, for bf16/fp16 params) are ``[n, rows, k]`` tensors, entry ``j`` at index ``j``,
with a view of the optimizer's flat per-column step counts. A group gathers its entries' selected
gradient columns into fp32 scratch, scatters the updated columns back into the params, and moves its
state to a new selection (:meth:`ColumnGroup.move_to`: fixed shapes, no host sync). Outside a group an
entry is a :class:`ColumnSpec` (registered or loaded, not yet stacked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from offload.guard import Gate
from offload.mode_base import nbytes
from offload.selection import column_scores, remap

#: Parameter dtypes that get an fp32 master copy on the device.
LOW = (torch.bfloat16, torch.float16)


@dataclass(slots=True)
class ColumnSpec:
    """A column entry outside any group (registered or loaded, not yet stacked)."""

    name: str
    param: torch.Tensor
    cols: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    master: torch.Tensor | None
    steps: torch.Tensor  # int64 [k]

    def load(
        self,
        cols: Any,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        master: torch.Tensor | None,
        steps: Any,
    ) -> int:
        """Take a saved entry's state (``steps``: per column, or one int for all); returns its
        largest step count."""
        dev = self.param.device
        cols_t = torch.as_tensor(cols).to(device=dev, dtype=torch.int64)
        if isinstance(steps, int):
            steps_t = torch.full((cols_t.numel(),), steps, dtype=torch.int64)
        else:
            steps_t = torch.as_tensor(steps).to(torch.int64)
        self.cols, self.exp_avg, self.exp_avg_sq, self.master = cols_t, exp_avg, exp_avg_sq, master
        self.steps = steps_t.to(dev)
        return int(steps_t.max()) if steps_t.numel() else 0


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


def stack(specs: list[ColumnSpec], device: torch.device) -> tuple[list[ColumnGroup], torch.Tensor]:
    """The entries stacked into groups by ``[rows, k]`` shape and dtype, and every group's
    per-column step counts as one flat int64 tensor (each group holds a view of its part)."""
    by_key: dict[tuple[int, int, torch.dtype], list[ColumnSpec]] = {}
    for s in specs:
        by_key.setdefault((s.param.shape[0], s.cols.numel(), s.param.dtype), []).append(s)
    steps = torch.zeros(sum(s.cols.numel() for s in specs), dtype=torch.int64, device=device)
    groups, off = [], 0
    for group in by_key.values():
        grp = ColumnGroup(group, steps, off)
        off += grp.n * grp.k
        groups.append(grp)
    return groups, steps


class ColumnGroup:
    """Column entries of one ``[rows, k]`` shape and param dtype, stacked (see the module doc)."""

    def __init__(self, specs: list[ColumnSpec], steps: torch.Tensor, off: int) -> None:
        p0 = specs[0].param
        n, rows, k = len(specs), p0.shape[0], specs[0].cols.numel()
        dev = p0.device
        self.names = [s.name for s in specs]
        self.params = [s.param for s in specs]
        self.n, self.rows, self.k, self.off = n, rows, k, off
        self.low = p0.dtype in LOW
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
        #: Entries without a gradient at the last gather() (not updated).
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

    def spec(self, j: int) -> ColumnSpec:
        return ColumnSpec(
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

    def add_memory(self, state: dict[str, int]) -> int:
        """Add the group's state bytes into ``state`` (:mod:`offload.memory`'s components); returns its
        scratch bytes."""
        state["exp_avg"] += nbytes(self.exp_avg)
        state["exp_avg_sq"] += nbytes(self.exp_avg_sq)
        state["master"] += nbytes(self.master)
        state["columns"] += nbytes(self.cols) + nbytes(self.steps)
        return nbytes(self.grad) + nbytes(self.lp) + nbytes(self.work)

    # --- a step -----------------------------------------------------------------------------------
    def gather(self, gate: Gate) -> None:
        """This step's selected gradient columns into ``grad`` (fp32; zero when ``gate`` says skip and
        for entries without a gradient, listed in ``missing``); fp32 params: their columns into ``work``."""
        self.missing = []
        src = self.lp_views if self.low else self.grad_views
        for j, p in enumerate(self.params):
            g = p.grad
            if g is None:
                self.missing.append(j)
                continue
            cols = self.col_views[j]
            if g.dtype == src[j].dtype:
                torch.index_select(g, 1, cols, out=src[j])
            else:
                src[j].copy_(g.index_select(1, cols))
            if self.work is not None:
                torch.index_select(p, 1, cols, out=self.work_views[j])
        if self.lp is not None:
            self.grad.copy_(self.lp)
        for j in self.missing:
            self.grad_views[j].zero_()
        self.grad.masked_fill_(gate.bad, 0.0)

    def scatter(self) -> None:
        """The updated columns back into the params (not those of entries without a gradient)."""
        if self.lp is not None:
            self.lp.copy_(self.target)
            src = self.lp_views
        else:
            src = self.work_views
        missing = set(self.missing)
        for j, p in enumerate(self.params):
            if j not in missing:
                p.index_copy_(1, self.col_views[j], src[j])
        self.fresh = not missing

    # --- reselection ------------------------------------------------------------------------------
    def choose(self, given_scores: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """Every entry's top-k columns ``[n, k]`` (sorted) by score: ``given_scores``' where it has
        the entry, else its gradient's; an entry without either keeps its columns."""
        scores = torch.empty((self.n, self.params[0].shape[1]), dtype=torch.float32, device=self.cols.device)
        for j, p in enumerate(self.params):
            g = p.grad
            if given_scores is not None and self.names[j] in given_scores:
                scores[j].copy_(given_scores[self.names[j]])
            elif g is None:  # keep the current columns: they score 1, every other one 0
                scores[j].zero_().index_fill_(0, self.col_views[j], 1.0)
            else:
                column_scores(g, out=scores[j])
        return torch.topk(scores, self.k, dim=1, sorted=False).indices.sort(dim=1).values

    def _columns_of(self, cols: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(
            [p.detach().index_select(1, c).float() for p, c in zip(self.params, cols, strict=True)]
        )

    def move_to(
        self,
        new: torch.Tensor,
        present: torch.Tensor,
        pos: torch.Tensor,
        base: torch.Tensor | None,
        *,
        fresh: bool,
    ) -> Dropped | None:
        """Select ``new`` (``present``/``pos``: where each new column sat in the old selection, as
        :func:`~offload.selection.remap` gives). Kept columns keep their moments, step counts and
        master values; new ones start at zero moments, step 0, their master from ``base`` (fp32
        ``[n, rows, k]``; default the param's values). Returns what was dropped (None if ``fresh``)."""
        n, rows, k = self.n, self.rows, self.k
        dropped = None
        if not fresh:
            kept, _ = remap(new, self.cols)
            if self.master is not None:
                old_vals = self.master
            elif self.fresh and self.work is not None:
                old_vals = self.work
            else:
                old_vals = self._columns_of(self.col_views)
            dropped = Dropped(list(self.names), self.cols, torch.logical_not(kept), old_vals)
        idx = pos.unsqueeze(1).expand(n, rows, k)
        here = present.unsqueeze(1)
        self.exp_avg = torch.where(here, self.exp_avg.gather(2, idx), 0.0)
        self.exp_avg_sq = torch.where(here, self.exp_avg_sq.gather(2, idx), 0.0)
        if self.master is not None:
            start = base if base is not None else self._columns_of(list(new.unbind(0)))
            self.master = torch.where(here, self.master.gather(2, idx), start)
        else:
            self._new_work()  # the old one went out with the dropped values
        self.steps.copy_(torch.where(present, self.steps.gather(1, pos), 0))
        self.cols = new
        self.col_views = _views(new)
        self.fresh = False
        return dropped

    # --- persistence ------------------------------------------------------------------------------
    def state(self, j: int, copy: bool = True) -> dict[str, object]:
        """Member ``j``'s state: CPU copies, or (``copy=False``) views of the group's own tensors, for a
        writer that copies one tensor at a time (offload.state_io)."""

        def out(t: torch.Tensor) -> torch.Tensor:
            return t.cpu().clone() if copy else t

        return {
            "cols": out(self.cols[j]),
            "exp_avg": out(self.exp_avg[j]),
            "exp_avg_sq": out(self.exp_avg_sq[j]),
            "master": None if self.master is None else out(self.master[j]),
            "steps": out(self.steps[j]),
        }
