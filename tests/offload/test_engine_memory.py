"""Issue 12, item 1: the engine's host state (<= 16 bytes per parameter with bf16 parameters), measured
from its tensors by ``engine.memory()``, equal to offload.memory's formula, and in every StepMetrics."""

from __future__ import annotations

import pytest
import torch

from offload.config import EngineConfig
from offload.engine import ZenFlowEngine
from offload.memory import engine_memory

HYPER = {"lr": 1e-2, "weight_decay": 0.1, "topk_ratio": 0.25, "update_interval": 2, "select_interval": 2}
SETTINGS = [("zenflow", "host"), ("zenflow", "device"), ("offload", "host"), ("device", "host")]


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(20, 16),
        torch.nn.Linear(16, 40),
        torch.nn.GELU(),
        torch.nn.LayerNorm(40),
        torch.nn.Linear(40, 20),
    ).to(dtype)


def _step(model: torch.nn.Module, eng: ZenFlowEngine, i: int, *, set_to_none: bool = True):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randint(0, 20, (24,), generator=g)
    torch.nn.functional.cross_entropy(model(x).float(), (x * 7 + 3) % 20).backward()
    m = eng.step()
    eng.zero_grad(set_to_none=set_to_none)
    return m


def _cfg(mode: str, acc: str, **kw: object) -> EngineConfig:
    return EngineConfig(mode=mode, accumulate_on=acc, **{**HYPER, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("mode", "acc"), SETTINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_measured_bytes_equal_the_formula(mode: str, acc: str, dtype: torch.dtype) -> None:
    model = _model(dtype)
    cfg = _cfg(mode, acc)
    shapes = [tuple(p.shape) for p in model.parameters()]
    want = engine_memory(shapes, dtype, cfg, device_type="cpu")
    with ZenFlowEngine(model, cfg) as eng:
        assert eng.memory().host == want.host  # allocated at construction, exactly the formula
        metrics = [_step(model, eng, i) for i in range(5)]  # selected, reselected, a stash pending
        got = eng.memory()
    assert got.params == want.params == sum(p.numel() for p in model.parameters())
    assert got.host == want.host and got.device_state == want.device_state
    for name, size in want.device_buffers.items():
        # the stash is held from a reselection to the next window end only
        assert got.device_buffers[name] == size or (name == "stash" and got.device_buffers[name] < size)
    assert {m.host_bytes for m in metrics} == {want.host_bytes}
    assert (want.host_bytes > 0) == (mode != "device")
    assert got.device_state_bytes == eng.device_optimizer_state_bytes


@pytest.mark.parametrize(("mode", "acc"), SETTINGS[:3])
def test_bf16_host_state_is_at_most_16_bytes_per_param(mode: str, acc: str) -> None:
    model = _model(torch.bfloat16)
    with ZenFlowEngine(model, _cfg(mode, acc)) as eng:
        mem = eng.memory()
    offloaded = mem.host["master"] // 4
    # fp32 master and moments 12, accumulators (zenflow) or the gradient (offload) in bf16
    per_element = {("zenflow", "host"): 16, ("zenflow", "device"): 14, ("offload", "host"): 14}[(mode, acc)]
    assert mem.host_bytes == per_element * offloaded
    assert mem.host_bytes_per_param <= 16


def test_an_8b_model_on_cuda_needs_16_bytes_per_param_plus_a_fixed_ring() -> None:
    """Llama-3-8B's shapes: zenflow's host state is 16 B/param plus the 2 x 8M-element bf16 transfer
    ring (host accumulation) or 14 (device accumulation); offload mode 14."""
    layer = [
        (4096, 4096),
        (1024, 4096),
        (1024, 4096),
        (4096, 4096),
        (14336, 4096),
        (14336, 4096),
        (4096, 14336),
        (4096,),
        (4096,),
    ]
    shapes = layer * 32 + [(128256, 4096), (128256, 4096), (4096,)]
    host = engine_memory(shapes, torch.bfloat16, EngineConfig(), device_type="cuda")
    assert host.host["transfer"] == 2 * (1 << 23) * 2
    assert 16 < host.host_bytes_per_param < 16.01
    for cfg in (EngineConfig(accumulate_on="device"), EngineConfig(mode="offload")):
        assert engine_memory(shapes, torch.bfloat16, cfg).host_bytes_per_param <= 14
    # on a CPU device the gradients are read in place: no ring
    assert engine_memory(shapes, torch.bfloat16, EngineConfig(), device_type="cpu").host["transfer"] == 0


def test_meta_parameters_need_no_memory_to_be_counted() -> None:
    with torch.device("meta"):
        model = _model(torch.bfloat16)
    shapes = [tuple(p.shape) for p in model.parameters()]
    mem = engine_memory(shapes, torch.bfloat16, EngineConfig(**HYPER), device_type="cuda")
    assert mem.host["transfer"] > 0 and mem.device_buffers["landing"] > 0 and mem.as_dict()["host_bytes"] > 0


def test_streaming_gradients_through_the_ring_gives_the_same_weights() -> None:
    """The CUDA path (gradients copied off the device in slot-sized chunks that cross parameter
    boundaries, into a two-slot ring, then added) run on the CPU with a 7-element ring equals reading
    the gradients in place, bitwise; so does zeroing the gradients in place instead of dropping them."""
    results = []
    for variant in ("in-place", "ring", "zero-in-place"):
        model = _model(torch.bfloat16)
        with ZenFlowEngine(model, _cfg("zenflow", "host")) as eng:
            mode = eng._mode
            if variant == "ring":
                mode.accumulation.rings = [
                    [mode.ops.host.empty(7, st.dtype) for _ in range(2)] for st in mode.stores
                ]
            for i in range(7):
                _step(model, eng, i, set_to_none=variant != "zero-in-place")
            eng.flush()
        results.append([p.detach().clone() for p in model.parameters()])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_prometheus_gauge_follows_the_step_record() -> None:
    from prometheus_client import CollectorRegistry

    from worker.metrics.telemetry import WorkerTelemetry

    reg = CollectorRegistry()
    tel = WorkerTelemetry("w1", 0, registry=reg, hostname="h1")
    model = _model(torch.bfloat16)
    with ZenFlowEngine(model, _cfg("zenflow", "host")) as eng:
        m = _step(model, eng, 0)
    base = {"worker": "w1", "hostname": "h1", "gpu": "0"}
    tel.job_started("ftjob-1", base_model="tiny", mode="zenflow")
    tel.observe_step(m, tokens=1, loss=1.0, base_model="tiny", mode="zenflow")
    assert reg.get_sample_value("zenflow_engine_host_memory_bytes", base) == m.host_bytes > 0
    tel.job_finished("succeeded")
    assert reg.get_sample_value("zenflow_engine_host_memory_bytes", base) is None


@pytest.mark.usefixtures("torch_single_thread")
def test_a_job_reports_the_engine_memory_at_start_and_in_every_step(tmp_path) -> None:
    from tests.trainer.run.test_loop import Recorder, make_spec
    from trainer.run.loop import run_training

    rec = Recorder()
    spec = make_spec(
        tmp_path, valid=None, dtype="bfloat16", engine={"mode": "zenflow"}, hyperparameters={"max_steps": 2}
    )
    run_training(spec, on_event=rec)
    (start,) = [e for e in rec.of("log") if e.message.startswith("Engine memory")]
    steps = rec.of("step")
    assert steps and {s.engine.host_bytes for s in steps} == {start.data["host_bytes"]}
    assert start.data["mode"] == "zenflow" and 0 < start.data["host_bytes_per_param"] <= 16
    assert start.data["host"]["accumulators"] == start.data["host"]["master"]  # two bf16 per fp32 master


def test_a_pretrained_model_goes_to_cuda_shard_by_shard_and_stays_put_on_cpu() -> None:
    from trainer.model.catalog import pretrained_placement

    assert pretrained_placement(torch.device("cuda", 1)) == {"device_map": {"": torch.device("cuda", 1)}}
    assert pretrained_placement(torch.device("cpu")) == {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_accumulator_is_the_fp32_sum_rounded_once_per_step(dtype: torch.dtype) -> None:
    from offload import cpu_adam
    from offload.host import accumulate_torch

    gen = torch.Generator().manual_seed(1)
    n = (1 << 16) + 7  # vector body, threads and a ragged tail
    src = [torch.randn(n, generator=gen).to(dtype) for _ in range(4)]
    for alpha in (1.0, 0.25, 1 / 3):
        ours, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        for i, g in enumerate(src):
            cpu_adam.accumulate(ours, g, alpha=alpha, first=i == 0, num_threads=2)
            accumulate_torch(ref, g, alpha=alpha, first=i == 0)
        assert torch.equal(ours, ref), alpha
    with pytest.raises(RuntimeError, match="acc must be float32 or src's dtype"):
        cpu_adam.accumulate(torch.empty(8, dtype=dtype), torch.zeros(8), alpha=1.0, first=True)


def test_the_step_may_write_the_new_parameters_over_its_gradient() -> None:
    from offload import cpu_adam

    gen = torch.Generator().manual_seed(2)
    n = (1 << 17) + 3  # large enough for the streaming-store path of a separate param_out
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    p2, m2, v2, g2, out = p.clone(), m.clone(), v.clone(), g.clone(), torch.empty(n, dtype=torch.bfloat16)
    hp = {"step": 1, "lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
    cpu_adam.adam_step(p, g, m, v, param_out=g, **hp)
    cpu_adam.adam_step(p2, g2, m2, v2, param_out=out, **hp)
    assert torch.equal(p, p2) and torch.equal(m, m2) and torch.equal(v, v2) and torch.equal(g, out)
    buf = torch.zeros(n + 1, dtype=torch.bfloat16)  # a partial overlap stays refused
    with pytest.raises(RuntimeError, match="param_out and grad must not share memory"):
        cpu_adam.adam_step(p, buf[:n], m, v, param_out=buf[1:], **hp)
