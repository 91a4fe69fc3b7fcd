"""offload.zenflow.column_groups: column entries of equal ``[rows, k]`` shape and dtype are stacked into
one group sharing the flat step counts; a group gathers the selected gradient columns (zero for a skipped
step or a missing gradient), scatters updated columns back into exactly those columns, picks the top-k
columns by score, and moves its state to a new selection (kept columns keep theirs, new ones start at
zero from the given values, dropped ones are reported with their values)."""

from __future__ import annotations

import torch

from offload.guard import Gate
from offload.selection import column_scores, remap
from offload.zenflow.column_groups import ColumnGroup, ColumnSpec, stack
from tests.offload.zenflow.support import CPU


def _spec(
    name: str, rows: int, cols: list[int], dtype: torch.dtype = torch.float32, step: int = 0
) -> ColumnSpec:
    """A spec of a ``[rows, 8]`` parameter with distinct moments (filled from its name) and step counts."""
    p = torch.nn.Parameter(torch.randn(rows, 8).to(dtype))
    k = len(cols)
    fill = float(len(name) + ord(name[0]))
    m = torch.full((rows, k), fill)
    master = p.detach()[:, cols].float() if dtype != torch.float32 else None
    steps = torch.arange(step, step + k, dtype=torch.int64)
    return ColumnSpec(name, p, torch.tensor(cols), m, m * 2, master, steps)


def _group(*specs: ColumnSpec) -> ColumnGroup:
    groups, _ = stack(list(specs), CPU)
    assert len(groups) == 1
    return groups[0]


def test_stack_batches_entries_of_equal_shape_and_dtype() -> None:
    """Equal ``[rows, k]`` and dtype: one group; another k, another row count or another dtype: groups of
    their own. Every group's step counts are a view of one flat tensor, in stacking order."""
    a, b = _spec("a", 3, [1, 2], step=5), _spec("b", 3, [0, 7], step=9)
    c = _spec("c", 3, [1, 2, 3])
    d = _spec("d", 4, [1, 2])
    e = _spec("e", 3, [1, 2], torch.bfloat16)
    groups, steps = stack([a, c, b, d, e], CPU)
    assert [g.names for g in groups] == [["a", "b"], ["c"], ["d"], ["e"]]
    ab = groups[0]
    assert (ab.n, ab.rows, ab.k, ab.off) == (2, 3, 2, 0)
    assert ab.cols.tolist() == [[1, 2], [0, 7]]
    assert torch.equal(ab.exp_avg, torch.stack([a.exp_avg, b.exp_avg]))
    assert torch.equal(ab.exp_avg_sq, torch.stack([a.exp_avg_sq, b.exp_avg_sq]))
    assert [g.off for g in groups] == [0, 4, 7, 9]
    assert steps.numel() == 11 and steps[:4].tolist() == [5, 6, 9, 10]
    steps[0] = 42  # one flat tensor: the group's steps are a view of it
    assert ab.steps[0, 0].item() == 42
    assert ab.master is None and ab.work is not None and ab.lp is None
    low = groups[3]
    assert low.low and low.master is not None and torch.equal(low.master[0], e.master)
    assert low.lp is not None and low.lp.dtype == torch.bfloat16 and low.work is None


@torch.no_grad()  # as the device optimizer calls it
def test_gather_takes_the_selected_gradient_columns_in_fp32() -> None:
    """fp32: the gradient's and the parameter's selected columns; an entry without gradient is listed
    missing and gathers zeros; a skipped step gathers zeros everywhere."""
    a, b = _spec("a", 3, [1, 6]), _spec("b", 3, [0, 2])
    grp = _group(a, b)
    a.param.grad = torch.randn(3, 8)
    grp.gather(Gate.always(CPU))
    assert grp.missing == [1]
    assert torch.equal(grp.grad[0], a.param.grad[:, [1, 6]]) and not grp.grad[1].any()
    assert grp.work is not None and torch.equal(grp.work[0], a.param.detach()[:, [1, 6]])
    b.param.grad = torch.randn(3, 8)
    grp.gather(Gate(torch.tensor(False)))
    assert grp.missing == [] and not grp.grad.any()


