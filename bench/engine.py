"""Benchmark of the engine modes side by side: same model, same data, one run.

    python -m bench.engine --device cpu --model-size tiny --steps 30
    python -m bench.engine --device cuda --model-size 1b --steps 60 --offload-steps 10 --json

For each variant it builds the model from the same seed (a Llama of the preset's shape, random
init; bf16 parameters on CUDA, fp32 on CPU), trains ``--warmup`` untimed steps and then ``--steps``
timed ones on a fixed synthetic next-token task (a fixed permutation of the previous token with
probability 0.8, else uniform), flushes the engine and evaluates the held-out loss. It prints per
variant: steps/s, stall fraction (total stall / total wall over the timed steps, and the mean of the
per-step fractions; ``StepMetrics.stall_seconds``: on CUDA the time the GPU sat idle, from CUDA
timing events, on CPU the time ``step()`` blocked), device optimizer-state bytes per parameter (and transfer-buffer bytes per
parameter), CPU optimizer seconds and transfer bytes per step, final training and held-out loss;
then zenflow's ratios against offload and device. ``--json`` prints the same as one JSON object.

Reselections happen inside the timed steps, as in training: the benchmark calls ``engine.new_epoch()``
before the first step and then every ``--epoch-steps`` timed steps (default: half of ``--steps``), so
with the default ``--select-interval auto`` zenflow reselects at the first window end after each; the
per-step rows say which steps reselected and which were skipped (non-finite gradient norm).

Variants: ``device``, ``offload``, ``zenflow`` (host accumulation, the default engine config) and
``zenflow-dacc`` (``accumulate_on="device"``). The offload variant can run fewer steps
(``--offload-steps``): it is the slow one; its losses then are not comparable with the others'.
On CPU the "device" is the CPU itself: the training thread gets ``--train-threads`` torch threads
in every variant (default: the engine's ``cpu_split[0]``, i.e. the cores the zenflow worker leaves),
so forward/backward get the same cores everywhere; the CPU optimizer of ``offload`` uses all cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bench.gpu_util import UtilSampler, cuda_index
from offload.config import EngineConfig
from offload.engine import ZenFlowEngine

PRESETS: dict[str, dict[str, int]] = {
    # name: Llama shape + default batch / sequence length
    "tiny": {
        "vocab": 256,
        "hidden": 64,
        "inter": 176,
        "layers": 2,
        "heads": 4,
        "kv": 4,
        "seq": 64,
        "batch": 8,
    },
    "small": {
        "vocab": 4096,
        "hidden": 512,
        "inter": 1376,
        "layers": 4,
        "heads": 8,
        "kv": 8,
        "seq": 128,
        "batch": 8,
    },
    # narrow and deep: about as many parameter tensors as the 1b preset (219), each small (dispatch-bound)
    "deep": {
        "vocab": 256,
        "hidden": 64,
        "inter": 176,
        "layers": 24,
        "heads": 4,
        "kv": 4,
        "seq": 32,
        "batch": 4,
    },
    # TinyLlama-1.1B's shape (~1.1e9 parameters)
    "1b": {
        "vocab": 32000,
        "hidden": 2048,
        "inter": 5632,
        "layers": 22,
        "heads": 32,
        "kv": 4,
        "seq": 2048,
        "batch": 8,
    },
}
VARIANTS = ("device", "offload", "zenflow", "zenflow-dacc")


@dataclass
class Result:
    variant: str
    params: int
    steps: int
    steps_per_s: float
    stall_fraction: float
    mean_step_stall_fraction: float
    state_bytes_per_param: float
    buffer_bytes_per_param: float
    cpu_optimizer_s_per_step: float
    d2h_bytes_per_step: float
    h2d_bytes_per_step: float
    train_loss: float
    final_loss: float
    peak_device_memory_gib: float | None
    seconds_total: float
    #: Stall summed over steps that applied a CPU window update (window ends) and over the others: tells
    #: a late window (the CPU optimizer behind) from per-step waits (gradient copies, accumulation).
    stall_s_on_window_ends: float = 0.0
    stall_s_on_other_steps: float = 0.0
    #: zenflow reselections inside the timed steps (after the first selection).
    reselections: int = 0
    #: Steps skipped (global gradient norm not finite).
    skipped_steps: int = 0
    #: zenflow: the CPU worker's time holding the GIL per timed step (an upper bound: task time outside
    #: its GIL-free C++ calls and waits), in ms and as a fraction of the mean step wall time; the
    #: training thread's Python can be delayed by at most this much.
    worker_gil_ms_per_step: float = 0.0
    worker_gil_fraction: float = 0.0
    worker_busy_ms_per_step: float = 0.0
    #: Mean GPU utilization over the timed steps (NVML, percent; None off CUDA or without NVML, with
    #: the reason): the share of time a kernel ran, so host waits the stall figure misses show here.
    gpu_util_percent: float | None = None
    gpu_util_note: str = ""
    #: The engine's core placement (offload.placement.Placement.as_dict()).
    placement: dict[str, Any] = field(default_factory=dict)
    #: Every timed step: wall, stall and CPU optimizer seconds, whether a window update landed.
    per_step: list[dict[str, Any]] = field(default_factory=list)


def build_model(
    preset: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int
) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=preset["vocab"],
        hidden_size=preset["hidden"],
        intermediate_size=preset["inter"],
        num_hidden_layers=preset["layers"],
        num_attention_heads=preset["heads"],
        num_key_value_heads=preset["kv"],
        max_position_embeddings=preset["seq"],
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(dtype)
    model.config.use_cache = False
    return model


def make_batches(n: int, vocab: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """The fixed synthetic task (built on CPU, deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
    out = []
    for _ in range(n):
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(vocab, (batch,), generator=gen)
        noise = torch.rand(batch, seq, generator=gen) < 0.2
        rnd = torch.randint(vocab, (batch, seq), generator=gen)
        for t in range(1, seq):
            x[:, t] = torch.where(noise[:, t], rnd[:, t], perm[x[:, t - 1]])
        out.append(x)
    return out


def engine_config(variant: str, args: argparse.Namespace) -> EngineConfig:
    common: dict[str, Any] = {
        "lr": args.lr,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "cpu_threads": args.threads or None,
        "cpu_optimizer_cores_ratio": args.cores_ratio,
        "bind_worker_cores": not args.no_bind,
    }
    if variant in ("device", "offload"):
        return EngineConfig(mode=variant, **common)
    # a number of steps, or a window policy ("adaptive", "epoch"; the engine takes their former "auto" too)
    ui: int | str = int(args.update_interval) if str(args.update_interval).isdigit() else args.update_interval
    return EngineConfig(
        mode="zenflow",
        topk_ratio=args.topk_ratio,
        update_interval=ui,
        select_interval=args.select_interval
        if args.select_interval == "epoch"
        else int(args.select_interval),
        accumulate_on="device" if variant == "zenflow-dacc" else "host",
        **common,
    )


def run_variant(
    variant: str,
    args: argparse.Namespace,
    preset: dict[str, int],
    device: torch.device,
    dtype: torch.dtype,
    batches: list[torch.Tensor],
    held_out: list[torch.Tensor],
) -> Result:
    t_start = time.perf_counter()
    steps = args.offload_steps if variant == "offload" and args.offload_steps else args.steps
    model = build_model(preset, device, dtype, args.seed)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    cfg = engine_config(variant, args)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    metrics: list[Any] = []
    pending: list[torch.Tensor] = []  # the losses, copied to the host without a host sync
    engine = ZenFlowEngine(model, cfg)
    prev_threads = torch.get_num_threads()
    if device.type == "cpu":  # same forward/backward resources in every variant
        torch.set_num_threads(args.train_threads or engine.cpu_split[0])
    epoch = args.epoch_steps or max(1, steps // 2)
    reselected: list[bool] = []
    c0: dict[str, float] = {}
    sampler = UtilSampler(cuda_index(device))
    try:
        engine.new_epoch()
        for i in range(args.warmup + steps):
            if i == args.warmup:
                c0 = engine.counters()
                sampler.__enter__()
            j = i - args.warmup
            if j > 0 and j % epoch == 0:
                engine.new_epoch()
            x = batches[i % len(batches)].to(device, non_blocking=True)  # page-locked on CUDA: async
            loss = model(input_ids=x, labels=x).loss
            pending.append(loss.detach().to("cpu", non_blocking=True))  # CUDA: pinned, read after the loop
            engine.scale_loss(loss).backward()
            before = engine.counters()["reselections"]
            m = engine.step()
            engine.zero_grad()
            if i >= args.warmup:
                metrics.append(m)
                reselected.append(engine.counters()["reselections"] > before)
            if args.verbose:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # debugging output: the loss must have landed
                print(
                    f"  {variant} step {i + 1}: loss {float(pending[-1]):.4f} wall {m.wall_seconds:.3f}s "
                    f"stall {m.stall_seconds:.3f}s",
                    file=sys.stderr,
                    flush=True,
                )
        sampler.__exit__(None, None, None)
        c1 = engine.counters()
        placement = engine.placement.as_dict()
        engine.flush()  # waits for the device: every late loss has landed
        losses = [float(t) for t in pending]
        model.eval()
        with torch.no_grad():
            final = statistics.fmean(
                model(input_ids=x.to(device), labels=x.to(device)).loss.item() for x in held_out
            )
        state_bytes = engine.device_optimizer_state_bytes
        buffer_bytes = metrics[-1].device_buffer_bytes if metrics else 0
    finally:
        sampler.__exit__(None, None, None)
        engine.close()
        torch.set_num_threads(prev_threads)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    wall = sum(m.wall_seconds for m in metrics)
    stall = sum(m.stall_seconds for m in metrics)
    n = max(1, len(metrics))
    gil_ms = 1e3 * (c1["worker_gil_seconds"] - c0.get("worker_gil_seconds", 0.0)) / n
    busy_ms = 1e3 * (c1["worker_busy_seconds"] - c0.get("worker_busy_seconds", 0.0)) / n
    result = Result(
        variant=variant,
        params=n_params,
        steps=len(metrics),
        steps_per_s=len(metrics) / wall if wall > 0 else 0.0,
        stall_fraction=stall / wall if wall > 0 else 0.0,
        mean_step_stall_fraction=statistics.fmean(m.stall_fraction for m in metrics) if metrics else 0.0,
        state_bytes_per_param=state_bytes / n_params,
        buffer_bytes_per_param=buffer_bytes / n_params,
        cpu_optimizer_s_per_step=sum(m.cpu_optimizer_seconds for m in metrics) / n,
        d2h_bytes_per_step=sum(m.bytes_device_to_host for m in metrics) / n,
        h2d_bytes_per_step=sum(m.bytes_host_to_device for m in metrics) / n,
        train_loss=statistics.fmean(losses[-min(5, len(losses)) :]),
        final_loss=final,
        peak_device_memory_gib=peak,
        seconds_total=time.perf_counter() - t_start,
        stall_s_on_window_ends=sum(m.stall_seconds for m in metrics if m.applied_cpu_update),
        stall_s_on_other_steps=sum(m.stall_seconds for m in metrics if not m.applied_cpu_update),
        reselections=sum(reselected),
        placement=placement,
        worker_gil_ms_per_step=gil_ms,
        worker_gil_fraction=gil_ms / 1e3 / (wall / n) if wall > 0 else 0.0,
        worker_busy_ms_per_step=busy_ms,
        skipped_steps=sum(m.skipped for m in metrics),
        gpu_util_percent=sampler.mean,
        gpu_util_note=sampler.reason,
        per_step=[
            {
                "wall_s": round(m.wall_seconds, 6),
                "stall_s": round(m.stall_seconds, 6),
                "cpu_opt_s": round(m.cpu_optimizer_seconds, 6),
                "window_end": m.applied_cpu_update,
                "synchronous": m.synchronous,
                "reselected": rs,
                "skipped": m.skipped,
            }
            for m, rs in zip(metrics, reselected, strict=True)
        ],
    )
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()
    return result


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ratios(results: dict[str, Result]) -> dict[str, float]:
    out: dict[str, float] = {}
    dev, off = results.get("device"), results.get("offload")
    for name in ("zenflow", "zenflow-dacc"):
        z = results.get(name)
        if z is None:
            continue
        if off is not None and off.steps_per_s > 0:
            out[f"{name}_speedup_vs_offload"] = z.steps_per_s / off.steps_per_s
            if off.stall_fraction > 0:
                out[f"{name}_stall_reduction_vs_offload"] = 1 - z.stall_fraction / off.stall_fraction
        if dev is not None and dev.steps_per_s > 0:
            out[f"{name}_throughput_vs_device"] = z.steps_per_s / dev.steps_per_s
            if dev.steps == z.steps:
                out[f"{name}_loss_rel_diff_vs_device"] = abs(z.final_loss - dev.final_loss) / dev.final_loss
            if dev.state_bytes_per_param > 0:
                out[f"{name}_state_bytes_vs_device"] = z.state_bytes_per_param / dev.state_bytes_per_param
    if dev is not None and off is not None and off.steps == dev.steps:
        out["offload_loss_rel_diff_vs_device"] = abs(off.final_loss - dev.final_loss) / dev.final_loss
    return out


def print_table(results: dict[str, Result], rat: dict[str, float], header: str) -> None:
    print(header)
    cols = (
        f"{'variant':<13} {'steps':>5} {'steps/s':>8} {'stall':>6} {'stall(mean)':>11} {'state B/p':>9} "
        f"{'buf B/p':>7} {'cpu-opt s':>9} {'D2H MB/st':>9} {'H2D MB/st':>9} {'train':>7} {'final':>7} {'GIL':>6}"
    )
    print(cols)
    print("-" * len(cols))
    for r in results.values():
        print(
            f"{r.variant:<13} {r.steps:>5} {r.steps_per_s:>8.3f} {r.stall_fraction:>6.1%} "
            f"{r.mean_step_stall_fraction:>11.1%} {r.state_bytes_per_param:>9.2f} {r.buffer_bytes_per_param:>7.2f} "
            f"{r.cpu_optimizer_s_per_step:>9.4f} {r.d2h_bytes_per_step / 1e6:>9.1f} {r.h2d_bytes_per_step / 1e6:>9.1f} "
            f"{r.train_loss:>7.4f} {r.final_loss:>7.4f} {r.worker_gil_fraction:>6.2%}"
        )
    for k, v in rat.items():
        print(f"  {k}: {v:.3f}")


def targets(results: dict[str, Result], rat: dict[str, float]) -> dict[str, bool]:
    """The GPU targets of the issue (meaningful on CUDA only)."""
    out = {}
    for name in ("zenflow", "zenflow-dacc"):
        if name not in results:
            continue
        out[f"{name}_stall_fraction<=5%"] = results[name].stall_fraction <= 0.05
        if f"{name}_speedup_vs_offload" in rat:
            out[f"{name}_speedup_vs_offload>=3x"] = rat[f"{name}_speedup_vs_offload"] >= 3.0
        if f"{name}_loss_rel_diff_vs_device" in rat:
            out[f"{name}_loss_within_1%_of_device"] = rat[f"{name}_loss_rel_diff_vs_device"] <= 0.01
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda if available)")
    ap.add_argument("--model-size", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    ap.add_argument("--offload-steps", type=int, default=0, help="timed steps for offload (default: --steps)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    ap.add_argument("--modes", default="device,offload,zenflow", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--json-out", default="", help="also write the JSON object to this file")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads the engine plans with (0 = all)")
    ap.add_argument(
        "--train-threads", type=int, default=0, help="CPU only: torch threads for forward/backward"
    )
    ap.add_argument("--cores-ratio", type=float, default=0.5, help="cpu_optimizer_cores_ratio")
    ap.add_argument("--no-bind", action="store_true", help="no core placement (bind_worker_cores=False)")
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument(
        "--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 on CUDA, fp32 on CPU"
    )
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--update-interval", default="4")
    ap.add_argument("--select-interval", default="epoch")
    ap.add_argument(
        "--epoch-steps",
        type=int,
        default=0,
        help="call engine.new_epoch() every N timed steps (0: at half of --steps)",
    )
    ap.add_argument(
        "--grad-ckpt", action="store_true", help="gradient checkpointing (less activation memory)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)

    dev_name = args.device
    if dev_name == "auto":
        dev_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev_name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype) or (
        torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    preset = dict(PRESETS[args.model_size])
    preset["batch"] = args.batch or preset["batch"]
    preset["seq"] = args.seq or preset["seq"]
    variants = [v.strip() for v in args.modes.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown mode {v!r}; choose from {', '.join(VARIANTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    n_batches = args.warmup + max(args.steps, args.offload_steps)
    batches = make_batches(n_batches, preset["vocab"], preset["batch"], preset["seq"], seed=1)
    if device.type == "cuda":  # page-locked: each step's input copy is asynchronous
        batches = [b.pin_memory() for b in batches]
    held_out = make_batches(2, preset["vocab"], preset["batch"], preset["seq"], seed=99)

    results: dict[str, Result] = {}
    env = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_threads": args.threads or len(os.sched_getaffinity(0)),
        "model_size": args.model_size,
        "params": 0,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": preset["batch"],
        "seq": preset["seq"],
        "topk_ratio": args.topk_ratio,
        "update_interval": args.update_interval,
        "select_interval": args.select_interval,
        "epoch_steps": args.epoch_steps or max(1, args.steps // 2),
        "cores_ratio": args.cores_ratio,
        "lr": args.lr,
    }

    def document() -> dict[str, Any]:
        rat = ratios(results)
        env["params"] = next(iter(results.values())).params if results else 0
        tgt = targets(results, rat) if device.type == "cuda" else {}
        return {
            "env": env,
            "results": {k: asdict(r) for k, r in results.items()},
            "ratios": rat,
            "targets": tgt,
            "variants_pending": [v for v in variants if v not in results],
        }

    for v in variants:
        results[v] = run_variant(v, args, preset, device, dtype, batches, held_out)
        if not args.json:
            r = results[v]
            print(
                f"[{v}] {r.steps} steps, {r.steps_per_s:.3f} steps/s, stall {r.stall_fraction:.1%}, "
                f"{r.reselections} reselections, worker GIL {r.worker_gil_ms_per_step:.3f} ms/step "
                f"({r.worker_gil_fraction:.2%} of a step), {r.seconds_total:.0f}s total",
                file=sys.stderr,
                flush=True,
            )
        if args.json_out:  # after every variant: a run cut short keeps what finished
            with open(args.json_out, "w", encoding="utf-8") as f:
                json.dump(document(), f, indent=2)
    doc = document()
    rat, tgt, n_params = doc["ratios"], doc["targets"], env["params"]
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        header = (
            f"engine benchmark: {args.model_size} ({n_params / 1e6:.1f}M params, {env['dtype']}) on "
            f"{env['device_name']} [{device}], batch {preset['batch']}x{preset['seq']}, "
            f"{env['cpu_threads']} CPU threads, topk {args.topk_ratio}, update_interval {args.update_interval}"
        )
        print_table(results, rat, header)
        for k, ok in tgt.items():
            print(f"  target {k}: {'PASS' if ok else 'FAIL'}")
    return 0 if all(math.isfinite(r.final_loss) for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
