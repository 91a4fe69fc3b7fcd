"""Benchmark: zenflow fused CPU Adam vs torch.optim.AdamW (foreach / fused) and memory bandwidth.

Everything is measured in one run and interleaved round by round (ours with fp32 moments, ours with
bf16 moments, torch fused, torch foreach, bandwidth probes, then again), so a noisy neighbour slows all
variants alike; medians are reported (and minima in the JSON).  Byte model: read p, g, m, v and write
p, m, v = 28 B/param at fp32 grads (26 with bf16/fp16 grads), +2 B when a bf16/fp16 param copy is
written; with bf16 moments (``ours_lean``, ``host_moments="bf16"``) 8 B less: 20 at fp32 grads, and
8 B/param of state instead of 12. ``lean.speedup_vs_*`` = that variant's median time / ours_lean's.

Bandwidth references (GB/s = 1e9 B/s):
  probe: the kernel's own streams (read p, g, m, v; write p, m, v) with trivial arithmetic, 28 B/elem
  copy:  torch dst.copy_(src), 8 B/elem counted (read + write; write-allocate traffic not counted)
  rmw:   torch a.add_(b), 12 B/elem
The bound is the largest of the three; bandwidth_fraction = ours' effective GB/s / bound.

Window accumulation (zenflow, accumulate_on="host": every step's gradient added into the window
accumulator, ``acc = alpha * g`` on a window's first step, ``acc += alpha * g`` after): the C++ pass
(``offload.cpu_adam.accumulate``: SIMD, OpenMP, GIL released) against the torch path
(``offload.host.accumulate_torch``: one ATen op for fp32, 1M-element chunks through fp32 scratch for
bf16/fp16, the GIL held between chunks), per (gradient dtype -> accumulator dtype) pair and for both
the first and the add step, on the same buffers, the two alternating within each round. Printed as
``C++/torch`` = torch's median time / C++'s (>1: C++ faster). Byte model: read g, write acc, and read
acc when adding.

    python -m bench.cpu_adam --params 50000000 --threads 2 --steps 10 --grad-dtype bf16 --json
    python -m bench.cpu_adam --quick          # ~10 s on 16 cores: small Adam run + the accumulation table
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


def bytes_per_param(grad_dtype: str, param_out: str, moments: str = "fp32") -> dict[str, int]:
    """Byte model of one step: read p, g, m, v; write p, m, v; write param_out if any. ``moments``:
    the moments' dtype (fp32, or bf16: the lean path)."""
    mb = 2 * (4 if moments == "fp32" else 2)
    return {
        "param_rw": 8,
        "exp_avg_rw": mb,
        "exp_avg_sq_rw": mb,
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
    with_lean: bool = True,
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
    if with_lean:  # the same step on its own copy of the state, with bf16 moments
        p_l = p.clone()
        m_l = torch.zeros(n, dtype=torch.bfloat16)
        v_l = torch.zeros(n, dtype=torch.bfloat16)
        step_l = [0]

        def lean() -> None:
            step_l[0] += 1
            cpu_adam.adam_step(
                p_l,
                g,
                m_l,
                v_l,
                step=step_l[0],
                lr=_HP["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=_HP["eps"],
                weight_decay=_HP["weight_decay"],
                param_out=out,
                rng_seed=step_l[0],
            )

        fns["ours_lean"] = lean
    if with_torch:
        # torch needs fp32 grads for fp32 params, so it always moves 28 B/param.
        param = torch.nn.Parameter(p.clone())
        param.grad = g32
        fns["torch_fused"] = torch.optim.AdamW([param], **_HP, fused=True).step
        if with_foreach:
            fns["torch_foreach"] = torch.optim.AdamW([param], **_HP, foreach=True).step
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
    if "ours_lean" in med:
        lean_model = bytes_per_param(grad_dtype, param_out, "bf16")
        res["lean"] = {
            "bytes_per_param": sum(lean_model.values()),
            "byte_model": lean_model,
            "host_state_bytes_per_param": 8,
            "ms": med["ours_lean"] * 1e3,
            "GBps": sum(lean_model.values()) * n / med["ours_lean"] / 1e9,
            "bandwidth_fraction": sum(lean_model.values()) * n / med["ours_lean"] / 1e9 / bound,
            "speedup_vs_ours_fp32": med["ours"] / med["ours_lean"],
            **{
                f"speedup_vs_{k}": med[k] / med["ours_lean"]
                for k in ("torch_fused", "torch_foreach")
                if k in med
            },
        }
    return res


#: (gradient dtype, accumulator dtype) pairs the engine can ask for: an fp32 accumulator for any
#: gradient, or the gradient's own bf16/fp16.
ACC_PAIRS = (("fp32", "fp32"), ("bf16", "fp32"), ("fp16", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"))


def run_accumulate(
    n: int, threads: int, rounds: int, warmup: int, alpha: float = 0.25
) -> list[dict[str, Any]]:
    """Time C++ against torch window accumulation for every pair in :data:`ACC_PAIRS`, first and
    add steps; one row per (pair, step) with both medians and ``ratio`` = torch / C++."""
    torch.set_num_threads(threads)
    cpu_adam.set_num_threads(threads)
    rows: list[dict[str, Any]] = []
    for gd, ad in ACC_PAIRS:  # one pair's buffers at a time
        rows += _time_pair(n, gd, ad, threads, rounds, warmup, alpha)
    return rows


def _time_pair(
    n: int, gd: str, ad: str, threads: int, rounds: int, warmup: int, alpha: float
) -> list[dict[str, Any]]:
    from offload.host import accumulate_torch

    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(n, generator=gen) * 1e-3).to(_DTYPES[gd])
    acc = torch.randn(n, generator=gen).to(_DTYPES[ad])
    tmp = torch.empty(min(n, 1 << 20))

    def cpp(first: bool) -> None:
        cpu_adam.accumulate(acc, g, alpha=alpha, first=first, num_threads=threads)

    def ref(first: bool) -> None:
        accumulate_torch(acc, g, alpha=alpha, first=first, tmp=tmp)

    times: dict[tuple[bool, str], list[float]] = {}
    for r in range(warmup + rounds):
        for first in (True, False):
            impls = [("cpp", cpp), ("torch", ref)]
            for name, fn in impls if r % 2 == 0 else impls[::-1]:  # alternate who goes first
                t0 = time.perf_counter()
                fn(first)
                if r >= warmup:
                    times.setdefault((first, name), []).append(time.perf_counter() - t0)
    rows = []
    for first in (True, False):
        t_cpp, t_ref = statistics.median(times[first, "cpp"]), statistics.median(times[first, "torch"])
        nbytes = n * (g.element_size() + acc.element_size() * (1 if first else 2))
        rows.append(
            {
                "grad": gd,
                "acc": ad,
                "step": "first" if first else "add",
                "cpp_ms": t_cpp * 1e3,
                "torch_ms": t_ref * 1e3,
                "ratio": t_ref / t_cpp,
                "cpp_GBps": nbytes / t_cpp / 1e9,
                "torch_GBps": nbytes / t_ref / 1e9,
            }
        )
    return rows


def _print_accumulate(rows: list[dict[str, Any]], n: int, threads: int, rounds: int) -> None:
    print(
        f"window accumulation: {n / 1e6:.1f}M elements, {threads} threads, median of {rounds} rounds "
        "(C++/torch = torch time / C++ time, >1: C++ faster)"
    )
    print(
        f"  {'grad -> acc':14s} {'step':5s} {'C++ ms':>8s} {'torch ms':>9s} {'C++ GB/s':>9s} {'C++/torch':>10s}"
    )
    for r in rows:
        print(
            f"  {r['grad'] + ' -> ' + r['acc']:14s} {r['step']:5s} {r['cpp_ms']:8.2f} {r['torch_ms']:9.2f} "
            f"{r['cpp_GBps']:9.1f} {r['ratio']:9.2f}x"
        )
    print(f"  lowest C++/torch ratio: {min(r['ratio'] for r in rows):.2f}x")


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
    lean = res.get("lean")
    if lean is not None:
        rows.append(("ours_lean", lean["ms"], lean["bytes_per_param"]))
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
    if lean is not None:
        vs = ", ".join(
            f"{lean[f'speedup_vs_{k}']:.2f}x {k.replace('_', ' ')}"
            for k in ("ours_fp32", "torch_fused", "torch_foreach")
            if f"speedup_vs_{k}" in lean
        )
        print(
            f"  ours_lean (bf16 moments, {lean['host_state_bytes_per_param']} B/param of state, "
            f"{lean['bytes_per_param']} B/param moved): {vs}; "
            f"{lean['bandwidth_fraction'] * 100:.1f}% of the bound"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=None, help="elements (default 50M, --quick 32M)")
    ap.add_argument("--threads", type=int, default=None, help="default: torch.get_num_threads()")
    ap.add_argument(
        "--steps", type=int, default=None, help="timed rounds, median reported (default 10, --quick 5)"
    )
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 3, --quick 1)")
    ap.add_argument("--grad-dtype", choices=sorted(_DTYPES), default="fp32")
    ap.add_argument("--param-out", choices=["none", "bf16", "fp16"], default="none")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch optimizers")
    ap.add_argument("--no-foreach", action="store_true", help="skip torch foreach (slow on CPU)")
    ap.add_argument("--no-lean", action="store_true", help="skip ours with bf16 moments")
    ap.add_argument("--no-adam", action="store_true", help="only the window-accumulation comparison")
    ap.add_argument("--no-accumulate", action="store_true", help="skip the window-accumulation comparison")
    ap.add_argument("--quick", action="store_true", help="32M elements, 5 rounds, no torch foreach")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    n = args.params or (32_000_000 if args.quick else 50_000_000)
    threads = args.threads or torch.get_num_threads()
    steps = args.steps or (5 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    res: dict[str, Any] = {"params": n, "threads": threads}
    if not args.no_adam:
        res = run(
            n,
            threads,
            steps,
            warmup,
            args.grad_dtype,
            args.param_out,
            with_torch=not args.no_torch,
            with_foreach=not (args.no_foreach or args.quick),
            with_lean=not args.no_lean,
        )
        if not args.json:
            _print_table(res)
    if not args.no_accumulate:
        rows = run_accumulate(n, threads, steps, warmup)
        res["accumulate"] = rows
        res["accumulate_min_ratio"] = min(r["ratio"] for r in rows)
        if not args.json:
            _print_accumulate(rows, n, threads, steps)
    if args.json:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