@torch.no_grad()  # as the device optimizer calls it
def test_gather_of_bf16_gradients_widens_them() -> None:
    a = _spec("a", 3, [3, 4], torch.bfloat16)
    grp = _group(a)
    a.param.grad = torch.randn(3, 8).to(torch.bfloat16)
    grp.gather(Gate.always(CPU))
    assert grp.grad.dtype == torch.float32
    assert torch.equal(grp.grad[0], a.param.grad[:, [3, 4]].float())


@torch.no_grad()  # as the device optimizer calls it
def test_scatter_writes_exactly_the_selected_columns() -> None:
    """fp32: the work columns into the parameter's selected columns, nothing else; an entry without
    gradient is not written. bf16: the fp32 master rounded into the selected columns."""
    a, b = _spec("a", 3, [1, 6]), _spec("b", 3, [0, 2])
    before = [s.param.detach().clone() for s in (a, b)]
    grp = _group(a, b)
    a.param.grad = torch.randn(3, 8)
    grp.gather(Gate.always(CPU))
    assert grp.work is not None
    grp.work.add_(100.0)
    grp.scatter()
    after = a.param.detach()
    assert torch.equal(after[:, [1, 6]], before[0][:, [1, 6]] + 100.0)
    rest = [0, 2, 3, 4, 5, 7]
    assert torch.equal(after[:, rest], before[0][:, rest])
    assert torch.equal(b.param.detach(), before[1])  # missing: not written
    assert not grp.fresh  # an entry was missing: work does not hold every entry's values

    low = _spec("l", 3, [3, 4], torch.bfloat16)
    lbefore = low.param.detach().clone()
    lgrp = _group(low)
    low.param.grad = torch.zeros(3, 8).to(torch.bfloat16)
    lgrp.gather(Gate.always(CPU))
    assert lgrp.master is not None
    lgrp.master.fill_(0.1)
    lgrp.scatter()
    assert torch.equal(low.param.detach()[:, [3, 4]], torch.full((3, 2), 0.1).to(torch.bfloat16))
    assert torch.equal(low.param.detach()[:, [0, 1, 2, 5, 6, 7]], lbefore[:, [0, 1, 2, 5, 6, 7]])


def test_choose_ranks_columns_by_given_scores_or_the_gradient() -> None:
    """Entry ``a``: the given scores; ``b``: its gradient's column L1 norms; ``c``: neither, keeps its
    columns. Sorted, ``[n, k]``."""
    a, b, c = _spec("a", 3, [0, 1]), _spec("b", 3, [0, 1]), _spec("c", 3, [2, 5])
    grp = _group(a, b, c)
    a.param.grad = torch.randn(3, 8)  # ignored: given scores win
    b.param.grad = torch.randn(3, 8)
    scores = torch.tensor([0.0, 9.0, 0.0, 0.0, 0.0, 0.0, 8.0, 0.0])
    new = grp.choose({"a": scores})
    assert new[0].tolist() == [1, 6]
    top_b = torch.topk(column_scores(b.param.grad), 2).indices.sort().values
    assert new[1].tolist() == top_b.tolist()
    assert new[2].tolist() == [2, 5]


def test_move_to_keeps_kept_columns_state_and_reports_dropped_ones() -> None:
    """bf16 group ``[[1, 3], [0, 5]] -> [[3, 6], [0, 5]]``: kept columns keep moments, step counts and
    fp32 master; new column 6 starts at zero moments, step 0, its master from ``base``; column 1 is
    reported dropped with its master value; the second entry is unchanged."""
    a = _spec("a", 3, [1, 3], torch.bfloat16, step=4)
    b = _spec("bb", 3, [0, 5], torch.bfloat16, step=7)
    grp = _group(a, b)
    assert grp.master is not None
    grp.exp_avg[0, :, 1] = 3.5  # column 3 of entry a: distinct, to follow it to its new slot
    old_master = grp.master.clone()
    old_m, old_v, old_steps = grp.exp_avg.clone(), grp.exp_avg_sq.clone(), grp.steps.clone()
    new = torch.tensor([[3, 6], [0, 5]])
    present, pos = remap(grp.cols, new)
    base = torch.full((2, 3, 2), -7.0)
    dropped = grp.move_to(new, present, pos, base, fresh=False)
    assert dropped is not None
    assert dropped.cols.tolist() == [[1, 3], [0, 5]]
    assert dropped.mask.tolist() == [[True, False], [False, False]]
    assert torch.equal(dropped.values, old_master)
    assert grp.cols.tolist() == [[3, 6], [0, 5]] and grp.col_views[0].tolist() == [3, 6]
    assert torch.equal(grp.exp_avg[0, :, 0], old_m[0, :, 1]) and not grp.exp_avg[0, :, 1].any()
    assert torch.equal(grp.exp_avg_sq[0, :, 0], old_v[0, :, 1]) and not grp.exp_avg_sq[0, :, 1].any()
    assert torch.equal(grp.master[0, :, 0], old_master[0, :, 1])
    assert torch.equal(grp.master[0, :, 1], base[0, :, 1])
    assert grp.steps.tolist() == [[old_steps[0, 1].item(), 0], old_steps[1].tolist()]
    assert torch.equal(grp.exp_avg[1], old_m[1]) and torch.equal(grp.master[1], old_master[1])


