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

from dataclasses import dataclass, field, replace

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
    #: Step count: an int while every owned element shares it (whole tensors always), else a CPU int64
    #: tensor ``[k]`` with one count per column.
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

    def column_steps(self) -> torch.Tensor:
        """Per-column step counts (CPU int64 ``[k]``) of a column entry."""
        assert self.cols is not None
        if isinstance(self.steps, int):
            return torch.full((self.cols.numel(),), self.steps, dtype=torch.int64)
        return self.steps


def _compact_steps(steps: torch.Tensor) -> int | torch.Tensor:
    """``steps`` as one int when all its (CPU) counts are equal."""
    if steps.numel() and int(steps.min()) == int(steps.max()):
        return int(steps[0])
    return steps


def _is_low_precision(t: torch.Tensor) -> bool:
    return t.dtype in (torch.bfloat16, torch.float16)


#: Elements per batch of the multi-tensor update: bounds the batch's temporaries (``sqrt(v)`` and the
#: gathered gradient columns, fp32) to a few GiB; one batch covers every parameter of a ~1B model's
#: selected part.
_BATCH_ELEMENTS = 1 << 28


@dataclass(slots=True)
class _Batch:
    """Entries whose AdamW runs as one sequence of ``torch._foreach_*`` ops (fp32, one device)."""

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    #: Column entries and the fp32 tensor their update lands in (written back into the param after).
    scatter: list[tuple[_Entry, torch.Tensor]] = field(default_factory=list)
    #: Low-precision whole params and their fp32 masters (the param gets the rounded master after).
    low_params: list[torch.Tensor] = field(default_factory=list)
    low_masters: list[torch.Tensor] = field(default_factory=list)
    #: Positions in the lists of whole-tensor / column entries (for the squared norms).
    full_at: list[int] = field(default_factory=list)
    cols_at: list[int] = field(default_factory=list)
    numel: int = 0

    def add(self, e: _Entry, p: torch.Tensor, g: torch.Tensor, step: int) -> None:
        (self.full_at if e.cols is None else self.cols_at).append(len(self.params))
        self.params.append(p)
        self.grads.append(g)
        self.exp_avgs.append(e.exp_avg)
        self.exp_avg_sqs.append(e.exp_avg_sq)
        self.steps.append(step)
        self.numel += p.numel()


