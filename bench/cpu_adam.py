"""Benchmark: zenflow fused CPU Adam vs torch.optim.AdamW (foreach / fused) and memory bandwidth.

Everything is measured in one run and interleaved round by round (ours, torch fused, torch foreach,
bandwidth probes, then again), so a noisy neighbour slows all variants alike; medians are reported
(and minima in the JSON).  Byte model: read p, g, m, v and write p, m, v = 28 B/param at fp32
grads (26 with bf16/fp16 grads), +2 B when a bf16/fp16 param copy is written.

Bandwidth references (GB/s = 1e9 B/s):
  probe: the kernel's own streams (read p, g, m, v; write p, m, v) with trivial arithmetic, 28 B/elem
  copy:  torch dst.copy_(src), 8 B/elem counted (read + write; write-allocate traffic not counted)
  rmw:   torch a.add_(b), 12 B/elem
The bound is the largest of the three; bandwidth_fraction = ours' effective GB/s / bound.

Window accumulation (zenflow, accumulate_on="host": every step's gradient added into an fp32 window
accumulator, ``acc += alpha * g``): the C++ pass (``offload.cpu_adam.accumulate``: SIMD, OpenMP, GIL
released) against the engine's previous torch path (``offload.host.accumulate_torch``: one ATen op
for fp32 gradients, 1M-element chunks through fp32 scratch for bf16/fp16 ones, the GIL held between
chunks), on the same buffers in the same rounds. Byte model: read acc and g, write acc = 12 B/elem
(10 with bf16/fp16 gradients); acc_bandwidth_fraction = its effective GB/s / the same bound.

    python -m bench.cpu_adam --params 50000000 --threads 2 --steps 10 --grad-dtype bf16 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from offload import cpu_adam

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HP: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def bytes_per_param(grad_dtype: str, param_out: str) -> dict[str, int]:
    """Byte model of one step: read p, g, m, v; write p, m, v; write param_out if any."""
    return {
        "param_rw": 8,
        "exp_avg_rw": 8,
        "exp_avg_sq_rw": 8,
        "grad_r": 4 if grad_dtype == "fp32" else 2,
        "param_out_w": 0 if param_out == "none" else 2,
    }


def _wall(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(
    n: int,
    threads: int,
    steps: int,
    warmup: int,
    grad_dtype: str,
    param_out: str,
    with_torch: bool = True,
    with_foreach: bool = True,
    with_accumulate: bool = True,
) -> dict[str, Any]:
    """Time all variants for ``n`` params; returns the result dict (see module docstring)."""
    torch.set_num_threads(threads)
    ext = cpu_adam.load_extension()
    cpu_adam.set_num_threads(threads)
    torch.manual_seed(0)
    beta1, beta2 = _HP["betas"]

    p = torch.randn(n)
    g32 = torch.randn(n) * 1e-3
    g = g32.to(_DTYPES[grad_dtype])
    m = torch.zeros(n)
    v = torch.zeros(n)
    out = None if param_out == "none" else torch.empty(n, dtype=_DTYPES[param_out])
    step = [0]

    def ours() -> None:
        step[0] += 1
        cpu_adam.adam_step(
            p,
            g,
            m,
            v,
            step=step[0],
            lr=_HP["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=_HP["eps"],
            weight_decay=_HP["weight_decay"],
            param_out=out,
        )

    fns: dict[str, Callable[[], Any]] = {"ours": ours}
    if with_torch:
        # torch needs fp32 grads for fp32 params, so it always moves 28 B/param.
        param = torch.nn.Parameter(p.clone())
        param.grad = g32
        fns["torch_fused"] = torch.optim.AdamW([param], **_HP, fused=True).step
        if with_foreach:
            fns["torch_foreach"] = torch.optim.AdamW([param], **_HP, foreach=True).step
    if with_accumulate:
        from offload.host import accumulate_torch

        acc = torch.zeros(n)
        tmp = torch.empty(min(n, 1 << 20))
        fns["acc_ours"] = lambda: cpu_adam.accumulate(acc, g, alpha=0.25, first=False, num_threads=threads)
        fns["acc_torch"] = lambda: accumulate_torch(acc, g, alpha=0.25, first=False, tmp=tmp)
    # probe on the same buffers as ours (only the timing matters; values stay finite)
    fns["probe"] = lambda: ext._stream_probe(p, g32, m, v, threads)
    nb = min(n, 32_000_000)
    a, b = torch.ones(nb), torch.ones(nb)
    fns["copy"] = lambda: a.copy_(b)
    fns["rmw"] = lambda: a.add_(b)

    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + steps):
        for k, fn in fns.items():
            t = _wall(fn)
            if r >= warmup:
                samples[k].append(t)
    med = {k: statistics.median(s) for k, s in samples.items()}
    mins = {k: min(s) for k, s in samples.items()}

    model = bytes_per_param(grad_dtype, param_out)
    bpp = sum(model.values())
    probe_bw = 28 * n / med["probe"] / 1e9
    copy_bw = 8 * nb / med["copy"] / 1e9
    rmw_bw = 12 * nb / med["rmw"] / 1e9
    bound = max(probe_bw, copy_bw, rmw_bw)
    eff = bpp * n / med["ours"] / 1e9
    res: dict[str, Any] = {
        "params": n,
        "threads": threads,
        "simd": cpu_adam.simd_width(),
        "grad_dtype": grad_dtype,
        "param_out": param_out,
        "rounds": steps,
        "bytes_per_param": bpp,
        "byte_model": model,
        "ours_ms": med["ours"] * 1e3,
        "torch_fused_ms": med["torch_fused"] * 1e3 if "torch_fused" in med else None,
        "torch_foreach_ms": med["torch_foreach"] * 1e3 if "torch_foreach" in med else None,
        "ours_Mparams_per_s": n / med["ours"] / 1e6,
        "ours_GBps": eff,
        "probe_GBps": probe_bw,
        "copy_GBps": copy_bw,
        "rmw_GBps": rmw_bw,
        "bound_GBps": bound,
        "bandwidth_fraction": eff / bound,
        "min_ms": {k: t * 1e3 for k, t in mins.items()},
    }
    for kind in ("torch_fused", "torch_foreach"):
        if kind in med:
            res[f"{kind}_GBps"] = 28 * n / med[kind] / 1e9
            res[f"speedup_vs_{kind}"] = med[kind] / med["ours"]
    if "acc_ours" in med:
        acc_bpp = 8 + (4 if grad_dtype == "fp32" else 2)
        res.update(
            acc_bytes_per_param=acc_bpp,
            acc_ours_ms=med["acc_ours"] * 1e3,
            acc_torch_ms=med["acc_torch"] * 1e3,
            acc_speedup_vs_torch=med["acc_torch"] / med["acc_ours"],
            acc_ours_GBps=acc_bpp * n / med["acc_ours"] / 1e9,
            acc_torch_GBps=acc_bpp * n / med["acc_torch"] / 1e9,
            acc_bandwidth_fraction=acc_bpp * n / med["acc_ours"] / 1e9 / bound,
        )
    return res


def _print_table(res: dict[str, Any]) -> None:
    n = res["params"]
    print(
        f"CPU Adam: {n / 1e6:.1f}M params, {res['threads']} threads, {res['simd']}, grad {res['grad_dtype']}, "
        f"param_out {res['param_out']}, median of {res['rounds']} interleaved rounds"
    )
    print(
        f"  byte model: {res['bytes_per_param']} B/param {res['byte_model']} (torch: 28 B/param, fp32 grads)"
    )
    rows = [("ours", res["ours_ms"], res["bytes_per_param"])]
    rows += [(k, res[f"{k}_ms"], 28) for k in ("torch_fused", "torch_foreach") if res[f"{k}_ms"] is not None]
    for name, ms, b in rows:
        print(
            f"  {name:14s} {ms:8.2f} ms/step {n / ms / 1e3:8.1f} Mparams/s {b * n / ms / 1e6:6.1f} GB/s"
            f"  (min {res['min_ms'][name]:.2f} ms)"
        )
    print(
        f"  bandwidth: probe {res['probe_GBps']:.1f} GB/s (28 B/elem), copy_ {res['copy_GBps']:.1f} GB/s (8 B/elem), "
        f"add_ {res['rmw_GBps']:.1f} GB/s (12 B/elem)"
    )
    print(
        f"  ours at {res['bandwidth_fraction'] * 100:.1f}% of the {res['bound_GBps']:.1f} GB/s bound", end=""
    )
    if res.get("speedup_vs_torch_fused") is not None:
        print(f"; {res['speedup_vs_torch_fused']:.2f}x torch fused", end="")
    if res.get("speedup_vs_torch_foreach") is not None:
        print(f", {res['speedup_vs_torch_foreach']:.2f}x torch foreach", end="")
    print()
    if "acc_ours_ms" in res:
        b = res["acc_bytes_per_param"]
        print(
            f"  window accumulation acc += alpha * g ({b} B/param): C++ {res['acc_ours_ms']:.2f} ms "
            f"({res['acc_ours_GBps']:.1f} GB/s, {res['acc_bandwidth_fraction'] * 100:.1f}% of the bound), "
            f"torch path {res['acc_torch_ms']:.2f} ms ({res['acc_torch_GBps']:.1f} GB/s): "
            f"{res['acc_speedup_vs_torch']:.2f}x"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=50_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="timed rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--grad-dtype", choices=sorted(_DTYPES), default="fp32")
    ap.add_argument("--param-out", choices=["none", "bf16", "fp16"], default="none")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch optimizers")
    ap.add_argument("--no-foreach", action="store_true", help="skip torch foreach (slow on CPU)")
    ap.add_argument("--no-accumulate", action="store_true", help="skip the window-accumulation comparison")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    res = run(
        args.params,
        args.threads,
        args.steps,
        args.warmup,
        args.grad_dtype,
        args.param_out,
        with_torch=not args.no_torch,
        with_foreach=not args.no_foreach,
        with_accumulate=not args.no_accumulate,
    )
    if args.json:
        print(json.dumps(res))
    else:
        _print_table(res)
    return res


if __name__ == "__main__":
    main()