def test_move_to_fresh_starts_every_column_anew_and_reports_nothing() -> None:
    """The first selection after placeholders: every column new (zero state, values from the fp32
    parameter), nothing dropped."""
    a = _spec("a", 3, [0, 1], step=3)
    grp = _group(a)
    new = torch.tensor([[2, 7]])
    present = torch.zeros_like(new, dtype=torch.bool)
    assert grp.move_to(new, present, torch.zeros_like(new), None, fresh=True) is None
    assert grp.cols.tolist() == [[2, 7]]
    assert not grp.exp_avg.any() and not grp.exp_avg_sq.any() and not grp.steps.any()


def test_move_to_reports_fp32_values_from_the_parameter() -> None:
    """fp32 (no master): the dropped values are the parameter's current columns."""
    a = _spec("a", 3, [1, 3])
    grp = _group(a)
    with torch.no_grad():
        a.param[:, 1] = 11.0
    new = torch.tensor([[3, 4]])
    present, pos = remap(grp.cols, new)
    dropped = grp.move_to(new, present, pos, None, fresh=False)
    assert dropped is not None and dropped.mask.tolist() == [[True, False]]
    assert torch.equal(dropped.values[0], a.param.detach()[:, [1, 3]])


def test_spec_and_load_round_trip() -> None:
    """``spec(j)`` takes entry ``j`` out of the group as clones; ``load`` takes a saved entry, one step
    count for every column or one each, and returns the largest."""
    a = _spec("a", 3, [1, 3], torch.bfloat16, step=2)
    grp = _group(a)
    out = grp.spec(0)
    assert out.name == "a" and out.cols.tolist() == [1, 3] and out.steps.tolist() == [2, 3]
    assert torch.equal(out.exp_avg, a.exp_avg) and out.exp_avg.data_ptr() != grp.exp_avg.data_ptr()
    m = torch.ones(3, 3)
    assert out.load([0, 4, 5], m, m, None, 6) == 6
    assert out.cols.tolist() == [0, 4, 5] and out.steps.tolist() == [6, 6, 6]
    assert out.load(torch.tensor([0, 4, 5]), m, m, None, torch.tensor([1, 9, 2])) == 9


def test_state_and_memory_bytes() -> None:
    """Moments 8 B, fp32 master 4 B per selected element; index and step count 8 B each per column;
    scratch: fp32 gradient columns plus a bf16 buffer (4 + 2) or an fp32 work copy (4 + 4)."""
    n, rows, k = 2, 3, 2
    low = _group(_spec("a", rows, [1, 3], torch.bfloat16), _spec("b", rows, [0, 2], torch.bfloat16))
    assert low.state_bytes() == n * rows * k * (8 + 4) + n * k * 16
    state = {"exp_avg": 0, "exp_avg_sq": 0, "master": 0, "step": 0, "columns": 0}
    assert low.add_memory(state) == n * rows * k * (4 + 2)
    assert state == {"exp_avg": 48, "exp_avg_sq": 48, "master": 48, "step": 0, "columns": 64}
    fp32 = _group(_spec("a", rows, [1, 3]))
    assert fp32.state_bytes() == rows * k * 8 + k * 16
    assert fp32.add_memory(dict.fromkeys(state, 0)) == rows * k * 8
