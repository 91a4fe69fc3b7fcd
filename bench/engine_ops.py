"""Dispatched ATen ops per engine step, and the engine's share of the step time, per mode.

    python -m bench.engine_ops --model-size deep --steps 12
    python -m bench.engine_ops --model-size tiny --modes zenflow --update-interval 4 --json

Counts the ATen ops the training thread dispatches inside ``engine.step()`` (clipping plus the mode's
update; the model's forward and backward are excluded) with a ``TorchDispatchMode``: every op that
reaches the dispatcher from Python-visible code counts once (a ``torch._foreach_*`` op is one op, as
it is one launch per chunk of tensors on CUDA). "kernels" leaves out view ops (no device launch);
on a GPU each of the rest is (at least) one kernel launch or copy. Ops run by the background worker
thread are not counted (the mode is thread-local). Reported per variant: mean ops per step over the
counted steps, split into window-boundary steps and the others (zenflow), and, from a separate
uncounted run, steps/s of the whole training step, the mean milliseconds of ``engine.step()`` in it,
and ("alone") of ``engine.step()`` called again and again on one backward's gradients (no forward or
backward competing for the cores: the steadiest figure of the engine's own cost on CPU).

The default ``deep`` preset (bench.engine's ``PRESETS``) is a narrow Llama with many layers, i.e.
many small parameters, where the per-op dispatch overhead dominates the optimizer's time on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.engine import PRESETS, VARIANTS, build_model, engine_config, make_batches
from offload.engine import ZenFlowEngine


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched by the thread that entered it."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.ops: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if threading.get_ident() == self.thread:
            self.ops[str(func.overloadpacket.__name__)] += 1
            if func.is_view:
                self.views += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", choices=sorted(PRESETS), default="deep")
    ap.add_argument("--modes", default="device,offload,zenflow,zenflow-dacc")
    ap.add_argument("--steps", type=int, default=12, help="counted steps (after --warmup); also the timed ones")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--update-interval", default="4")
    ap.add_argument("--select-interval", default="auto")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--train-threads", type=int, default=0)
    ap.add_argument("--cores-ratio", type=float, default=0.5)
    ap.add_argument("--bind", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=0, help="also print the N most frequent ops per variant")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def measure(variant: str, args: argparse.Namespace, preset: dict[str, int], batches: list[torch.Tensor],
            *, count: bool) -> dict[str, Any]:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = build_model(preset, torch.device("cpu"), dtype, args.seed)
    model.train()
    engine = ZenFlowEngine(model, engine_config(variant, args))
    prev = torch.get_num_threads()
    torch.set_num_threads(args.train_threads or engine.cpu_split[0])
    per_step: list[tuple[int, int, bool]] = []  # (ops, kernels, boundary)
    ops: Counter[str] = Counter()
    step_s: list[float] = []
    t0 = only_ms = 0.0
    try:
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                t0 = time.perf_counter()
            x = batches[i % len(batches)]
            model(input_ids=x, labels=x).loss.backward()
            ts = time.perf_counter()
            if count and i >= args.warmup:
                with OpCounter() as c:
                    m = engine.step()
                per_step.append((c.total, c.total - c.views, m.applied_cpu_update))
                ops.update(c.ops)
            else:
                m = engine.step()
            if i >= args.warmup:
                step_s.append(time.perf_counter() - ts)
            engine.zero_grad()
        wall = time.perf_counter() - t0
        if not count:  # the engine alone: one backward, then step() again and again on its gradients
            x = batches[0]
            model(input_ids=x, labels=x).loss.backward()
            t1 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            only_ms = 1e3 * (time.perf_counter() - t1) / args.steps
        engine.flush()
    finally:
        engine.close()
        torch.set_num_threads(prev)
    out: dict[str, Any] = {"variant": variant, "params": len(list(model.parameters()))}
    if count:
        plain = [p for p in per_step if not p[2]]
        bound = [p for p in per_step if p[2]]
        out.update(
            ops_per_step=statistics.fmean(p[0] for p in per_step),
            kernels_per_step=statistics.fmean(p[1] for p in per_step),
            kernels_plain_step=statistics.fmean(p[1] for p in plain) if plain else None,
            kernels_boundary_step=statistics.fmean(p[1] for p in bound) if bound else None,
            top_ops=ops.most_common(args.top) if args.top else [],
        )
    else:
        out.update(steps_per_s=args.steps / wall, engine_step_ms=1e3 * statistics.fmean(step_s),
                   engine_only_ms=only_ms)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    preset = PRESETS[args.model_size]
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = make_batches(args.warmup + args.steps, preset["vocab"], preset["batch"], preset["seq"], seed=1)
    variants = [v.strip() for v in args.modes.split(",") if v.strip()]
    rows = []
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown mode {v!r}; choose from {', '.join(VARIANTS)}")
        counted = measure(v, args, preset, batches, count=True)
        timed = measure(v, args, preset, batches, count=False)
        rows.append({**counted, **timed})
        print(f"[{v}] done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"args": vars(args), "results": rows}, indent=2))
        return 0
    print(f"engine ops per step: {args.model_size} ({rows[0]['params'] if rows else 0} param tensors, {args.dtype}), "
          f"topk {args.topk_ratio}, update_interval {args.update_interval}, {torch.get_num_threads()} threads")
    hdr = (f"{'variant':<13} {'ops/st':>8} {'kern/st':>8} {'kern plain':>10} {'kern bound':>10} {'steps/s':>8} "
           f"{'step() ms':>9} {'alone ms':>8}")
    print(hdr)
    print("-" * len(hdr))

    def f(x: float | None, spec: str) -> str:
        return format(x, spec) if x is not None else "-"

    for r in rows:
        print(f"{r['variant']:<13} {r['ops_per_step']:>8.1f} {r['kernels_per_step']:>8.1f} "
              f"{f(r['kernels_plain_step'], '>10.1f'):>10} {f(r['kernels_boundary_step'], '>10.1f'):>10} "
              f"{r['steps_per_s']:>8.3f} {r['engine_step_ms']:>9.2f} {r['engine_only_ms']:>8.2f}")
        for name, n in r["top_ops"]:
            print(f"    {name}: {n / args.steps:.1f}/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
