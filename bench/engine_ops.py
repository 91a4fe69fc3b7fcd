"""Dispatched ATen ops and host syncs per engine step, and the engine's share of the step time, per mode.

    python -m bench.engine_ops --model-size deep --steps 24
    python -m bench.engine_ops --model-size deep --modes zenflow --select-interval 4 --json
    python -m bench.engine_ops --model-size tiny --modes zenflow --dtype bf16 --json

Counts the ATen ops the training thread dispatches inside ``engine.step()`` (clipping plus the mode's
update; the model's forward and backward are excluded) with a ``TorchDispatchMode``: every op that
reaches the dispatcher from Python-visible code counts once (a ``torch._foreach_*`` op is one op, as
it is one launch per chunk of tensors on CUDA). "kernels" leaves out view ops (no device launch) and
ops on host memory only (on a GPU host they run on the CPU: e.g. writing a reselection's dropped
columns into the CPU master); on a GPU each of the rest is (at least) one kernel launch or copy. Ops run by the background worker
thread are not counted (the mode is thread-local).

Host syncs per step: the ops that make the host wait for the device (``_local_scalar_dense``/``item``,
``equal``, ``nonzero``, ``is_nonzero``, ``unique``, ``masked_select``, boolean-mask indexing, and
copies between host and device memory that are not ``non_blocking`` or whose host side is pageable
memory, which CUDA copies synchronously even when asked not to), unless every tensor they touch
is host memory (a read of a copy that has landed costs nothing: ``engine.is_host_memory``); plus the
engine's deliberate blocking reads (``engine.counters()["host_syncs"]``). Reported apart
(``host_waits_per_step``): reads of a step's scalars whose copy had not landed (``host_waits``; on CUDA
the step's verdict, which waits for the backward pass while the step's kernels are queued behind it,
so the device is not drained). On a CPU-only run ``.cpu()`` of a
CPU tensor dispatches nothing, so the engine routes every read of device data through its counted
paths; on CUDA (``bench/gpu_check.sh``) the dispatch-level counts see every real device-to-host copy.

Reselections: the counted steps include them, as training does (``select_interval="epoch"`` reselects
at the first window end after ``engine.new_epoch()``, which this benchmark calls every
``--epoch-steps`` counted steps, by default at half of them; or give ``--select-interval N``).
Reported per variant: mean kernels and host syncs per step, split into plain steps and window ends
(zenflow), each before the first reselection and after it, and the reselection steps themselves;
from a separate uncounted run with the same schedule, steps/s of the whole training step, the mean
milliseconds of ``engine.step()`` in it, and ("alone") of ``engine.step()`` called again and again on
one backward's gradients (no forward or backward competing for the cores: the steadiest figure of the
engine's own cost on CPU).

Bad gradients: ``--bad-steps 5,9`` poisons the gradient (a NaN) before those counted steps; the row
then reports whether each was skipped and left every trainable parameter exactly as it was
(``bad_steps_ok``), and the host syncs of skipped steps. ``--dtype fp16`` trains with the engine's
loss scaling. On CUDA (``--device cuda``, what ``bench/gpu_check.sh`` runs) ``--profile-steps N``
also profiles N counted steps with ``torch.profiler`` and reports, per kind of step, the CUDA kernel
launches and the CUDA runtime calls that block the host (stream/event/device synchronizations,
synchronous copies) and the milliseconds spent in them: the ground truth behind the dispatch-level
counts. Only the training thread's events count (those of the thread that recorded the step's label:
the CPU optimizer thread's copies and synchronizations overlap the step, they do not stall it), and
every kind of step is reported, reselections included.

The default ``deep`` preset (bench.engine's ``PRESETS``) is a narrow Llama with many layers, i.e.
many small parameters, where the per-op dispatch overhead dominates the optimizer's time on CPU.
Targets (issue 11, deep preset): zero host syncs on a plain zenflow step, at most one on a window
end; kernels per plain step after a reselection within 10% of the steady state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from bench.engine import PRESETS, VARIANTS, build_model, engine_config, make_batches
from bench.sync_count import OpCounter, profile_counts
from offload.engine import ZenFlowEngine

__all__ = ["OpCounter", "main", "measure", "profile_counts", "summarize", "targets"]


@dataclass
class _Step:
    ops: int
    kernels: int
    syncs: int  # dispatch-level host syncs + the engine's counted reads
    boundary: bool
    reselected: bool
    after_reselection: bool
    skipped: bool = False
    waits: int = 0  # reads of a landing still in flight (the device busy with this step's work)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", choices=sorted(PRESETS), default="deep")
    ap.add_argument("--modes", default="device,offload,zenflow,zenflow-dacc")
    ap.add_argument(
        "--steps", type=int, default=24, help="counted steps (after --warmup); also the timed ones"
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--epoch-steps",
        type=int,
        default=0,
        help="call engine.new_epoch() every N counted steps (0: at half of --steps)",
    )
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--bad-steps", default="", help="counted steps (0-based) whose gradient gets a NaN")
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="CUDA: profile this many counted steps (kernel launches, blocking runtime calls)",
    )
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--update-interval", default="4")
    ap.add_argument("--select-interval", default="epoch")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--train-threads", type=int, default=0)
    ap.add_argument("--cores-ratio", type=float, default=0.5)
    ap.add_argument("--no-bind", action="store_true", help="no core placement (bind_worker_cores=False)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=0, help="also print the N most frequent ops per variant")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def _mean(xs: list[int]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize(steps: list[_Step]) -> dict[str, Any]:
    """Mean kernels and host syncs per step of each kind (None where the run had no such step)."""

    def pick(boundary: bool, after: bool) -> list[_Step]:
        return [
            s
            for s in steps
            if s.boundary == boundary and s.after_reselection == after and not s.reselected and not s.skipped
        ]

    out: dict[str, Any] = {}
    for suffix, after in (("", False), ("_after_reselection", True)):
        for kind, boundary in (("plain", False), ("boundary", True)):
            sel = pick(boundary, after)
            out[f"kernels_{kind}_step{suffix}"] = _mean([s.kernels for s in sel])
            out[f"host_syncs_{kind}_step{suffix}"] = _mean([s.syncs for s in sel])
            out[f"max_host_syncs_{kind}_step{suffix}"] = max((s.syncs for s in sel), default=None)
    res = [s for s in steps if s.reselected]
    bad = [s for s in steps if s.skipped]
    out["kernels_skipped_step"] = _mean([s.kernels for s in bad])
    out["host_syncs_skipped_step"] = _mean([s.syncs for s in bad])
    out["max_host_syncs_skipped_step"] = max((s.syncs for s in bad), default=None)
    out["kernels_reselection_step"] = _mean([s.kernels for s in res])
    out["host_syncs_reselection_step"] = _mean([s.syncs for s in res])
    out["max_host_syncs_reselection_step"] = max((s.syncs for s in res), default=None)
    steady, after = out["kernels_plain_step"], out["kernels_plain_step_after_reselection"]
    out["plain_after_reselection_vs_steady"] = after / steady if steady and after is not None else None
    return out


def _kind(s: _Step) -> str:
    if s.skipped:
        return "skipped"
    if s.reselected:
        return "reselection"
    return ("boundary" if s.boundary else "plain") + ("_after_reselection" if s.after_reselection else "")


def measure(
    variant: str,
    args: argparse.Namespace,
    preset: dict[str, int],
    batches: list[torch.Tensor],
    *,
    count: bool,
) -> dict[str, Any]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype, torch.float32)
    device = torch.device(args.device)
    model = build_model(preset, device, dtype, args.seed)
    model.train()
    engine = ZenFlowEngine(model, engine_config(variant, args))
    prev = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(args.train_threads or engine.cpu_split[0])
    epoch = args.epoch_steps or max(1, args.steps // 2)
    bad_at = {int(b) for b in args.bad_steps.split(",") if b.strip()}
    steps: list[_Step] = []
    ops: Counter[str] = Counter()
    syncs: Counter[str] = Counter()
    step_s: list[float] = []
    bad_ok: list[bool] = []
    t0 = only_ms = 0.0
    profiling = count and args.profile_steps > 0 and device.type == "cuda"
    prof_kinds: dict[str, str] = {}
    prof = None
    if profiling:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    try:
        engine.new_epoch()
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                t0 = time.perf_counter()
            j = i - args.warmup
            if j > 0 and j % epoch == 0:
                engine.new_epoch()
            x = batches[i % len(batches)].to(device)
            engine.scale_loss(model(input_ids=x, labels=x).loss).backward()
            poisoned = j in bad_at
            if poisoned:
                grad = next(p.grad for p in model.parameters() if p.grad is not None)
                grad.view(-1)[0] = float("nan")
                snapshot = [p.detach().clone() for p in model.parameters()]
            ts = time.perf_counter()
            before = engine.counters()
            if count and i >= args.warmup:
                if prof is not None and j < args.profile_steps:
                    if j == 0:
                        prof.start()
                    label = f"zenflow-step-{j}"
                    with torch.profiler.record_function(label), OpCounter(engine.is_host_memory) as c:
                        m = engine.step()
                    if j == min(args.profile_steps, args.steps) - 1:
                        prof.stop()
                else:
                    label = ""
                    with OpCounter(engine.is_host_memory) as c:
                        m = engine.step()
                after = engine.counters()
                own = int(after["host_syncs"] - before["host_syncs"])
                waits = int(after["host_waits"] - before["host_waits"])
                steps.append(
                    _Step(
                        c.total,
                        c.kernels,
                        c.total_syncs + own,
                        after["windows"] > before["windows"],
                        after["reselections"] > before["reselections"],
                        before["reselections"] > 0,
                        m.skipped,
                        waits,
                    )
                )
                if label:
                    prof_kinds[label] = _kind(steps[-1])
                ops.update(c.ops)
                syncs.update(c.syncs)
                if own:
                    syncs["engine.to_host"] += own
            else:
                m = engine.step()
            if poisoned:
                same = all(torch.equal(a, b) for a, b in zip(snapshot, model.parameters(), strict=True))
                bad_ok.append(bool(m.skipped) and same)
            if i >= args.warmup:
                step_s.append(time.perf_counter() - ts)
            engine.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        if not count:  # the engine alone: one backward, then step() again and again on its gradients
            x = batches[0].to(device)
            engine.scale_loss(model(input_ids=x, labels=x).loss).backward()
            t1 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            only_ms = 1e3 * (time.perf_counter() - t1) / args.steps
        engine.flush()
        reselections = engine.counters()["reselections"]
    finally:
        engine.close()
        torch.set_num_threads(prev)
    out: dict[str, Any] = {"variant": variant, "params": len(list(model.parameters()))}
    if count:
        out.update(
            ops_per_step=statistics.fmean(s.ops for s in steps),
            kernels_per_step=statistics.fmean(s.kernels for s in steps),
            host_syncs_per_step=statistics.fmean(s.syncs for s in steps),
            host_waits_per_step=statistics.fmean(s.waits for s in steps),
            **summarize(steps),
            reselections=reselections,
            bad_steps=sorted(bad_at),
            bad_steps_ok=all(bad_ok) if bad_ok else None,
            sync_ops=dict(syncs),
            placement=engine.placement.as_dict(),
            top_ops=ops.most_common(args.top) if args.top else [],
        )
        if prof is not None and prof_kinds:
            out["profile"] = profile_counts(list(prof.events()), prof_kinds)
    else:
        out.update(
            steps_per_s=args.steps / wall,
            engine_step_ms=1e3 * statistics.fmean(step_s),
            engine_only_ms=only_ms,
        )
    return out


def targets(row: dict[str, Any]) -> dict[str, bool]:
    """Issue 11's targets for a zenflow row (meaningful on the deep preset)."""
    out: dict[str, bool] = {}
    if not str(row["variant"]).startswith("zenflow"):
        return out
    for suffix in ("", "_after_reselection"):
        plain, bound = (
            row.get(f"max_host_syncs_plain_step{suffix}"),
            row.get(f"max_host_syncs_boundary_step{suffix}"),
        )
        if plain is not None:
            out[f"zero_host_syncs_plain_step{suffix}"] = plain == 0
        if bound is not None:
            out[f"at_most_one_host_sync_boundary_step{suffix}"] = bound <= 1
    if row.get("max_host_syncs_reselection_step") is not None:
        out["at_most_one_host_sync_reselection_step"] = row["max_host_syncs_reselection_step"] <= 1
    if row.get("max_host_syncs_skipped_step") is not None:
        out["zero_host_syncs_skipped_step"] = row["max_host_syncs_skipped_step"] == 0
    if row.get("bad_steps_ok") is not None:
        out["bad_steps_skipped_and_changed_nothing"] = bool(row["bad_steps_ok"])
    ratio = row.get("plain_after_reselection_vs_steady")
    if ratio is not None:
        out["plain_kernels_after_reselection_within_10%"] = ratio <= 1.10
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
        row = {**counted, **timed}
        row["targets"] = targets(row)
        rows.append(row)
        print(f"[{v}] done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"args": vars(args), "results": rows}, indent=2))
        return 0
    print(
        f"engine ops per step: {args.model_size} ({rows[0]['params'] if rows else 0} param tensors, {args.dtype}), "
        f"topk {args.topk_ratio}, update_interval {args.update_interval}, select_interval {args.select_interval}, "
        f"{torch.get_num_threads()} threads"
    )

    def f(x: float | None, spec: str = ">7.1f") -> str:
        return format(x, spec) if x is not None else "      -"

    hdr = (
        f"{'variant':<13} {'kern plain':>10} {'kern bound':>10} {'plain+rs':>8} {'bound+rs':>8} {'reselect':>8} "
        f"{'sync pl':>7} {'sync bd':>7} {'sync rs':>7} {'steps/s':>8} {'step() ms':>9} {'alone ms':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "kernels_plain_step" not in r:
            continue
        print(
            f"{r['variant']:<13} {f(r['kernels_plain_step'], '>10.1f')} {f(r['kernels_boundary_step'], '>10.1f')} "
            f"{f(r['kernels_plain_step_after_reselection'], '>8.1f')} "
            f"{f(r['kernels_boundary_step_after_reselection'], '>8.1f')} {f(r['kernels_reselection_step'], '>8.1f')} "
            f"{f(r['host_syncs_plain_step'], '>7.2f')} {f(r['host_syncs_boundary_step'], '>7.2f')} "
            f"{f(r['host_syncs_reselection_step'], '>7.2f')} {r['steps_per_s']:>8.3f} {r['engine_step_ms']:>9.2f} "
            f"{r['engine_only_ms']:>8.2f}"
        )
        for name, n in r["top_ops"]:
            print(f"    {name}: {n / args.steps:.1f}/step")
        if r["sync_ops"]:
            print(f"    host syncs: {r['sync_ops']}")
        for k, ok in r["targets"].items():
            print(f"    target {k}: {'PASS' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
