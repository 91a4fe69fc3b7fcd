"""fp16 loss scaling keeps small gradients (offload.guard): the fp16 gradients stay scaled and every fp32
stage applies ``coef / scale``, so what each mode's optimizer state and window accumulator receive
matches an fp32 reference computed from the same gradients, where unscaling in fp16 loses them.

The gradients are set directly: ``scale * g`` rounded to fp16 (what backpropagating a scaled loss
gives), ``g`` normal with median |g| 1.9e-7 (the measurement of issue 22: 8.7% of such values are
zero in fp16 and the rest lose ~6% of their value to subnormal rounding).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from offload.clipping import clip_reduced_
from offload.collectives import EngineGroup, Reduced
from offload.config import EngineConfig
from offload.engine import ZenFlowEngine

HYPER: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
SHAPES = {"w1": (64, 256), "w2": (48, 128), "b": (64,)}  # two split weights and a 1-D param
SIGMA = 2.8e-7  # median |N(0, SIGMA)| = 0.674 SIGMA = 1.9e-7
#: fp16 keeps 11 significant bits: a result rounded to fp16 is within 2**-11 of its value
FP16_ROUNDING = 2.0**-11


def _params(seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, torch.nn.Parameter((0.02 * torch.randn(s, generator=gen)).half())) for n, s in SHAPES.items()]


def _set_grads(
    named: list[tuple[str, torch.nn.Parameter]], scale: float, step: int
) -> dict[str, torch.Tensor]:
    """``.grad := fp16(scale * g)`` (params of other dtypes: that divided by ``scale``); returns the fp32
    gradients the engine was given (exact: scale is a power of two and every ``scale * g`` a normal
    fp16 number)."""
    gen = torch.Generator().manual_seed(100 + step)
    seen = {}
    for n, p in named:
        scaled = (SIGMA * torch.randn(p.shape, generator=gen) * scale).half()
        seen[n] = scaled.float() / scale
        p.grad = scaled if p.dtype == torch.float16 else seen[n].to(p.dtype)  # others: unscaled
    return seen


def _lost_and_error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Fraction of the reference's nonzero entries that came out zero, and the relative L2 error."""
    nonzero = ref != 0
    lost = float(((got == 0) & nonzero).sum()) / max(1, int(nonzero.sum()))
    err = float((got.double() - ref.double()).norm() / ref.double().norm())
    return lost, err


def _check(got: torch.Tensor, ref: torch.Tensor, figures: list[tuple[float, float]]) -> None:
    lost, err = _lost_and_error(got, ref)
    figures.append((lost, err))
    assert lost <= 1e-3, f"{lost:.2%} of the entries underflowed to zero"
    assert err <= FP16_ROUNDING, f"relative error {err:.2e}"


def _engine(named: list[tuple[str, torch.nn.Parameter]], **kw: Any) -> ZenFlowEngine:
    cfg = EngineConfig(cpu_threads=2, bind_worker_cores=False, **{**HYPER, **kw})
    return ZenFlowEngine(named, cfg)


def test_device_mode_moments_match_fp32() -> None:
    named = _params()
    figures: list[tuple[float, float]] = []
    with _engine(named, mode="device") as eng:
        scale = eng.loss_scale
        assert scale == 2.0**16
        seen = _set_grads(named, scale, 0)
        m = eng.step()
        assert not m.skipped
        mode: Any = eng._mode
        for n, _ in named:
            st = mode.opt.state[mode.masters[n]]
            _check(st["exp_avg"], 0.1 * seen[n], figures)  # (1 - beta1) * g at the first step
            _check(st["exp_avg_sq"], 0.001 * seen[n].square(), figures)


def test_clipping_coefficient_is_folded_in_fp32() -> None:
    """A clipping coefficient well below 1 multiplies the fp32 copies, not the fp16 gradients."""
    named = _params()
    figures: list[tuple[float, float]] = []
    with _engine(named, mode="device", max_grad_norm=1e-6) as eng:
        seen = _set_grads(named, eng.loss_scale or 0.0, 0)
        total = torch.linalg.vector_norm(torch.stack([g.norm() for g in seen.values()]))
        coef = 1e-6 / (float(total) + 1e-6)
        assert coef < 0.05
        m = eng.step()
        assert m.grad_norm == pytest.approx(float(total), rel=1e-5)
        mode: Any = eng._mode
        for n, _ in named:
            _check(mode.opt.state[mode.masters[n]]["exp_avg"], 0.1 * coef * seen[n], figures)


