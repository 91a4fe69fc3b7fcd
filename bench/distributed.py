"""Data-parallel engine benchmark: N ranks against one process on the same global batch, one run.

    python -m bench.distributed --nproc 2                        # CPU: gloo ranks, tiny model
    python -m bench.distributed --nproc 2 --quick --json         # what tests/bench/test_gpu_check_smoke.py runs
    python -m bench.distributed --nproc 8 --model medium --json  # a host with 8 GPUs: NCCL, one GPU per rank
    python -m bench.distributed --nproc 2 --shard-params         # the ranks' weights sharded with FSDP2

Per engine mode (``--modes``, default zenflow,offload,device) it trains a Llama-shaped model of the
``--model`` preset (random init, same seed) for ``--warmup`` + ``--steps`` steps of a fixed synthetic
task, every step on the same global batch of ``--batch`` sequences: once in ONE process (the
baseline, ``process_group=None``) and once as ``--nproc`` ranks, each rank taking its contiguous
share of the batch and building ``ZenFlowEngine(..., process_group=WORLD)`` (the engine averages the
gradients, so each rank backpropagates its token-loss sum / the global token count * world size).

Ranks are separate processes started with the ``env://`` variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) on a free local port: NCCL with one GPU per rank (``CUDA_VISIBLE_DEVICES``)
when CUDA is used and at least ``--nproc`` GPUs are visible, else gloo on the CPU, each rank pinned to
an even share of the allowed cores (the baseline gets all of them). Every process has a deadline
(``--timeout``): a hang or a dead rank fails the run instead of blocking it.

Printed per mode (``--json``: one JSON object): steps/s of the ranks (the slowest rank's timed steps)
and of the baseline and their ratio, the stall fraction (mean of StepMetrics.stall_fraction over the
timed steps and ranks), the host optimizer bytes per rank (``engine.memory().host_bytes``, the
largest rank's) and ``host_bytes_per_rank_ratio`` (per rank / the baseline's), the bytes each rank sent
for gradient reductions and for the all-gathers into its replica per step (StepMetrics.bytes_reduced /
bytes_gathered, ring algorithms; mean over timed steps, largest rank), ``max_rel_diff_vs_single`` (max over
parameters of max|w_dist - w_single| / max|w_single| on the flushed weights, rank 0 against the
baseline), ``replicas_identical`` (every rank's flushed weights have the same per-tensor
checksums) and ``grad_norm_max_rel_diff_vs_single`` (the largest relative difference of a timed step's
clipping norm from the baseline's).

What to expect. The gradient norm matches to fp32 rounding (~1e-7 relative; a mis-scaled reduction would
show 1e-3 or more). The weights do not, and that is no error: N ranks sum a batch's gradient in another
order than one process, and AdamW divides each update by ``sqrt(v) + eps``, so a weight whose gradient is
near zero (embedding rows of rare tokens) moves by up to ``lr`` whichever way its gradient rounded; the
difference grows to about ``lr / max|w|`` on ``embed_tokens``. Measured with fp32 on the CPU (``--model
small``, 12 steps, lr 1e-3): ONE process against itself, the batch's gradient summed in two halves
instead of one pass, differs by 7.0e-3 at the default eps 1e-8, 2.7e-5 at eps 1e-6 and 5.3e-7 at eps 1e-4,
in device and offload mode alike; 2 ranks against one process: device and offload 9.4e-3 (zenflow 7.1e-4)
at eps 1e-8, device and offload 2.5e-5 at ``--eps 1e-6``. So compare modes at ``--eps 1e-6``, where fp32 runs agree to ~1e-4
relative or better and a real error stands out (offload's clipping norm over a whole shard, fixed in
offload/offload_mode.py, was 8e-4 off the baseline's and put offload at 4.7e-4 there). With bf16 (the
CUDA default) expect bf16 rounding, amplified the same way. ``--shard-params``: the ranks' model is
sharded with FSDP2 (``fully_shard`` per decoder block, then the root; the engine's ``shard_params``,
:mod:`offload.fsdp`); ``param_bytes_per_rank`` is the parameter bytes a rank holds between steps,
``fsdp_bytes_per_step`` what FSDP's collectives send per step (ring algorithms: the weights all-gathered
for forward and again for backward, the gradients reduce-scattered), and the weights compared are the
gathered whole ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from bench.engine import PRESETS, build_model, make_batches
from offload.config import EngineConfig
from offload.engine import ZenFlowEngine
from trainer.run.launch import CPU_SHARE_ENV, NodeRanks

#: bench.engine's presets plus one in between "small" and "1b" (~0.2B parameters) for multi-GPU hosts.
MODELS: dict[str, dict[str, int]] = {
    **PRESETS,
    "medium": {
        "vocab": 32000,
        "hidden": 1024,
        "inter": 2816,
        "layers": 8,
        "heads": 16,
        "kv": 4,
        "seq": 512,
        "batch": 16,
    },
}
MODES = ("zenflow", "offload", "device")
QUICK = {"steps": 3, "warmup": 1, "batch": 4, "seq": 32, "model": "tiny"}


# --------------------------------------------------------------------------------------------- ranks
def _engine_config(mode: str, args: argparse.Namespace) -> EngineConfig:
    common: dict[str, Any] = {
        "lr": args.lr,
        "eps": args.eps,
        "weight_decay": 0.0,
        "max_grad_norm": args.max_grad_norm if args.max_grad_norm > 0 else None,
        "cpu_optimizer_cores_ratio": args.cores_ratio,
    }
    if mode != "zenflow":
        return EngineConfig.model_validate({"mode": mode, **common})
    return EngineConfig(
        mode="zenflow", topk_ratio=args.topk_ratio, update_interval=args.update_interval, **common
    )


def _checksums(state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per-tensor fingerprints (sum, sum of squares in float64): equal weights give equal numbers."""
    out = {}
    for name, t in state.items():
        d = t.detach().to("cpu", torch.float64)
        out[name] = [float(d.sum()), float((d * d).sum())]
    return out


