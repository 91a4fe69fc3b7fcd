"""AdamW on the device for whole tensors and for a selected subset of a 2-D weight's columns.

Math: the operation order of ``torch.optim.AdamW``'s single-tensor path (decoupled weight decay,
``lerp`` first moment, ``mul/addcmul`` second moment, Python-float bias corrections), so a whole
fp32 tensor, or a 2-D weight with every column selected, updates bitwise like torch.

Selected columns (see :mod:`offload.selection` for the column convention): moments are ``[rows, k]``
fp32 tensors that cover only the selected columns. Each column carries its own step count, so after
a reselection the columns that stay selected keep their moments and bias correction, and newly
selected columns start from zero moments at step 0; while all columns share one count (the common
case) the scalar torch path is used. Parameters held in bf16/fp16 get an fp32 master copy of the
part this optimizer owns (the whole tensor, or the selected columns), written back rounded each step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from offload.selection import difference, remap


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
    """AdamW on ``[rows, k]`` tensors whose columns have individual step counts ``steps``.

    ``steps``: float64 ``[k]`` on ``p``'s device (bias corrections are computed there in fp64, so no
    per-step host-to-device copy is needed).
    """
    if h.weight_decay != 0:
        p.mul_(1 - h.lr * h.weight_decay)
    m.lerp_(g, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    step_size = (h.lr / (1 - torch.pow(h.beta1, steps))).to(torch.float32)
    bc2_sqrt = (1 - torch.pow(h.beta2, steps)).sqrt().to(torch.float32)
    denom = (v.sqrt() / bc2_sqrt.unsqueeze(0)).add_(h.eps)
    p.addcdiv_(m * step_size.unsqueeze(0), denom, value=-1.0)


@dataclass(slots=True)
class _Entry:
    name: str
    param: torch.Tensor
    #: Sorted selected columns (on the param's device), or None when the whole tensor is owned here.
    cols: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    #: fp32 copy of the owned part when the param is bf16/fp16 (None for fp32 params).
    master: torch.Tensor | None
    #: Step count: an int for whole tensors, a CPU int64 tensor [k] (one per column) for column entries.
    steps: int | torch.Tensor
    #: Device fp64 copy of ``steps`` while the counts differ between columns (None = rebuild from ``steps``).
    steps_dev: torch.Tensor | None = None

    def owned_fp32(self) -> torch.Tensor:
        """Current fp32 value of the owned part (a fresh tensor for column entries of fp32 params)."""
        if self.master is not None:
            return self.master
        if self.cols is None:
            return self.param
        return self.param.index_select(1, self.cols)


def _is_low_precision(t: torch.Tensor) -> bool:
    return t.dtype in (torch.bfloat16, torch.float16)


class SelectiveAdamW:
    """Device-side AdamW over whole tensors and selected columns of 2-D weights (see module doc)."""

    def __init__(self, hyper: AdamWHyper) -> None:
        self.hyper = hyper
        self._entries: dict[str, _Entry] = {}

    # --- registration ---------------------------------------------------------------------------
    def add_full(self, name: str, param: torch.Tensor) -> None:
        """Own the whole of ``param`` (1-D params, and 2-D weights whose every column is selected)."""
        master = param.detach().float().clone() if _is_low_precision(param) else None
        like = param.detach()
        self._entries[name] = _Entry(
            name,
            param,
            None,
            torch.zeros(like.shape, dtype=torch.float32, device=like.device),
            torch.zeros(like.shape, dtype=torch.float32, device=like.device),
            master,
            0,
        )

    def add_columns(
        self, name: str, param: torch.Tensor, cols: torch.Tensor, values: torch.Tensor | None = None
    ) -> None:
        """Own the columns ``cols`` (sorted, on the param's device) of 2-D ``param``.

        ``values``: fp32 ``[rows, k]`` starting values of those columns for a bf16/fp16 param (e.g. the
        CPU master's, which carry more precision than the device copy); default: the param's own.
        """
        if param.dim() != 2:
            raise ValueError(f"{name}: column selection needs a 2-D weight, got {tuple(param.shape)}")
        cols = cols.to(device=param.device, dtype=torch.int64)
        rows, k = param.shape[0], cols.numel()
        master = None
        if _is_low_precision(param):
            src = values if values is not None else param.detach().index_select(1, cols)
            master = src.to(device=param.device, dtype=torch.float32).clone()
        z = torch.zeros((rows, k), dtype=torch.float32, device=param.device)
        self._entries[name] = _Entry(
            name, param, cols, z, z.clone(), master, torch.zeros(k, dtype=torch.int64)
        )

    # --- queries --------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._entries)

    def columns(self, name: str) -> torch.Tensor | None:
        return self._entries[name].cols

    def owned_fp32(self, name: str) -> torch.Tensor:
        return self._entries[name].owned_fp32()

    def state_bytes(self) -> int:
        """Device bytes of moments, fp32 masters and index tensors."""
        total = 0
        for e in self._entries.values():
            for t in (e.exp_avg, e.exp_avg_sq, e.master, e.cols):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    # --- the update -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float | None = None, *, want_sq: bool = False) -> list[torch.Tensor] | None:
        """Update every owned part that has a gradient (params without one are skipped, as in torch).

        With ``want_sq`` returns, per entry with a gradient, the squared L2 norm of the gradient part
        this optimizer used (device fp32 scalars; the caller reads them in one sync).
        """
        h = self.hyper if lr is None else replace(self.hyper, lr=lr)
        sq: list[torch.Tensor] = []
        for e in self._entries.values():
            g = e.param.grad
            if g is None:
                continue
            if e.cols is None:
                self._step_full(e, g, h)
                if want_sq:
                    sq.append(g.float().square().sum())
            else:
                gs = g.index_select(1, e.cols).float()
                self._step_cols(e, gs, h)
                if want_sq:
                    sq.append(gs.square().sum())
        return sq if want_sq else None

    @staticmethod
    def _step_full(e: _Entry, g: torch.Tensor, h: AdamWHyper) -> None:
        assert isinstance(e.steps, int)
        e.steps += 1
        if e.master is None:
            adamw_(e.param.data, g, e.exp_avg, e.exp_avg_sq, e.steps, h)
        else:
            adamw_(e.master, g.float(), e.exp_avg, e.exp_avg_sq, e.steps, h)
            e.param.data.copy_(e.master)

    @staticmethod
    def _step_cols(e: _Entry, gs: torch.Tensor, h: AdamWHyper) -> None:
        assert isinstance(e.steps, torch.Tensor) and e.cols is not None
        e.steps += 1
        p = e.master if e.master is not None else e.param.data.index_select(1, e.cols)
        lo, hi = int(e.steps.min()), int(e.steps.max())
        if lo == hi:
            e.steps_dev = None
            adamw_(p, gs, e.exp_avg, e.exp_avg_sq, lo, h)
        else:
            if e.steps_dev is None:
                e.steps_dev = e.steps.to(device=p.device, dtype=torch.float64)
            else:
                e.steps_dev.add_(1)
            adamw_columns_(p, gs, e.exp_avg, e.exp_avg_sq, e.steps_dev, h)
        e.param.data.index_copy_(1, e.cols, p.to(e.param.dtype))

    # --- reselection ----------------------------------------------------------------------------
    @torch.no_grad()
    def reselect(
        self, name: str, new_cols: torch.Tensor, values: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Switch ``name`` to the sorted columns ``new_cols``.

        Columns kept keep their moments, step counts and fp32 master values; new columns start with
        zero moments at step 0, their fp32 master from ``values`` (fp32 ``[rows, k_new]`` aligned with
        ``new_cols``; only its new columns are read) or the param. Returns ``(dropped, dropped_fp32)``:
        the columns no longer selected and their newest fp32 values ``[rows, n_dropped]`` (device).
        """
        e = self._entries[name]
        if e.cols is None:
            raise ValueError(f"{name}: whole-tensor entry has no column selection")
        old = e.cols
        new_cols = new_cols.to(device=old.device, dtype=torch.int64)
        dropped = difference(old, new_cols)
        if e.master is not None:
            _, pos_dropped = remap(old, dropped)
            dropped_fp32 = e.master.index_select(1, pos_dropped)
        else:
            dropped_fp32 = e.param.data.index_select(1, dropped).float()
        if torch.equal(old, new_cols):
            return dropped, dropped_fp32
        present, pos = remap(old, new_cols)
        keep = present.nonzero().squeeze(1)
        src = pos.index_select(0, keep)
        rows, k = e.param.shape[0], new_cols.numel()
        dev = e.param.device

        def carry(old_t: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
            fresh.index_copy_(1, keep, old_t.index_select(1, src))
            return fresh

        e.exp_avg = carry(e.exp_avg, torch.zeros((rows, k), dtype=torch.float32, device=dev))
        e.exp_avg_sq = carry(e.exp_avg_sq, torch.zeros((rows, k), dtype=torch.float32, device=dev))
        if e.master is not None:
            base = values if values is not None else e.param.data.index_select(1, new_cols)
            e.master = carry(e.master, base.to(device=dev, dtype=torch.float32).clone())
        assert isinstance(e.steps, torch.Tensor)
        steps = torch.zeros(k, dtype=torch.int64)
        present_cpu = present.cpu()
        steps[present_cpu] = e.steps[pos.cpu()[present_cpu]]
        e.steps = steps
        e.steps_dev = None
        e.cols = new_cols
        return dropped, dropped_fp32

    # --- persistence ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for n, e in self._entries.items():
            out[n] = {
                "cols": None if e.cols is None else e.cols.cpu().clone(),
                "exp_avg": e.exp_avg.cpu().clone(),
                "exp_avg_sq": e.exp_avg_sq.cpu().clone(),
                "master": None if e.master is None else e.master.cpu().clone(),
                "steps": e.steps if isinstance(e.steps, int) else e.steps.clone(),
            }
        return out

    def load_state_dict(self, sd: dict[str, dict[str, object]]) -> None:
        if set(sd) != set(self._entries):
            raise ValueError("device optimizer state names do not match this model's parameters")
        for n, s in sd.items():
            e = self._entries[n]
            dev = e.param.device
            cols = s["cols"]
            if (cols is None) != (e.cols is None):
                raise ValueError(f"{n}: saved state owns a different part of the parameter")
            e.cols = None if cols is None else torch.as_tensor(cols).to(dev)
            e.exp_avg = torch.as_tensor(s["exp_avg"]).to(dev).clone()
            e.exp_avg_sq = torch.as_tensor(s["exp_avg_sq"]).to(dev).clone()
            master = s["master"]
            e.master = None if master is None else torch.as_tensor(master).to(dev).clone()
            steps = s["steps"]
            e.steps = int(steps) if isinstance(steps, int) else torch.as_tensor(steps).clone()
            e.steps_dev = None