def adamw_foreach_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[int],
    h: AdamWHyper,
) -> None:
    """:func:`adamw_` on lists of tensors (one device, fp32), one multi-tensor op per stage.

    The elementwise math and its order are :func:`adamw_`'s, so each tensor ends bitwise as it
    would there (on CPU; CUDA's multi-tensor kernels round like its single-tensor ones up to
    fused-multiply-add contraction).
    """
    if not params:
        return
    if h.weight_decay != 0:
        torch._foreach_mul_(params, 1 - h.lr * h.weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - h.beta1)
    torch._foreach_mul_(exp_avg_sqs, h.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - h.beta2)
    step_f = [float(s) for s in steps]
    neg_step_size = [-(h.lr / (1 - h.beta1**s)) for s in step_f]
    bc2_sqrt = [(1 - h.beta2**s) ** 0.5 for s in step_f]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    if len(set(step_f)) == 1:
        torch._foreach_div_(denom, bc2_sqrt[0])
        torch._foreach_add_(denom, h.eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, value=neg_step_size[0])
    else:
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, h.eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, neg_step_size)


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
        self._entries[name] = _Entry(name, param, cols, z, z.clone(), master, 0)

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
    def step(
        self, lr: float | None = None, *, want_sq: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Update every owned part that has a gradient (params without one are skipped, as in torch).

        Entries are batched per device into multi-tensor AdamW ops (:func:`adamw_foreach_`); column
        entries whose columns have differing step counts (after a reselection) update one by one.
        With ``want_sq`` returns the squared L2 norms of the gradient parts this optimizer used,
        summed over whole-tensor entries and over column entries (device fp32 scalars; no host sync).
        """
        h = self.hyper if lr is None else replace(self.hyper, lr=lr)
        batches: dict[torch.device, _Batch] = {}
        norms_full: list[torch.Tensor] = []
        norms_cols: list[torch.Tensor] = []
        mixed_sq: list[torch.Tensor] = []
        device = torch.device("cpu")
        for e in self._entries.values():
            g = e.param.grad
            if g is None:
                continue
            device = g.device
            if e.cols is None:
                assert isinstance(e.steps, int)
                e.steps += 1
                if e.master is None:
                    p, gf = e.param, g
                else:
                    p, gf = e.master, g.float()
                b = batches.setdefault(g.device, _Batch())
                if e.master is not None:
                    b.low_params.append(e.param)
                    b.low_masters.append(e.master)
                b.add(e, p, gf, e.steps)
            else:
                gf = g.index_select(1, e.cols).float()
                p = e.master if e.master is not None else e.param.index_select(1, e.cols)
                if not isinstance(e.steps, int):
                    self._step_mixed(e, p, gf, h)
                    if want_sq:
                        mixed_sq.append(gf.square().sum())
                    continue
                e.steps += 1
                b = batches.setdefault(g.device, _Batch())
                b.scatter.append((e, p))
                b.add(e, p, gf, e.steps)
            if b.numel >= _BATCH_ELEMENTS:
                self._run_batch(batches.pop(g.device), h, norms_full, norms_cols, want_sq)
        for b in batches.values():
            self._run_batch(b, h, norms_full, norms_cols, want_sq)
        if not want_sq:
            return None

        def total(norms: list[torch.Tensor], extra: list[torch.Tensor]) -> torch.Tensor:
            parts = [torch.stack(norms).square().sum()] if norms else []
            parts += extra
            if not parts:
                return torch.zeros((), device=device)
            return parts[0] if len(parts) == 1 else torch.stack(parts).sum()

        return total(norms_full, []), total(norms_cols, mixed_sq)

    @staticmethod
    def _run_batch(
        b: _Batch, h: AdamWHyper, norms_full: list[torch.Tensor], norms_cols: list[torch.Tensor], want_sq: bool
    ) -> None:
        if want_sq:  # of the gradient as used (before the step; the grads are not modified by it)
            norms = torch._foreach_norm(b.grads)
            norms_full += [norms[i] for i in b.full_at]
            norms_cols += [norms[i] for i in b.cols_at]
        adamw_foreach_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.steps, h)
        if b.low_params:
            torch._foreach_copy_(b.low_params, b.low_masters)
        for e, p in b.scatter:
            assert e.cols is not None
            e.param.index_copy_(1, e.cols, p.to(e.param.dtype))

    @staticmethod
    def _step_mixed(e: _Entry, p: torch.Tensor, gs: torch.Tensor, h: AdamWHyper) -> None:
        """A column entry whose columns have differing step counts: per-column bias corrections."""
        assert isinstance(e.steps, torch.Tensor) and e.cols is not None
        e.steps += 1
        if e.steps_dev is None:
            e.steps_dev = e.steps.to(device=p.device, dtype=torch.float64)
        else:
            e.steps_dev.add_(1)
        adamw_columns_(p, gs, e.exp_avg, e.exp_avg_sq, e.steps_dev, h)
        e.param.index_copy_(1, e.cols, p.to(e.param.dtype))

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
        old_steps = e.column_steps()
        steps = torch.zeros(k, dtype=torch.int64)
        present_cpu = present.cpu()
        steps[present_cpu] = old_steps[pos.cpu()[present_cpu]]
        e.steps = _compact_steps(steps)
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
                "steps": e.steps if e.cols is None else e.column_steps().clone(),
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
            e.steps = int(steps) if isinstance(steps, int) else _compact_steps(torch.as_tensor(steps).clone())
            e.steps_dev = None