def test_offload_mode_host_step_matches_fp32() -> None:
    named = _params()
    figures: list[tuple[float, float]] = []
    with _engine(named, mode="offload") as eng:
        seen = _set_grads(named, eng.loss_scale or 0.0, 0)
        eng.step()
        store, group = eng._mode.groups[0]  # type: ignore[attr-defined]
        ref = torch.cat([seen[n].reshape(-1) for n, _ in group])
        _check(store.exp_avg, 0.1 * ref, figures)
        # the new weights: the fp32 master rounded to fp16
        for i, (_, p) in enumerate(group):
            assert torch.equal(p.detach(), store.shaped(store.master, i).half())


@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_zenflow_window_and_columns_match_fp32(accumulate_on: str) -> None:
    """One step of a two-step window: the window accumulator holds half the step's gradient (fp32 for
    fp16 parameters), the selected columns' and the 1-D param's moments (1 - beta1) g; after the
    boundary the host moments hold (1 - beta1) times the window mean."""
    named = _params()
    figures: list[tuple[float, float]] = []
    cfg = {"mode": "zenflow", "topk_ratio": 0.25, "update_interval": 2, "select_interval": 100}
    with _engine(named, accumulate_on=accumulate_on, overlap_step=False, **cfg) as eng:
        mode: Any = eng._mode
        scale = eng.loss_scale or 0.0
        seen = _set_grads(named, scale, 0)
        eng.step()
        eng.zero_grad()
        store = mode.stores[0]
        if accumulate_on == "host":
            mode.accumulation.wait_reads()
            acc = store.bufs[mode._acc_index()]
        else:
            acc = torch.cat([s.dacc.reshape(-1) for s in mode.layout.members(store)])
        splits = [s.name for s in mode.layout.members(store)]
        _check(acc, 0.5 * torch.cat([seen[n].reshape(-1) for n in splits]), figures)
        dev = mode.dev.state_dict()
        for n in splits:
            cols = torch.as_tensor(dev[n]["cols"])
            _check(dev[n]["exp_avg"], 0.1 * seen[n][:, cols], figures)
        _check(dev["b"]["exp_avg"], 0.1 * seen["b"], figures)
        seen2 = _set_grads(named, eng.loss_scale or 0.0, 1)
        eng.step()  # the window ends: its CPU step runs and is applied now (overlap_step=False)
        mean = torch.cat([(0.5 * seen[n] + 0.5 * seen2[n]).reshape(-1) for n in splits])
        _check(store.exp_avg, 0.1 * mean, figures)
        assert store.bufs[0].dtype == torch.float32


def test_zenflow_warm_up_step_matches_fp32() -> None:
    named = _params()
    figures: list[tuple[float, float]] = []
    cfg = {"mode": "zenflow", "topk_ratio": 0.25, "update_interval": 2, "full_warm_up_rounds": 1}
    with _engine(named, **cfg) as eng:
        mode: Any = eng._mode
        seen = _set_grads(named, eng.loss_scale or 0.0, 0)
        eng.step()
        store = mode.stores[0]
        splits = [s for s in mode.layout.members(store)]
        _check(store.exp_avg, 0.1 * torch.cat([seen[s.name].reshape(-1) for s in splits]), figures)
        for s in splits:  # the new weights: the fp32 master rounded to fp16
            assert torch.equal(s.param.detach(), store.shaped(store.master, s.index).half())