def _max_rel_diff(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max over parameters of max|mine - ref| / max|ref|, and the parameter where it is reached."""
    worst, where = 0.0, ""
    for name, r in ref.items():
        r64 = r.to(torch.float64)
        scale = float(r64.abs().max()) or 1.0
        d = float((mine[name].to("cpu", torch.float64) - r64).abs().max()) / scale
        if d > worst:
            worst, where = d, name
    return worst, where


def _run_mode(
    mode: str,
    args: argparse.Namespace,
    rank: int,
    world: int,
    group: Any,
    device: torch.device,
    dtype: torch.dtype,
    batches: list[torch.Tensor],
    work: Path,
) -> dict[str, Any]:
    preset = MODELS[args.model]
    model = build_model(preset, device, dtype, args.seed)
    model.train()
    sharded = bool(args.shard_params) and group is not None
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fsdp_bytes = 0
    if sharded:
        from offload.collectives import wire_bytes
        from trainer.run.distributed import DistContext
        from trainer.run.fsdp_model import rank_param_bytes, shard_model

        shard_model(
            model, DistContext(rank, world, rank, "nccl" if device.type == "cuda" else "gloo", group), device
        )
        full_bytes, param_bytes = param_bytes, rank_param_bytes(model)
        fsdp_bytes = 2 * wire_bytes("all_gather", full_bytes, world) + wire_bytes(
            "reduce_scatter", full_bytes, world
        )
        config = _engine_config(mode, args).model_copy(update={"shard_params": True})
        engine = ZenFlowEngine(model, config)
    else:
        engine = ZenFlowEngine(model, _engine_config(mode, args), process_group=group)
    prev_threads = torch.get_num_threads()
    if device.type == "cpu":  # forward/backward on the cores the engine's CPU worker leaves
        torch.set_num_threads(max(1, engine.cpu_split[0]))
    timed: list[Any] = []
    try:
        assert (engine.world_size, engine.rank) == (world, rank), (engine.world_size, engine.rank)
        host_bytes = engine.memory().host_bytes
        engine.new_epoch()
        for i in range(args.warmup + args.steps):
            x_global = batches[i]
            x = torch.tensor_split(x_global, world)[rank].to(device)
            local_tokens = x.shape[0] * (x.shape[1] - 1)
            global_tokens = x_global.shape[0] * (x_global.shape[1] - 1)
            loss = model(input_ids=x, labels=x).loss  # mean over this rank's tokens
            engine.scale_loss(loss * (local_tokens * world / global_tokens)).backward()
            m = engine.step()
            engine.zero_grad()
            if i >= args.warmup:
                timed.append(m)
        engine.flush()
        if sharded:
            from trainer.run.fsdp_model import gather_full_state

            weights = gather_full_state(model, engine, keep=True)
            weights = {n: weights[n] for n, p in model.named_parameters() if p.requires_grad}
        else:
            weights = engine.consolidated_state_dict()
    finally:
        engine.close()
        torch.set_num_threads(prev_threads)
    ref_path = work / f"single-{mode}.pt"
    out: dict[str, Any] = {
        "rank": rank,
        "steps": len(timed),
        "wall_s": sum(m.wall_seconds for m in timed),
        "stall_fractions": [m.stall_fraction for m in timed],
        "host_bytes": host_bytes,
        "step_host_bytes": timed[-1].host_bytes if timed else 0,
        "bytes_reduced_per_step": statistics.fmean(m.bytes_reduced for m in timed) if timed else 0.0,
        "bytes_gathered_per_step": statistics.fmean(m.bytes_gathered for m in timed) if timed else 0.0,
        "skipped_steps": sum(m.skipped for m in timed),
        "grad_norms": [m.grad_norm for m in timed],
        "metrics_world_size": timed[-1].world_size if timed else world,
        "checksums": _checksums(weights),
        "params": sum(t.numel() for t in weights.values()),
        "param_bytes": param_bytes,
        "fsdp_bytes_per_step": fsdp_bytes,
    }
    if group is None:  # the baseline: its weights are the reference
        torch.save({k: v.to("cpu", torch.float32) for k, v in weights.items()}, ref_path)
    elif rank == 0 and ref_path.exists():
        diff, where = _max_rel_diff(weights, torch.load(ref_path, weights_only=True))
        out["max_rel_diff_vs_single"], out["max_rel_diff_param"] = diff, where
    del model, engine, weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def rank_main(args: argparse.Namespace) -> int:
    """One process: the baseline (WORLD_SIZE unset) or one rank of the group (env://)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    work = Path(args.work_dir)
    cuda = args.device == "cuda"
    if os.environ.get(CPU_SHARE_ENV):  # a CPU rank, pinned to its share of the cores by the launcher
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    if cuda:  # this process sees its one GPU as cuda:0 (CUDA_VISIBLE_DEVICES set by the parent)
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype) or (
        torch.bfloat16 if cuda else torch.float32
    )
    group = None
    if world > 1:
        import torch.distributed as dist

        backend = "nccl" if cuda else "gloo"
        kw: dict[str, Any] = {"device_id": device} if cuda else {}
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=args.timeout),
            **kw,
        )
        group = dist.group.WORLD
    preset = MODELS[args.model]
    batches = make_batches(args.warmup + args.steps, preset["vocab"], args.batch, args.seq, seed=1)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    results: dict[str, Any] = {
        "rank": rank,
        "world_size": world,
        "device": str(device),
        "device_name": name,
        "dtype": str(dtype).removeprefix("torch."),
        "modes": {},
    }
    try:
        for mode in args.modes.split(","):
            results["modes"][mode] = _run_mode(mode, args, rank, world, group, device, dtype, batches, work)
    finally:
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
    name = "single.json" if world == 1 else f"rank{rank}.json"
    (work / name).write_text(json.dumps(results))
    return 0


