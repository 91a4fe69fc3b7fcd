"""Issue 11, items 1 and 2: the column path after reselections (batched, same numbers as the per-column
reference) and the engine's host syncs per step (none on plain steps and window ends, at most one per
reselection), counted with bench.engine_ops' dispatch counter on CPU."""

from __future__ import annotations

import pytest
import torch

from bench.engine_ops import OpCounter
from offload.config import EngineConfig
from offload.engine import ZenFlowEngine
from offload.zenflow.adamw import AdamWHyper, adamw_, adamw_columns_
from offload.zenflow.selective_adamw import SelectiveAdamW

H = AdamWHyper(1e-2, 0.9, 0.999, 1e-8, 0.1)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's last place (fp32)."""
    spacing = (torch.nextafter(b.abs(), torch.tensor(float("inf"))) - b.abs()).clamp(
        min=torch.finfo(b.dtype).tiny
    )
    return (a - b).abs() / spacing


def _entry(opt: SelectiveAdamW, name: str):
    opt.names()  # builds the groups
    return opt._where[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_counts_update_each_column_like_its_own_adamw(dtype: torch.dtype) -> None:
    """Several weights of two shapes (two groups), reselected twice so columns carry three different
    step counts: every selected column equals torch's single-tensor AdamW run on that column alone from
    the step it was selected (bitwise), and the fp64-pow per-column reference within 1 ulp."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (5, 12), "b": (5, 12), "c": (7, 10)}
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for n, s in shapes.items()}
    k = 4
    opt = SelectiveAdamW(H)
    ref: dict[str, dict[int, list]] = {}  # name -> column -> [fp32 value, m, v, step]

    def select(n: str, cols: list[int]) -> None:
        old = ref.get(n, {})
        p = params[n].detach().float()
        ref[n] = {
            c: old.get(c) or [p[:, c].clone(), torch.zeros(shapes[n][0]), torch.zeros(shapes[n][0]), 0]
            for c in cols
        }

    for n, p in params.items():
        cols = list(range(k))
        opt.add_columns(n, p, torch.tensor(cols))
        select(n, cols)
    step = 0
    for phase in range(3):
        for _ in range(3):
            step += 1
            grads = {n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}
            expect_cols = {}
            for n, p in params.items():
                p.grad = grads[n]
                for c, st in ref[n].items():
                    st[3] += 1
                    col, m, v = st[0].unsqueeze(1), st[1].unsqueeze(1), st[2].unsqueeze(1)
                    adamw_(col, grads[n][:, c].float().unsqueeze(1), m, v, st[3], H)
                    st[0], st[1], st[2] = col.squeeze(1), m.squeeze(1), v.squeeze(1)
                expect_cols[n] = {c: st[0].to(dtype) for c, st in ref[n].items()}
            # the fp64-pow per-column reference, from the state before this step
            before = {}
            for n, p in params.items():
                grp, j = _entry(opt, n)
                cols = opt.columns(n)
                before[n] = (
                    p.detach().float().index_select(1, cols),
                    grp.exp_avg[j].clone(),
                    grp.exp_avg_sq[j].clone(),
                    grp.steps[j].double() + 1,
                )
            opt.step()
            for n, p in params.items():
                cols = opt.columns(n).tolist()
                assert sorted(expect_cols[n]) == cols
                for c in cols:
                    assert torch.equal(p.detach()[:, c], expect_cols[n][c]), (n, c, step)
                if dtype == torch.float32:
                    pw, m, v, steps = before[n]
                    adamw_columns_(pw, grads[n].index_select(1, torch.tensor(cols)), m, v, steps, H)
                    assert _ulps(p.detach()[:, cols], pw).max() <= 1
        if phase < 2:  # reselect: columns whose gradient is largest, a different set each time
            scale = torch.ones(12)
            scale[[2, 5, 8, 11] if phase == 0 else [2, 5, 9, 10]] = 50.0  # 2 stays, 5 stays from phase 0
            for n, p in params.items():
                p.grad = torch.randn(shapes[n], generator=gen).to(dtype) * scale[: shapes[n][1]].to(dtype)
            opt.reselect()
            for n in params:
                select(n, opt.columns(n).tolist())
    counts = {tuple(sorted(set(_entry(opt, n)[0].steps[_entry(opt, n)[1]].tolist()))) for n in params}
    assert any(len(c) >= 3 for c in counts)  # three different step counts side by side


def _mlp(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(20, 12),
        torch.nn.Linear(12, 24),
        torch.nn.GELU(),
        torch.nn.LayerNorm(24),
        torch.nn.Linear(24, 20),
        torch.nn.GELU(),
        torch.nn.Linear(20, 20),
    ).to(dtype)


def _count_steps(
    cfg: EngineConfig, dtype: torch.dtype, steps: int, epochs: tuple[int, ...] = ()
) -> list[dict]:
    model = _mlp(dtype)
    rows = []
    with ZenFlowEngine(model, cfg) as eng:
        eng.new_epoch()
        for i in range(steps):
            if i in epochs:
                eng.new_epoch()
            g = torch.Generator().manual_seed(1000 + i)
            x = torch.randint(0, 20, (16,), generator=g)
            torch.nn.functional.cross_entropy(model(x).float(), (x * 7 + 3) % 20).backward()
            before = eng.counters()
            with OpCounter(eng.is_host_memory) as c:
                eng.step()
            after = eng.counters()
            eng.zero_grad()
            rows.append(
                {
                    "syncs": c.total_syncs,
                    "sync_ops": dict(c.syncs),
                    "kernels": c.kernels,
                    "engine_syncs": after["host_syncs"] - before["host_syncs"],
                    "waits": after["host_waits"] - before["host_waits"],
                    "boundary": after["windows"] > before["windows"],
                    "reselected": after["reselections"] > before["reselections"],
                    "after": before["reselections"] > 0,
                }
            )
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kw",
    [{}, {"accumulate_on": "device"}, {"update_interval": "adaptive", "max_update_interval": 3}],
    ids=["host-acc", "device-acc", "auto"],
)
def test_no_host_sync_on_plain_steps_and_window_ends_at_most_one_per_reselection(
    kw: dict, dtype: torch.dtype
) -> None:
    cfg = EngineConfig(
        mode="zenflow",
        lr=1e-2,
        topk_ratio=0.25,
        update_interval=kw.pop("update_interval", 2),
        select_interval="epoch",
        **kw,
    )
    rows = _count_steps(cfg, dtype, 16, epochs=(5, 10))
    assert sum(r["reselected"] for r in rows) == 2 and sum(r["boundary"] for r in rows) >= 4
    for i, r in enumerate(rows):
        assert r["syncs"] == 0, (i, r["sync_ops"])  # no dispatch-level sync anywhere
        assert r["waits"] == 0  # every landed read had landed (always so on CPU)
        # bf16: the new columns' fp32 master values, at the first selection and at each reselection
        want = 1 if (r["reselected"] or i == 0) and dtype == torch.bfloat16 else 0
        assert r["engine_syncs"] == want, i


def test_plain_steps_dispatch_the_same_kernels_before_and_after_a_reselection() -> None:
    cfg = EngineConfig(mode="zenflow", lr=1e-2, topk_ratio=0.25, update_interval=3, select_interval=3)
    rows = _count_steps(cfg, torch.float32, 14)
    steady = {r["kernels"] for r in rows[1:] if not r["boundary"] and not r["after"]}
    after = {r["kernels"] for r in rows if not r["boundary"] and r["after"]}
    assert steady and after and steady == after and len(steady) == 1


def test_the_counter_tells_device_reads_from_host_reads() -> None:
    with ZenFlowEngine(_mlp(torch.float32), EngineConfig(mode="zenflow")) as eng:
        host = eng._ops.host.empty(3, torch.float32)
        dev = torch.ones(3)
        with OpCounter(eng.is_host_memory) as c:
            float(host[0])
            assert c.total_syncs == 0
            float(dev.sum())
            torch.equal(dev, dev)
            dev[dev > 0]
        assert c.syncs == {"_local_scalar_dense": 1, "equal": 1, "index": 1}