def test_fp16_skip_leaves_everything_unchanged() -> None:
    """An overflowing scaled gradient still skips the step (the factor of a skipped step is 0, so the
    zeroed gradients add exact zeros) and backs the scale off."""
    named = _params()
    cfg = {"mode": "zenflow", "topk_ratio": 0.25, "update_interval": 3, "accumulate_on": "device"}
    with _engine(named, **cfg) as eng:
        mode: Any = eng._mode
        _set_grads(named, eng.loss_scale or 0.0, 0)
        eng.step()
        before = [s.dacc.clone() for s in mode.layout.splits]
        weights = [p.detach().clone() for _, p in named]
        _set_grads(named, eng.loss_scale or 0.0, 1)
        named[0][1].grad[0, 0] = float("inf")  # type: ignore[index]
        m = eng.step()
        assert m.skipped and eng.loss_scale == 2.0**15
        assert all(torch.equal(a, s.dacc) for a, s in zip(before, mode.layout.splits, strict=True))
        assert all(torch.equal(w, p.detach()) for w, (_, p) in zip(weights, named, strict=True))


def test_clipping_builds_no_index_tensor_per_step(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-parameter norm's index tensors are built once (a host-to-device copy, a sync on CUDA),
    not at every step."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ranks = EngineGroup(group=dist.group.WORLD)
        gen = torch.Generator().manual_seed(0)

        def reduced() -> Reduced:
            a, b, c = (torch.randn(n, generator=gen) for n in (5, 7, 3))
            return Reduced([a], [b, c], [], [(0, a, False), (1, b, True), (2, c, True)], 3)

        total, _ = clip_reduced_(reduced(), 1.0, torch.device("cpu"), ranks)
        assert torch.isfinite(total)

        def no_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise AssertionError("torch.tensor called in a step")

        monkeypatch.setattr(torch, "tensor", no_tensor)
        r = reduced()
        ref = torch.linalg.vector_norm(torch.stack([t.norm() for t in (*r.replicated, *r.shards)]))
        total, _ = clip_reduced_(r, None, torch.device("cpu"), ranks)
        assert float(total) == pytest.approx(float(ref), rel=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chunk", [1 << 30, 1000, 1024 + 7])
def test_host_step_writes_fp16_result_into_its_fp32_accumulator(chunk: int) -> None:
    """The CPU step over an fp32 window accumulator of fp16 parameters leaves the master, moments and
    result exactly as a step over a separate gradient does, the result (the first half of the
    accumulator) being the master rounded to fp16, whether a chunk's results are written by the step
    itself (no unread gradient under them) or right after it."""
    from offload.cpu_adam import adam_step
    from offload.device import HostAllocator
    from offload.host import HostStore

    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(40, 60, generator=gen).half(), torch.randn(2500, generator=gen).half()]
    store = HostStore(params, HostAllocator(pin=False), buffers=2, role="accumulators")
    assert store.bufs[0].dtype == torch.float32
    master, m, v = store.master.clone(), store.exp_avg.clone(), store.exp_avg_sq.clone()
    for step in (1, 2):
        g = 1e-3 * torch.randn(store.numel, generator=gen)
        store.bufs[0].copy_(g)
        kw = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
        for _ in store.adam(store.bufs[0], num_threads=2, chunk=chunk, **kw):  # type: ignore[arg-type]
            pass
        adam_step(master, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
        assert torch.equal(store.master, master) and torch.equal(store.exp_avg, m)
        assert torch.equal(store.exp_avg_sq, v)
        assert torch.equal(store.result(0), master.half())


@pytest.mark.parametrize(
    ("mode", "accumulate_on"), [("offload", "host"), ("zenflow", "host"), ("zenflow", "device")]
)
def test_fp16_host_memory_matches_the_formula(mode: str, accumulate_on: str) -> None:
    """fp16 window accumulators are fp32 (4 B/element each), as offload.memory counts them."""
    from offload.memory import engine_memory

    named = _params()
    cfg = {"mode": mode, "topk_ratio": 0.25, "accumulate_on": accumulate_on}
    with _engine(named, **cfg) as eng:
        measured = eng.memory().host
        formula = engine_memory([p.shape for _, p in named], torch.float16, eng.config, device_type="cpu")
        assert measured == formula.host
        if mode == "zenflow":
            n_split = sum(p.numel() for _, p in named if p.dim() == 2)
            assert measured["accumulators"] == (1 if accumulate_on == "device" else 2) * 4 * n_split


def _fp16_run(mode: str, cfg_kw: dict[str, Any], group: Any = None) -> dict[str, torch.Tensor]:
    from tests.offload.test_engine_distributed import STEPS, _config, _data, _model, _weights

    model = _model(torch.float16)
    with ZenFlowEngine(model, _config(mode, **cfg_kw), process_group=group) as eng:
        for x, y in _data(STEPS, torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            eng.scale_loss(loss).backward()
            eng.step()
            eng.zero_grad()
        return _weights(eng)


def _fp16_rank(rank: int, world: int, out: str, mode: str, cfg_kw: dict[str, Any]) -> None:
    from pathlib import Path

    torch.save(_fp16_run(mode, cfg_kw, dist.group.WORLD), Path(out) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "cfg_kw"), [("zenflow", {}), ("zenflow", {"accumulate_on": "device"}), ("offload", {})]
)
def test_fp16_sharded_is_exactly_the_single_process(tmp_path: Any, mode: str, cfg_kw: dict[str, Any]) -> None:
    """2 gloo ranks on the same data (the mean is the local gradient) with loss-scaled fp16 gradients:
    the reduce-scatter, the sharded norm with 1/scale folded in, the warm-up and window host steps
    with the landed factor change no bit against one process."""
    from tests.dist_ranks import pinned_numerics, run_ranks

    kw = {**cfg_kw, "max_grad_norm": None}
    run_ranks(_fp16_rank, 2, str(tmp_path), mode, kw)
    with pinned_numerics():
        single = _fp16_run(mode, kw)
    got = torch.load(tmp_path / "rank0.pt")
    for k in single:
        assert torch.equal(got[k], single[k]), k


@pytest.mark.parametrize(
    "kw",
    [
        {"mode": "zenflow"},
        {"mode": "zenflow", "accumulate_on": "device"},
        {"mode": "zenflow", "update_interval": "adaptive", "max_update_interval": 3},
        {"mode": "device"},
        {"mode": "offload"},
    ],
    ids=["host-acc", "device-acc", "auto", "device", "offload"],
)
def test_fp16_loss_scaling_adds_no_host_sync(kw: dict[str, Any]) -> None:
    """The folded factor reaches the host through the step's landing: as with bf16, no dispatch-level
    sync on any step and the engine's own reads only where a selection needs fp32 master values."""
    from tests.offload.test_engine_syncs import _count_steps

    base: dict[str, Any] = {"lr": 1e-2, "topk_ratio": 0.25, "update_interval": 2, "select_interval": "epoch"}
    rows = _count_steps(EngineConfig(**{**base, **kw}), torch.float16, 12, epochs=(5,))
    for i, r in enumerate(rows):
        assert r["syncs"] == 0, (i, r["sync_ops"])
        assert r["waits"] == 0
        want = 1 if kw["mode"] == "zenflow" and (r["reselected"] or i == 0) else 0
        assert r["engine_syncs"] == want, i


def test_fp16_auto_windows_end_where_fp32_ones_do() -> None:
    """update_interval="adaptive" weighs selected against unselected gradient mass: with loss-scaled fp16
    gradients both are taken in the same (unscaled) units, so the windows end at the steps an fp32
    engine given the same gradients ends them."""
    cfg = {"mode": "zenflow", "topk_ratio": 0.25, "update_interval": "adaptive", "max_update_interval": 6}
    ends: dict[torch.dtype, list[float]] = {}
    for dtype in (torch.float16, torch.float32):
        named = [(n, torch.nn.Parameter(p.detach().to(dtype))) for n, p in _params()]
        with _engine(named, **cfg) as eng:
            ends[dtype] = []
            for step in range(16):
                _set_grads(named, 2.0**16, step)
                for _, p in named:  # a quarter of the columns carry more (exact: a power of two)
                    if p.dim() == 2:
                        p.grad[:, : p.shape[1] // 4] *= 2  # type: ignore[index]
                eng.step()
                eng.zero_grad()
                ends[dtype].append(eng.counters()["windows"])
    assert ends[torch.float16] == ends[torch.float32]
    assert 2 <= ends[torch.float32][-1] < 16  # windows of several steps, not one per step
