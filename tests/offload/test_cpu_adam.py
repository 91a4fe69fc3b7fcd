"""Tests for the fused C++ CPU Adam/AdamW (offload/cpu_adam.py, offload/csrc/cpu_adam.cpp).

Two references are used:
* ``ref_step``: torch's own elementwise ops in torch.optim.AdamW's order, except that sqrt is the
  correctly rounded one.  Ours must match it bitwise.  (torch's CPU ``Tensor.sqrt`` goes through MKL
  VML and is off by 1 ulp for ~16% of fp32 inputs on this machine, so bitwise equality with
  torch.optim itself is not possible with a correctly rounded sqrt.)
* torch.optim.AdamW / Adam themselves: compared with assert_close(rtol=1e-6, atol=1e-7).
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from offload import cpu_adam
from offload.cpu_adam import CpuAdamBuildError, CPUAdamW, adam_step
from tests.support import cpu_adam_extension

RTOL, ATOL = 1e-6, 1e-7
HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}


@pytest.fixture(scope="module", autouse=True)
def ext() -> ModuleType:
    return cpu_adam_extension()


def ref_step(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw=True, bias_correction=True):
    """torch.optim.{AdamW,Adam} single-tensor math with a correctly rounded sqrt."""
    g = g.float()
    if weight_decay != 0:
        if adamw:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if bias_correction:
        bc1, bc2_sqrt = 1 - beta1**step, (1 - beta2**step) ** 0.5
    else:
        bc1, bc2_sqrt = 1.0, 1.0
    denom = (v.double().sqrt().float() / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / bc1))


def _state(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), gen


@pytest.mark.parametrize("n", [1, 7, 15, 17, 33, 1000, 100_003])
@pytest.mark.parametrize(
    ("adamw", "beta1"), [(True, 0.9), (False, 0.9), (True, 0.3)], ids=["adamw", "adam_l2", "adamw_beta1_0.3"]
)
def test_bitwise_vs_torch_ops(n, adamw, beta1):
    p, m, v, gen = _state(n)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    hp = {**HP, "beta1": beta1}
    for step in range(1, 51):
        g = torch.randn(n, generator=gen)
        ref_step(rp, g, rm, rv, step=step, adamw=adamw, **hp)
        adam_step(p, g, m, v, step=step, adamw=adamw, **hp)
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)


def test_bitwise_large_multithreaded():
    n = 1_000_003
    p, m, v, gen = _state(n)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    for step in range(1, 6):
        g = torch.randn(n, generator=gen)
        ref_step(rp, g, rm, rv, step=step, **HP)
        adam_step(p, g, m, v, step=step, num_threads=2, **HP)
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)


@pytest.mark.parametrize("n", [1, 17, 1000, 100_003])
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam_L2"])
def test_close_to_torch_optim(n, adamw):
    p, m, v, gen = _state(n)
    ref = torch.nn.Parameter(p.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=0.05)
    for step in range(1, 51):
        g = torch.randn(n, generator=gen)
        ref.grad = g.clone()
        opt.step()
        adam_step(p, g, m, v, step=step, **{**HP, "weight_decay": 0.05}, adamw=adamw)
    st = opt.state[ref]
    torch.testing.assert_close(p, ref.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(m, st["exp_avg"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(v, st["exp_avg_sq"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [15, 4099, 70_001])
def test_dtype_combinations(grad_dtype, out_dtype, n):
    p, m, v, gen = _state(n)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW(
        [ref], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
    )
    out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype)
    for step in range(1, 21):
        g = torch.randn(n, generator=gen).to(grad_dtype)
        ref.grad = g.float()
        opt.step()
        ref_step(rp, g, rm, rv, step=step, **HP)
        adam_step(p, g, m, v, step=step, param_out=out, **HP)
        if out is not None:
            assert torch.equal(out, p.to(out_dtype))
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)
    torch.testing.assert_close(p, ref.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n", [100, 70_001, 300_007])
@pytest.mark.parametrize("offset", [0, 1, 3, 9])
def test_misaligned_buffers(n, offset):
    """Views at odd element offsets: exercises the peel before streaming param_out stores."""
    gen = torch.Generator().manual_seed(offset)

    def buf(dtype=torch.float32, off=offset):
        return torch.empty(n + off, dtype=dtype)[off:]

    p, m, v = buf(), buf(off=0), buf(off=offset + 1)
    p.copy_(torch.randn(n, generator=gen))
    m.zero_()
    v.zero_()
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out = buf(torch.bfloat16, off=offset + 2)
    out16 = buf(torch.float16, off=offset + 5)
    for step in range(1, 4):
        g = buf(torch.bfloat16, off=offset + 3)
        g.copy_(torch.randn(n, generator=gen))
        ref_step(rp, g, rm, rv, step=step, **HP)
        adam_step(p, g, m, v, step=step, param_out=out if step % 2 else out16, **HP)
        assert torch.equal((out if step % 2 else out16), p.to(out.dtype if step % 2 else out16.dtype))
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)


def test_low_precision_grad_equals_upcast_grad():
    n = 10_007
    for dt in (torch.bfloat16, torch.float16):
        p1, m1, v1, gen = _state(n)
        p2, m2, v2 = p1.clone(), m1.clone(), v1.clone()
        for step in range(1, 6):
            g = torch.randn(n, generator=gen).to(dt)
            adam_step(p1, g, m1, v1, step=step, **HP)
            adam_step(p2, g.float(), m2, v2, step=step, **HP)
        assert torch.equal(p1, p2) and torch.equal(m1, m2) and torch.equal(v1, v2)


def test_bias_correction_off_vs_hand_reference():
    n = 1001
    p, m, v, gen = _state(n)
    hp = {**HP, "weight_decay": 0.01}
    hand_p, hand_m, hand_v = p.double(), m.double(), v.double()
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    for step in range(1, 31):
        g = torch.randn(n, generator=gen)
        adam_step(p, g, m, v, step=step, bias_correction=False, **hp)
        ref_step(rp, g, rm, rv, step=step, bias_correction=False, **hp)
        # plain textbook formula in float64: no bias correction, step size = lr
        gd = g.double()
        hand_p *= 1 - hp["lr"] * hp["weight_decay"]
        hand_m = hp["beta1"] * hand_m + (1 - hp["beta1"]) * gd
        hand_v = hp["beta2"] * hand_v + (1 - hp["beta2"]) * gd * gd
        hand_p -= hp["lr"] * hand_m / (hand_v.sqrt() + hp["eps"])
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)
    torch.testing.assert_close(p.double(), hand_p, rtol=1e-5, atol=1e-6)
    # and it really differs from the bias-corrected update
    p2, m2, v2, gen2 = _state(n)
    adam_step(p2, torch.randn(n, generator=gen2), m2, v2, step=1, **hp)
    p3, m3, v3, gen3 = _state(n)
    adam_step(p3, torch.randn(n, generator=gen3), m3, v3, step=1, bias_correction=False, **hp)
    assert not torch.equal(p2, p3)


def test_zero_weight_decay_and_empty():
    p, m, v, gen = _state(100)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    for step in range(1, 4):
        g = torch.randn(100, generator=gen)
        adam_step(p, g, m, v, step=step, **{**HP, "weight_decay": 0.0})
        ref_step(rp, g, rm, rv, step=step, **{**HP, "weight_decay": 0.0})
    assert torch.equal(p, rp)
    e = torch.empty(0)
    adam_step(e, e.clone(), e.clone(), e.clone(), step=1, **HP)


def test_any_shape_contiguous():
    p, m, v, gen = _state(6 * 35)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    g = torch.randn(6, 35, generator=gen)
    adam_step(p.view(6, 35), g, m.view(3, 70), v, step=1, **HP)
    ref_step(rp, g.flatten(), rm, rv, step=1, **HP)
    assert torch.equal(p, rp)


def test_threads_identical_and_settable():
    n = 1_000_003
    p1, m1, v1, gen = _state(n)
    p2, m2, v2 = p1.clone(), m1.clone(), v1.clone()
    for step in range(1, 4):
        g = torch.randn(n, generator=gen)
        adam_step(p1, g, m1, v1, step=step, num_threads=1, **HP)
        adam_step(p2, g, m2, v2, step=step, num_threads=2, **HP)
    assert torch.equal(p1, p2) and torch.equal(m1, m2) and torch.equal(v1, v2)
    old = cpu_adam.get_num_threads()
    try:
        cpu_adam.set_num_threads(3)
        assert cpu_adam.get_num_threads() == 3
        cpu_adam.set_num_threads(0)
        assert cpu_adam.get_num_threads() == torch.get_num_threads()
    finally:
        cpu_adam.set_num_threads(old if old != torch.get_num_threads() else 0)
    assert cpu_adam.simd_width() in {"avx512", "avx2", "scalar"}


def test_concurrent_calls_from_threads():
    n = 300_000
    bufs = [_state(n, seed=s)[:3] for s in range(3)]
    refs = [tuple(t.clone() for t in b) for b in bufs]
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(10 + s)) for s in range(3)]
    for (p, m, v), g in zip(refs, grads, strict=True):
        for step in range(1, 6):
            adam_step(p, g, m, v, step=step, **HP)

    def work(i):
        p, m, v = bufs[i]
        for step in range(1, 6):
            adam_step(p, grads[i], m, v, step=step, num_threads=1, **HP)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b, r in zip(bufs, refs, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(b, r, strict=True))


def _assert_releases_gil(call) -> None:
    """With a huge switch interval a thread holding the GIL would starve the main thread for 5 s;
    the main thread can only stop a thread calling ``call(i)`` in a loop promptly if it releases the GIL."""
    stop = threading.Event()
    calls = [0]

    def work():
        while not stop.is_set():
            calls[0] += 1
            call(calls[0])

    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        t0 = time.perf_counter()
        t = threading.Thread(target=work)
        t.start()
        time.sleep(0.05)  # needs the GIL back to return
        stop.set()
        t.join(10)
        elapsed = time.perf_counter() - t0
    finally:
        sys.setswitchinterval(old)
    assert not t.is_alive() and calls[0] >= 1
    assert elapsed < 2.0


def test_releases_gil():
    n = 1 << 20
    p, m, v, gen = _state(n)
    g = torch.randn(n, generator=gen)
    _assert_releases_gil(lambda i: adam_step(p, g, m, v, step=i, num_threads=1, **HP))


# ---------------------------------------------------------------------------------------------------
# CPUAdamW optimizer


def _model_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (17,), (1,), (7, 3, 5)]
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]


def _grads(params, gen):
    return [torch.randn(p.shape, generator=gen) for p in params]


def _run(opt, params, gen, steps, sched=None):
    for _ in range(steps):
        for p, g in zip(params, _grads(params, gen), strict=True):
            p.grad = g
        opt.step()
        if sched is not None:
            sched.step()


def test_optimizer_param_groups_vs_torch():
    ours_p, ref_p = _model_params(), _model_params()

    def groups(ps):
        return [
            {"params": ps[:1]},
            {"params": ps[1:3], "lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.0},
            {"params": ps[3:], "lr": 5e-2, "eps": 1e-6, "weight_decay": 0.3},
        ]

    ours = CPUAdamW(groups(ours_p), lr=1e-2, weight_decay=0.05)
    ref = torch.optim.AdamW(groups(ref_p), lr=1e-2, weight_decay=0.05)
    _run(ours, ours_p, torch.Generator().manual_seed(1), 50)
    _run(ref, ref_p, torch.Generator().manual_seed(1), 50)
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=RTOL, atol=ATOL)
        sa, sb = ours.state[a], ref.state[b]
        assert isinstance(sa["step"], torch.Tensor) and float(sa["step"]) == float(sb["step"]) == 50
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=RTOL, atol=ATOL)


def test_optimizer_adam_mode_and_bias_correction_groups():
    ours_p, ref_p = _model_params(), _model_params()
    ours = CPUAdamW(ours_p, lr=1e-2, weight_decay=0.02, adamw_mode=False)
    ref = torch.optim.Adam(ref_p, lr=1e-2, weight_decay=0.02)
    _run(ours, ours_p, torch.Generator().manual_seed(2), 30)
    _run(ref, ref_p, torch.Generator().manual_seed(2), 30)
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=RTOL, atol=ATOL)
    # bias_correction=False group equals adam_step with bias_correction=False
    p = torch.nn.Parameter(torch.randn(50))
    flat, m, v = p.detach().clone(), torch.zeros(50), torch.zeros(50)
    opt = CPUAdamW([{"params": [p], "bias_correction": False}], lr=1e-2)
    for step in range(1, 4):
        g = torch.randn(50)
        p.grad = g
        opt.step()
        adam_step(
            flat,
            g,
            m,
            v,
            step=step,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=1e-2,
            bias_correction=False,
        )
    assert torch.equal(p.detach(), flat)


def test_state_dict_round_trip():
    params = _model_params()
    opt = CPUAdamW(params, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    _run(opt, params, gen, 10)
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    gen_state = gen.get_state()
    _run(opt, params, gen, 10)  # uninterrupted

    fresh = [torch.nn.Parameter(t.clone()) for t in saved_params]
    opt2 = CPUAdamW(fresh, lr=1e-2, weight_decay=0.1)
    opt2.load_state_dict(saved_state)
    gen2 = torch.Generator()
    gen2.set_state(gen_state)
    _run(opt2, fresh, gen2, 10)
    for a, b in zip(params, fresh, strict=True):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(opt.state[a]["exp_avg_sq"], opt2.state[b]["exp_avg_sq"])
        assert float(opt2.state[b]["step"]) == 20
    sd = opt2.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["param_groups"][0]["adamw_mode"] is True


def test_load_torch_adamw_state_dict():
    ours_p, ref_p = _model_params(), _model_params()
    ref = torch.optim.AdamW(ref_p, lr=1e-2)
    _run(ref, ref_p, torch.Generator().manual_seed(4), 5)
    for a, b in zip(ours_p, ref_p, strict=True):
        a.data.copy_(b.detach())
    ours = CPUAdamW(ours_p, lr=1e-2)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # load_state_dict shares tensors
    _run(ref, ref_p, torch.Generator().manual_seed(5), 10)
    _run(ours, ours_p, torch.Generator().manual_seed(5), 10)
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["lambda", "cosine"])
def test_lr_scheduler(kind):
    ours_p, ref_p = _model_params(), _model_params()
    ours = CPUAdamW(ours_p, lr=2e-2)
    ref = torch.optim.AdamW(ref_p, lr=2e-2)

    def sched(o):
        if kind == "lambda":
            return torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))
        return torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20)

    s_ours, s_ref = sched(ours), sched(ref)
    _run(ours, ours_p, torch.Generator().manual_seed(6), 25, s_ours)
    _run(ref, ref_p, torch.Generator().manual_seed(6), 25, s_ref)
    assert math.isclose(ours.param_groups[0]["lr"], ref.param_groups[0]["lr"])
    assert ours.param_groups[0]["lr"] != 2e-2
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=RTOL, atol=ATOL)


def test_optimizer_param_out_and_closure():
    p = torch.nn.Parameter(torch.randn(1000))
    out = torch.empty(1000, dtype=torch.bfloat16)
    opt = CPUAdamW([p], lr=1e-2)
    opt.set_param_out(p, out)
    p.grad = torch.randn(1000)
    assert opt.step(lambda: 1.5) == 1.5
    assert torch.equal(out, p.detach().to(torch.bfloat16))
    opt.set_param_out(p, None)
    p.grad = torch.randn(1000)
    opt.step()
    assert not torch.equal(out, p.detach().to(torch.bfloat16))
    with pytest.raises(TypeError, match="bf16/fp16"):
        opt.set_param_out(p, torch.empty(1000))


def test_optimizer_rejects_bad_params():
    with pytest.raises(TypeError, match="fp32 CPU"):
        CPUAdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.float16))])
    with pytest.raises(TypeError, match="fp32 CPU"):
        CPUAdamW([torch.nn.Parameter(torch.randn(4, device="meta"))])
    with pytest.raises(ValueError, match="contiguous"):
        CPUAdamW([torch.nn.Parameter(torch.randn(4, 5).t())])
    with pytest.raises(ValueError, match="learning rate"):
        CPUAdamW([torch.nn.Parameter(torch.randn(4))], lr=-1.0)


# ---------------------------------------------------------------------------------------------------
# input validation in C++


def _ok(n=64):
    return torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: a.update(param=torch.zeros(128)[::2]), "param must be contiguous"),
        (lambda a: a.update(grad=torch.zeros(64, 2)[:, 0]), "grad must be contiguous"),
        (lambda a: a.update(param=torch.zeros(64, dtype=torch.float16)), "param must be float32"),
        (lambda a: a.update(param=torch.zeros(64, dtype=torch.float64)), "param must be float32"),
        (
            lambda a: a.update(grad=torch.zeros(64, dtype=torch.int32)),
            "grad must be float32, bfloat16 or float16",
        ),
        (
            lambda a: a.update(exp_avg=torch.zeros(64, dtype=torch.float16)),
            "exp_avg must be float32 or bfloat16",
        ),
        (lambda a: a.update(exp_avg=torch.zeros(64, dtype=torch.bfloat16)), "exp_avg_sq must have exp_avg's"),
        (lambda a: a.update(exp_avg_sq=torch.zeros(63)), "exp_avg_sq has 63 elements"),
        (lambda a: a.update(grad=torch.zeros(65)), "grad has 65 elements"),
        (lambda a: a.update(param=torch.zeros(64, device="meta")), "param must be a CPU tensor"),
        (lambda a: a.update(param_out=torch.zeros(64)), "param_out must be bfloat16 or float16"),
        (lambda a: a.update(param_out=torch.zeros(32, dtype=torch.bfloat16)), "param_out has 32 elements"),
        (lambda a: a.update(exp_avg=a["param"]), "param and exp_avg must not share memory"),
        (lambda a: a.update(step=0), "step must be >= 1"),
        (lambda a: a.update(num_threads=-1), "num_threads must be >= 0"),
    ],
)
def test_bad_inputs(mutate, match):
    p, g, m, v = _ok()
    args = {
        "param": p,
        "grad": g,
        "exp_avg": m,
        "exp_avg_sq": v,
        "param_out": None,
        "step": 1,
        "num_threads": None,
    }
    mutate(args)
    hp = {k: HP[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay")}
    with pytest.raises(RuntimeError, match=match):
        adam_step(
            args.pop("param"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq"), **args, **hp
        )


# ---------------------------------------------------------------------------------------------------
# conversions


def test_fp16_software_conversion_exhaustive(ext):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    half = bits.view(torch.float16)
    for soft in (True, False):
        f = ext._convert(half, torch.empty(half.numel()), soft)
        ref = half.float()
        nan = ref.isnan()
        assert torch.equal(f.isnan(), nan) and torch.equal(f[~nan], ref[~nan])
        assert torch.equal(f.view(torch.int32)[~nan], ref.view(torch.int32)[~nan])  # signed zeros too


def test_f32_to_half_and_bf16_rounding(ext):
    gen = torch.Generator().manual_seed(7)
    x = torch.cat(
        [
            torch.randn(100_000, generator=gen) * 10.0 ** torch.randint(-9, 6, (100_000,), generator=gen),
            torch.tensor(
                [
                    0.0,
                    -0.0,
                    float("inf"),
                    -float("inf"),
                    65504.0,
                    65519.996,
                    65520.0,
                    65536.0,
                    1e-8,
                    2.0**-24,
                    2.0**-25,
                    3 * 2.0**-26,
                    2.0**-14,
                    2.0**-14 * (1 - 2**-11),
                    1.0 + 2**-11,
                    1.0 + 3 * 2**-11,
                    1.0 + 2**-8,
                    1.0 + 3 * 2**-8,
                    3.0e38,
                    1e-40,
                ]
            ),
        ]
    )
    # every fp32 that sits exactly halfway between two halves / bf16 values
    x = torch.cat(
        [
            x,
            (torch.randint(0, 1 << 16, (10_000,), generator=gen, dtype=torch.int32) << 13 | 0x1000).view(
                torch.float32
            ),
        ]
    )
    for soft in (True, False):
        h = ext._convert(x, torch.empty(x.numel(), dtype=torch.float16), soft)
        assert torch.equal(h.view(torch.int16), x.half().view(torch.int16))
    b = ext._convert(x, torch.empty(x.numel(), dtype=torch.bfloat16), False)
    assert torch.equal(b.view(torch.int16), x.bfloat16().view(torch.int16))
    nan = torch.tensor([float("nan")])
    assert ext._convert(nan, torch.empty(1, dtype=torch.float16), True).isnan().all()


def test_param_out_vector_path_special_values():
    # the vector bf16/fp16 stores must round like torch for values around the rounding boundaries
    n = 4096
    gen = torch.Generator().manual_seed(8)
    base = torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32) << 16
    p = (base | 0x8000).view(torch.float32).clone()  # exact bf16 halfway points
    p[~p.isfinite()] = 1.0
    for dt in (torch.bfloat16, torch.float16):
        q = p.clone()
        out = torch.empty(n, dtype=dt)
        # lr=0: the param is unchanged, so param_out is exactly the conversion of p
        adam_step(
            q,
            torch.zeros(n),
            torch.zeros(n),
            torch.zeros(n),
            step=1,
            lr=0.0,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            param_out=out,
        )
        assert torch.equal(q, p)
        assert torch.equal(out.view(torch.int16), p.to(dt).view(torch.int16))


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("ZENFLOW_TEST_ALL_ISAS"), reason="set ZENFLOW_TEST_ALL_ISAS=1 (builds 3 more)"
)
@pytest.mark.parametrize("arch", ["-march=haswell", "-mavx2 -mfma -mno-f16c", "-march=x86-64"])
def test_other_isa_builds(arch):
    """Re-run the exactness tests (the bf16-moment ones of test_cpu_adam_lean.py too) against the AVX2
    (with/without F16C) and scalar builds."""
    env = {
        **os.environ,
        "ZENFLOW_CPU_ADAM_ARCH": arch,
        "ZENFLOW_TEST_ALL_ISAS": "",
        "ZENFLOW_CPU_ADAM_JIT": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        __file__,
        str(Path(__file__).with_name("test_cpu_adam_lean.py")),
        "-k",
        "bitwise or dtype or conversion or rounding or special or threads or misaligned or neighbour "
        "or seed_and_index or many_steps",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_build_errors_are_clear(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_adam, "_ext", None)
    monkeypatch.setattr(cpu_adam, "_INSTALL_DIR", tmp_path / "not-installed")  # the JIT fallback
    monkeypatch.setenv("ZENFLOW_CPU_ADAM_JIT", "1")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(CpuAdamBuildError, match=r"no C\+\+ compiler found"):
        cpu_adam.load_extension()
    monkeypatch.delenv("CXX")
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++;\n")
    monkeypatch.setattr(cpu_adam, "_SOURCES", [bad])
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("ZENFLOW_CPU_ADAM_ARCH", "-march=native -DZF_BROKEN_TEST")
    with pytest.raises(CpuAdamBuildError, match=r"(?s)build log tail:.*broken\.cpp"):
        cpu_adam.load_extension()
    assert cpu_adam._ext is None


# ---------------------------------------------------------------------------------------------------
# window accumulation (zenflow, accumulate_on="host")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 15, 33, 1000, (1 << 16) + 7])
def test_accumulate_equals_the_torch_path_bitwise(dtype, n, monkeypatch):
    """C++ ``acc = alpha * g`` / ``acc += alpha * g`` equals offload.host.accumulate_torch (the engine's
    torch path: fp32 ops, or bf16/fp16 upcast in chunks) bitwise, ragged tails and chunks included."""
    import offload.host as host

    monkeypatch.setattr(host, "_ACC_CHUNK", 1000)  # several torch chunks and a ragged one
    gen = torch.Generator().manual_seed(n)
    src = [torch.randn(n, generator=gen).to(dtype) for _ in range(3)]
    for alpha in (1.0, 0.25, 1 / 3):
        ours, ref = torch.empty(n), torch.empty(n)
        for i, g in enumerate(src):
            cpu_adam.accumulate(ours, g, alpha=alpha, first=i == 0, num_threads=2)
            host.accumulate_torch(ref, g, alpha=alpha, first=i == 0)
        assert torch.equal(ours, ref), (alpha, (ours - ref).abs().max())


def test_accumulate_threads_give_identical_results():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(1 << 18, generator=gen).to(torch.bfloat16)
    base = torch.randn(1 << 18, generator=gen)
    out = []
    for t in (1, 2, 3):
        a = base.clone()
        cpu_adam.accumulate(a, g, alpha=0.5, first=False, num_threads=t)
        out.append(a)
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])


@pytest.mark.parametrize(
    ("acc", "src", "match"),
    [
        (torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8), "acc must be float32"),
        (torch.zeros(8), torch.zeros(8, dtype=torch.int32), "src must be float32, bfloat16 or float16"),
        (torch.zeros(8), torch.zeros(9), "src has 9 elements, acc has 8"),
        (torch.zeros(16)[::2], torch.zeros(8), "acc must be contiguous"),
        (torch.zeros(8, device="meta"), torch.zeros(8), "acc must be a CPU tensor"),
    ],
)
def test_accumulate_bad_inputs(acc, src, match):
    with pytest.raises(RuntimeError, match=match):
        cpu_adam.accumulate(acc, src, alpha=1.0, first=False)
    a = torch.zeros(8)
    with pytest.raises(RuntimeError, match="must not share memory"):
        cpu_adam.accumulate(a, a, alpha=1.0, first=False)


def test_accumulate_releases_gil():
    n = 1 << 21
    acc, g = torch.zeros(n), torch.randn(n).to(torch.bfloat16)
    _assert_releases_gil(lambda _i: cpu_adam.accumulate(acc, g, alpha=0.25, first=False, num_threads=1))
