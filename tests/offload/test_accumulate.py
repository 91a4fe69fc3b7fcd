"""The C++ window accumulation (offload/csrc/cpu_adam.cpp ``accumulate``) against the torch path
(offload.host.accumulate_torch) for every (gradient dtype -> accumulator dtype) pair the engine can
ask for, both steps of a window, fixed thread counts, misaligned starts, and sizes that end in the
four-vector body, the one-vector loop and the scalar tail, within each thread's range too."""

from __future__ import annotations

import os
import subprocess
import sys
from types import ModuleType

import pytest
import torch

import offload.host as host
from offload import cpu_adam
from tests.support import cpu_adam_extension

PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
]
BIG = (1 << 20) + 37  # several threads' ranges, each with a ragged end


@pytest.fixture(scope="module", autouse=True)
def ext() -> ModuleType:
    return cpu_adam_extension()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _assert_same(ours: torch.Tensor, ref: torch.Tensor, what: object) -> None:
    """Bitwise equal, except that NaNs only need to be NaN in both (an FMA with two NaN operands
    returns whichever the compiler put first, and ATen's and our operand order may differ)."""
    nan = ours.float().isnan()
    assert torch.equal(nan, ref.float().isnan()), what
    diff = (_bits(ours) != _bits(ref)) & ~nan
    assert not diff.any(), (what, int(diff.sum()), ours[diff][:4], ref[diff][:4])


def _grads(n: int, dtype: torch.dtype, seed: int, specials: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(3):
        g = torch.randn(n, generator=gen) * torch.logspace(-30, 4, n).roll(k * 7)  # fp16 sub/overflow too
        if specials and n >= 16:
            g[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-45, 7e4])
            g[-1] = float("nan") if k == 1 else 3.0
        out.append(g.to(dtype))
    return out


@pytest.mark.parametrize(("gd", "ad"), PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n", [1, 15, 67, 1000, BIG])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("skip", [0, 3])
def test_every_pair_equals_the_torch_path_bitwise(
    gd: torch.dtype, ad: torch.dtype, n: int, threads: int, skip: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window of three steps (first, add, add), with alpha 1, 1/4 and 1/3; ``skip`` elements cut
    off the front of both buffers so that neither is vector-aligned."""
    monkeypatch.setattr(host, "_ACC_CHUNK", 4096)  # several torch chunks and a ragged one
    src = [g[skip:] for g in _grads(n + skip, gd, seed=n + skip, specials=True)]
    for alpha in (1.0, 0.25, 1 / 3):
        ours_buf, ref = torch.empty(n + skip, dtype=ad), torch.empty(n, dtype=ad)
        ours = ours_buf[skip:]
        for i, g in enumerate(src):
            cpu_adam.accumulate(ours, g, alpha=alpha, first=i == 0, num_threads=threads)
            host.accumulate_torch(ref, g, alpha=alpha, first=i == 0)
            _assert_same(ours, ref, (alpha, i))


@pytest.mark.parametrize(("gd", "ad"), PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("first", [True, False])
def test_thread_counts_give_identical_bits(gd: torch.dtype, ad: torch.dtype, first: bool) -> None:
    n = 3 * BIG
    (g,) = _grads(n, gd, seed=1, specials=False)[:1]
    base = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(ad)
    out = []
    for t in (1, 2, 3, 4):
        a = base.clone()
        cpu_adam.accumulate(a, g, alpha=0.375, first=first, num_threads=t)
        out.append(a)
    for a in out[1:]:
        assert torch.equal(_bits(a), _bits(out[0]))


@pytest.mark.parametrize("n", [40, BIG])
def test_first_step_with_alpha_one_is_a_bit_exact_copy(n: int) -> None:
    """alpha == 1 on a window's first step is torch's ``acc.copy_(src)``: every fp32 bit pattern
    comes through, signalling NaNs too (a multiplication by 1 would quiet them)."""
    src = torch.randn(n, generator=torch.Generator().manual_seed(3))
    patterns = torch.tensor([0x7F800001, 0xFF800123, 0x7FA00000, 0x00000001, 0x80000000]).to(torch.int32)
    src.view(torch.int32)[: len(patterns)] = patterns
    src.view(torch.int32)[-len(patterns) :] = patterns
    ref = torch.empty(n)
    ref.copy_(src)
    for threads in (1, 2):
        acc = torch.full((n,), 5.0)
        cpu_adam.accumulate(acc, src, alpha=1.0, first=True, num_threads=threads)
        assert torch.equal(acc.view(torch.int32), src.view(torch.int32))
        assert torch.equal(acc.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_and_fp16_upcast_copy_keeps_every_bit_pattern(dtype: torch.dtype) -> None:
    """alpha == 1, first step, a bf16/fp16 gradient into fp32: the plain upcast, equal to ATen's
    conversion for every one of the 65536 bit patterns (NaNs: as NaN)."""
    src = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).clone()
    ref = torch.empty(src.numel())
    ref.copy_(src)
    acc = torch.empty(src.numel())
    cpu_adam.accumulate(acc, src, alpha=1.0, first=True, num_threads=2)
    _assert_same(acc, ref, dtype)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("ZENFLOW_TEST_ALL_ISAS"), reason="set ZENFLOW_TEST_ALL_ISAS=1 (builds 3 more)"
)
@pytest.mark.parametrize("arch", ["-march=haswell", "-mavx2 -mfma -mno-f16c", "-march=x86-64"])
def test_other_isa_builds(arch: str) -> None:
    """This file again against the AVX2 (with/without F16C) and scalar builds."""
    env = {**os.environ, "ZENFLOW_CPU_ADAM_ARCH": arch, "ZENFLOW_TEST_ALL_ISAS": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