# ------------------------------------------------------------------------------------------ launcher
def _child_argv(args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.distributed",
        "--rank-worker",
        "--work-dir",
        args.work_dir,
        "--device",
        args.device,
        "--model",
        args.model,
        "--modes",
        args.modes,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--dtype",
        args.dtype,
        "--lr",
        str(args.lr),
        "--eps",
        str(args.eps),
        "--max-grad-norm",
        str(args.max_grad_norm),
        "--topk-ratio",
        str(args.topk_ratio),
        "--update-interval",
        str(args.update_interval),
        "--cores-ratio",
        str(args.cores_ratio),
        "--seed",
        str(args.seed),
        "--timeout",
        str(args.timeout),
        *(["--shard-params"] if args.shard_params else []),
    ]


def launch(args: argparse.Namespace, nproc: int, gpus: list[str]) -> None:
    """Start ``nproc`` processes (1: the baseline, a group of one, all of the cores) as the worker
    starts a job's ranks (:class:`trainer.run.launch.NodeRanks`, torch's elastic agent: one GPU each, or an
    even share of the cores) and wait for all of them; when one fails or the deadline passes, the
    others are stopped and RuntimeError says which process and why."""
    work = Path(args.work_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    log_path = work / f"log-{nproc}.txt"
    why = None
    with (
        open(log_path, "wb") as log,
        NodeRanks(
            _child_argv(args),
            nproc_per_node=nproc,
            run_id=f"bench-distributed-{nproc}-{os.getpid()}",
            devices=gpus[:nproc] if gpus else None,
            env=env,
            term_grace=5,
            stdout=log,
            stderr=subprocess.STDOUT,
        ) as group,
    ):
        group.start()
        try:
            end = group.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            why = f"deadline of {args.timeout:.0f}s passed"
        else:
            if end.code != 0:
                who = "the baseline" if nproc == 1 else f"rank {end.rank or 0}"
                why = f"{who} exited with {end.code}"
    if why is not None:
        raise RuntimeError(f"{why}\n--- log ---\n" + log_path.read_text(errors="replace")[-4000:])


# -------------------------------------------------------------------------------------------- report
def summarize(mode: str, single: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    s = single["modes"][mode]
    rs = [r["modes"][mode] for r in ranks]
    slowest = max(r["wall_s"] for r in rs)
    steps = rs[0]["steps"]
    host = max(r["host_bytes"] for r in rs)
    ref_sums = rs[0]["checksums"]
    return {
        "steps": steps,
        "steps_per_s": steps / slowest if slowest > 0 else 0.0,
        "single_steps_per_s": s["steps"] / s["wall_s"] if s["wall_s"] > 0 else 0.0,
        "speedup_vs_single": (s["wall_s"] / s["steps"]) / (slowest / steps)
        if slowest > 0 and s["steps"]
        else 0.0,
        "stall_fraction": statistics.fmean(f for r in rs for f in r["stall_fractions"]) if steps else 0.0,
        "single_stall_fraction": statistics.fmean(s["stall_fractions"]) if s["stall_fractions"] else 0.0,
        "host_bytes_per_rank": host,
        "host_bytes_by_rank": [r["host_bytes"] for r in rs],
        "single_host_bytes": s["host_bytes"],
        "host_bytes_per_rank_ratio": host / s["host_bytes"] if s["host_bytes"] > 0 else None,
        "bytes_reduced_per_step": max(r["bytes_reduced_per_step"] for r in rs),
        "bytes_gathered_per_step": max(r["bytes_gathered_per_step"] for r in rs),
        "max_rel_diff_vs_single": rs[0].get("max_rel_diff_vs_single"),
        "max_rel_diff_param": rs[0].get("max_rel_diff_param"),
        "replicas_identical": all(r["checksums"] == ref_sums for r in rs),
        # the global gradient norm each timed step clipped with: a mis-scaled reduction shows here at once
        "grad_norm_max_rel_diff_vs_single": max(
            (abs(a - b) / b for a, b in zip(rs[0]["grad_norms"], s["grad_norms"], strict=True) if a and b),
            default=None,
        ),
        "skipped_steps": max(r["skipped_steps"] for r in rs),
        "metrics_world_size": rs[0]["metrics_world_size"],
        "param_bytes_per_rank": max(r["param_bytes"] for r in rs),
        "single_param_bytes": s["param_bytes"],
        "fsdp_bytes_per_step": max(r["fsdp_bytes_per_step"] for r in rs),
    }


def print_table(doc: dict[str, Any]) -> None:
    e = doc["env"]
    print(
        f"distributed engine benchmark: {e['model']} ({e['params'] / 1e6:.2f}M params, {e['dtype']}), "
        f"{e['nproc']} ranks ({e['backend']}) vs 1 process, global batch {e['batch']}x{e['seq']}, "
        f"{e['steps']} timed steps"
    )
    cols = (
        f"{'mode':<8} {'steps/s':>8} {'single':>8} {'stall':>6} {'host MB/rank':>12} {'ratio':>6} "
        f"{'reduced MB/st':>13} {'gathered MB/st':>14} {'max rel diff':>12} {'same':>5}"
    )
    print(cols)
    print("-" * len(cols))
    for mode, r in doc["results"].items():
        ratio = r["host_bytes_per_rank_ratio"]
        diff = r["max_rel_diff_vs_single"]
        print(
            f"{mode:<8} {r['steps_per_s']:>8.3f} {r['single_steps_per_s']:>8.3f} {r['stall_fraction']:>6.1%} "
            f"{r['host_bytes_per_rank'] / 1e6:>12.2f} {'-' if ratio is None else f'{ratio:.3f}':>6} "
            f"{r['bytes_reduced_per_step'] / 1e6:>13.3f} {r['bytes_gathered_per_step'] / 1e6:>14.3f} "
            f"{'-' if diff is None else f'{diff:.2e}':>12} {'yes' if r['replicas_identical'] else 'NO':>5}"
        )
    for mode, r in doc["results"].items():
        print(
            f"{mode}: parameters {r['param_bytes_per_rank'] / 1e6:.2f} MB per rank (one process "
            f"{r['single_param_bytes'] / 1e6:.2f} MB), FSDP sent {r['fsdp_bytes_per_step'] / 1e6:.3f} MB per step"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the distributed run")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument(
        "--model", choices=sorted(MODELS), default="tiny", help="Llama-shaped preset (random init)"
    )
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (same data in both runs)")
    ap.add_argument("--batch", type=int, default=0, help="global batch (sequences; default: the preset's)")
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: the preset's)")
    ap.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda when at least --nproc GPUs are visible, else cpu",
    )
    ap.add_argument(
        "--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 on CUDA, fp32 on CPU"
    )
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--eps",
        type=float,
        default=1e-8,
        help="AdamW's eps (the engine's default 1e-8); 1e-6 damps how far Adam amplifies the rounding of "
        "near-zero gradients, so that fp32 runs agree to ~1e-4 relative (see the description)",
    )
    ap.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="the engine's clipping norm (0: no clipping)"
    )
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--update-interval", type=int, default=2)
    ap.add_argument("--cores-ratio", type=float, default=0.5, help="cpu_optimizer_cores_ratio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="seconds each launch may take")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny and short (the smoke test): " + ", ".join(f"{k} {v}" for k, v in QUICK.items()),
    )
    ap.add_argument("--shard-params", action="store_true", help="shard the ranks' weights with FSDP2")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_worker:
        return rank_main(args)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    preset = MODELS[args.model]
    args.batch = args.batch or preset["batch"]
    args.seq = args.seq or preset["seq"]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: choose from {', '.join(MODES)}")
    args.modes = ",".join(modes)
    if args.nproc < 2:
        ap.error("--nproc must be at least 2")
    if args.batch < args.nproc:
        ap.error(f"--batch {args.batch} must be at least --nproc {args.nproc} (every rank gets a share)")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "auto":
        args.device = "cuda" if visible >= args.nproc else "cpu"
    if args.device == "cuda" and visible < args.nproc:
        ap.error(f"--device cuda needs {args.nproc} visible GPUs, found {visible}")
    # NVML/nvidia-smi order, so CUDA_VISIBLE_DEVICES=i means the same GPU to every process.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    parent_visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    gpu_ids = parent_visible or [str(i) for i in range(visible)]
    if any(m != "device" for m in modes):  # build the C++ CPU Adam here, once: never in a rank we may kill
        from offload.cpu_adam import load_extension

        load_extension()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zf-bench-dist-") as work:
        args.work_dir = work
        try:
            launch(args, 1, gpu_ids[:1] if args.device == "cuda" else [])
            launch(args, args.nproc, gpu_ids[: args.nproc] if args.device == "cuda" else [])
        except RuntimeError as exc:
            print(f"bench.distributed: {exc}", file=sys.stderr)
            return 2
        single = json.loads((Path(work) / "single.json").read_text())
        ranks = [json.loads((Path(work) / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    results = {m: summarize(m, single, ranks) for m in modes}
    first = single["modes"][modes[0]]
    doc = {
        "env": {
            "nproc": args.nproc,
            "backend": "nccl" if args.device == "cuda" else "gloo",
            "device": args.device,
            "device_name": single["device_name"],
            "torch": torch.__version__,
            "model": args.model,
            "params": first["params"],
            "dtype": single["dtype"],
            "batch": args.batch,
            "seq": args.seq,
            "steps": args.steps,
            "warmup": args.warmup,
            "lr": args.lr,
            "eps": args.eps,
            "max_grad_norm": args.max_grad_norm,
            "topk_ratio": args.topk_ratio,
            "update_interval": args.update_interval,
            "shard_params": args.shard_params,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "seconds_total": round(time.perf_counter() - t0, 2),
        },
        "results": results,
        "ratios": {
            f"{m}_{k}": r[k]
            for m, r in results.items()
            for k in (
                "host_bytes_per_rank_ratio",
                "speedup_vs_single",
                "max_rel_diff_vs_single",
                "param_bytes_per_rank",
            )
        },
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_table(doc)
    return 0 if all(r["replicas_identical"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
