"""Convergence of the engine modes side by side, fine-tuning a pretrained base (or any job spec).

    python -m bench.convergence                                   # device, offload, zenflow, seed 0
    python -m bench.convergence --seeds 0,1,2,3 --max-ratio 1.01 --json
    python -m bench.convergence --seeds 0,1,2,3 --modes device,zenflow --scale-cpu-lr
    python -m bench.convergence --variant paper=zenflow,topk_ratio=0.1,update_interval=4,select_interval=auto
    python -m bench.convergence --spec trainer/samples/tiny-llama.yaml   # a job spec instead (random init)
    python -m bench.convergence --modes device,zenflow --dtype bfloat16  # bf16 parameters (CUDA's default)
    python -m bench.convergence --modes zenflow,zf-bf16 --baseline zenflow --seeds 0,1 \
        --variant zf-bf16=zenflow,host_moments=bf16      # bf16 host moments against fp32 ones

Base (default, ``--base pretrained``): a small Llama-shaped model pretrained by ``bench.pretrained`` on
the Python standard library's sources and docstrings (cached after the first run), fine-tuned on a
different task, short chat exchanges about words and numbers (``bench.pretrained.write_chat_task``),
``--epochs`` epochs at ``--lr`` (cosine, 5% warm-up), batch 8. That is where ZenFlow's premise holds
(fine-tuning a pretrained model: a few stable columns carry most of the gradient). With ``--spec`` the
job is that spec instead (the sample tiny-llama job starts from a random init).

Every variant runs the whole job through ``trainer.run.loop.run_training`` (same data, same seed, same
hyperparameters; only ``engine`` differs) into a temporary output directory, and reports the final
training loss (mean of the last 20 steps), the final validation loss (on the flushed weights) and
the wall time. Then, per variant, the mean over the seeds and the ratio of that mean to device
mode's (``offload`` should be 1.000; zenflow is the one to watch). ``--max-ratio R`` makes the exit
status 1 when a non-device variant's mean validation loss exceeds R times device's. ``--baseline NAME``
takes another variant as the reference of the ratios and ``--max-ratio`` (the per-seed validation
ratios are printed too).

Variants: ``device``, ``offload`` and ``zenflow`` (with the pretrained base: the paper's defaults,
topk_ratio 0.1, update_interval 4, selection per epoch; with ``--spec``: the spec's engine settings
with that mode); ``--scale-cpu-lr`` adds zenflow with ``scale_cpu_lr`` true and false at update
intervals 4 and 8 (``zf-u4-sum``, ``zf-u4-plain``, ``zf-u8-sum``, ``zf-u8-plain``: the window's summed
learning rates against the boundary's plain one); ``--variant NAME=MODE[,KEY=VALUE...]`` adds one with
EngineConfig overrides (values are parsed as YAML: 4, 0.25, auto, true). ``--modes`` picks among the
variants (default: all; device first, the ratios need it). The job runs on ``--device`` (default cpu)
with ``--threads`` torch threads for forward/backward (the zenflow worker takes its own share of the
cores, see offload.engine), in the parameter dtype ``--dtype`` (default: the job's ``dtype``, "auto":
fp32 on CPU, bf16 on CUDA). With bf16 parameters zenflow's window-mean gradient is accumulated and
handed to the CPU optimizer in bf16 (offload.memory), which this benchmark checks against device mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

BASE_MODES = ("device", "offload", "zenflow")
#: The paper's fine-tuning defaults (and EngineConfig's).
PAPER = {"topk_ratio": 0.1, "update_interval": 4, "select_interval": "epoch", "full_warm_up_rounds": 0}
SCALE_CPU_LR = {
    f"zf-u{ui}-{'sum' if on else 'plain'}": {
        "mode": "zenflow",
        **PAPER,
        "update_interval": ui,
        "scale_cpu_lr": on,
    }
    for ui in (4, 8)
    for on in (True, False)
}


@dataclass
class Run:
    variant: str
    seed: int
    steps: int
    train_loss: float | None
    valid_loss: float | None
    seconds: float


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME=MODE[,KEY=VALUE...]`` -> (name, engine overrides including ``mode``)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"expected NAME=MODE[,KEY=VALUE...], got {text!r}")
    mode, *pairs = rest.split(",")
    if mode not in BASE_MODES:
        raise argparse.ArgumentTypeError(f"{name}: mode must be one of {', '.join(BASE_MODES)}, got {mode!r}")
    out: dict[str, Any] = {"mode": mode}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{name}: expected KEY=VALUE, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return name, out


def run_one(
    spec_path: Path,
    engine: dict[str, Any],
    seed: int,
    device: str,
    max_steps: int | None,
    dtype: str | None = None,
) -> Run:
    from contract.engine import EngineRequest
    from contract.hyperparameters import HyperparametersRequest
    from trainer.run.loop import run_training
    from trainer.spec import load_spec

    with tempfile.TemporaryDirectory(prefix="zenflow-convergence-") as tmp:
        spec = load_spec(spec_path, output_dir=tmp)
        hp = spec.hyperparameters.model_dump(exclude_unset=True)
        hp["seed"] = seed
        if max_steps is not None:
            hp["max_steps"] = max_steps
        settings = EngineRequest(**{**spec.engine.model_dump(exclude_unset=True), **engine})
        update: dict[str, Any] = {
            "engine": settings,
            "hyperparameters": HyperparametersRequest(**hp),
            "device": device,
        }
        if dtype is not None:
            update["dtype"] = dtype
        spec = spec.model_copy(update=update)
        t0 = time.perf_counter()
        res = run_training(spec, resume=False, progress=False)
        return Run("", seed, res.steps, res.train_loss, res.valid_loss, time.perf_counter() - t0)


@dataclass(frozen=True)
class PretrainedJob:
    """The fine-tuning job on the pretrained base."""

    base: Path
    train: Path
    valid: Path
    epochs: int
    lr: float
    batch_size: int = 8


def run_pretrained(
    job: PretrainedJob,
    engine: dict[str, Any],
    seed: int,
    device: str,
    max_steps: int | None,
    dtype: str | None = None,
) -> Run:
    from trainer.run.loop import run_training
    from trainer.spec import JobSpec

    hp: dict[str, Any] = {
        "n_epochs": job.epochs,
        "batch_size": job.batch_size,
        "learning_rate": job.lr,
        "warmup": 0.05,
        "max_seq_length": 128,
        "eval_every": 100_000,
        "checkpoint_every": 100_000,
        "seed": seed,
    }
    if max_steps is not None:
        hp["max_steps"] = max_steps
    with tempfile.TemporaryDirectory(prefix="zenflow-convergence-") as tmp:
        spec = JobSpec.model_validate(
            {
                "model": str(job.base),
                "training_file": str(job.train),
                "validation_file": str(job.valid),
                "hyperparameters": hp,
                "output_dir": tmp,
                "device": device,
                "engine": engine,
                **({"dtype": dtype} if dtype is not None else {}),
            }
        )
        t0 = time.perf_counter()
        res = run_training(spec, resume=False, progress=False)
        return Run("", seed, res.steps, res.train_loss, res.valid_loss, time.perf_counter() - t0)


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(runs: list[Run], names: list[str], baseline: str = "device") -> dict[str, dict[str, Any]]:
    """Per variant: the means over the seeds, their ratios to ``baseline``'s, and the validation-loss
    ratio to ``baseline``'s run of the same seed, seed by seed."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [r for r in runs if r.variant == name]
        out[name] = {
            "train_loss": _mean([r.train_loss for r in mine]),
            "valid_loss": _mean([r.valid_loss for r in mine]),
            "seconds": _mean([r.seconds for r in mine]),
            "seeds": [r.seed for r in mine],
        }
    ref = out.get(baseline)
    base_runs = {r.seed: r for r in runs if r.variant == baseline}
    for name, s in out.items():
        s["train_ratio"] = _ratio(s["train_loss"], ref["train_loss"]) if ref else None
        s["valid_ratio"] = _ratio(s["valid_loss"], ref["valid_loss"]) if ref else None
        s["valid_ratio_per_seed"] = {
            r.seed: _ratio(r.valid_loss, base_runs[r.seed].valid_loss)
            for r in runs
            if r.variant == name and r.seed in base_runs
        }
    return out


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--spec", type=Path, default=None, help="run this job spec instead of the pretrained base"
    )
    ap.add_argument("--epochs", type=int, default=3, help="pretrained base: fine-tuning epochs")
    ap.add_argument("--lr", type=float, default=1e-3, help="pretrained base: peak learning rate")
    ap.add_argument(
        "--pretrain-steps", type=int, default=0, help="pretrained base: pretraining steps (0: default)"
    )
    ap.add_argument(
        "--scale-cpu-lr",
        action="store_true",
        help="add zenflow scale_cpu_lr true/false at update intervals 4 and 8",
    )
    ap.add_argument("--modes", default="", help="comma list of variants to run (default: all, device first)")
    ap.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        default=[],
        metavar="NAME=MODE[,K=V...]",
        help="an extra variant with engine overrides (repeatable)",
    )
    ap.add_argument("--seeds", default="0", help="comma list of hyperparameters.seed values")
    ap.add_argument("--max-steps", type=int, default=None, help="cut the job short (all variants)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training thread (0: leave)")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16"],
        help="parameter dtype (default: the job's)",
    )
    ap.add_argument(
        "--max-ratio",
        type=float,
        default=None,
        help="exit 1 when a variant's mean valid loss is above this times device's",
    )
    ap.add_argument(
        "--baseline",
        default="device",
        help="the variant the ratios are to (default device; e.g. zenflow against a zenflow variant)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    variants: dict[str, dict[str, Any]] = {m: {"mode": m} for m in BASE_MODES}
    job: PretrainedJob | None = None
    workdir = None
    if args.spec is None:
        from bench.pretrained import Recipe, build, write_chat_task

        recipe = Recipe(steps=args.pretrain_steps) if args.pretrain_steps else Recipe()
        base = build(recipe, log=lambda m: print(m, file=sys.stderr, flush=True))
        workdir = tempfile.TemporaryDirectory(prefix="zenflow-convergence-data-")
        train, valid = write_chat_task(Path(workdir.name))
        job = PretrainedJob(base, train, valid, args.epochs, args.lr)
        variants["zenflow"] = {"mode": "zenflow", **PAPER}
        spec_label = f"pretrained base {base.name}, chat task, {args.epochs} epochs at lr {args.lr:g}"
    else:
        spec_label = args.spec.name
    if args.scale_cpu_lr:
        variants.update(SCALE_CPU_LR)
    variants.update(dict(args.variant))
    names = [n.strip() for n in args.modes.split(",") if n.strip()] or list(variants)
    unknown = [n for n in names if n not in variants]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)} (have {', '.join(variants)})")
    if args.baseline in names:
        names = [args.baseline, *[n for n in names if n != args.baseline]]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]

    runs: list[Run] = []
    for seed in seeds:
        for name in names:
            if job is not None:
                r = run_pretrained(job, variants[name], seed, args.device, args.max_steps, args.dtype)
            else:
                assert args.spec is not None
                r = run_one(args.spec, variants[name], seed, args.device, args.max_steps, args.dtype)
            r.variant = name
            runs.append(r)
            print(  # progress on stderr, also with --json (these runs are long)
                f"  {name:<12} seed {seed}: {r.steps} steps, train {_fmt(r.train_loss)}, "
                f"valid {_fmt(r.valid_loss)}, {r.seconds:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    summary = summarize(runs, names, args.baseline)
    bad = [
        n
        for n, s in summary.items()
        if args.max_ratio is not None
        and n != args.baseline
        and s["valid_ratio"] is not None
        and s["valid_ratio"] > args.max_ratio
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "job": spec_label,
                    "variants": {n: variants[n] for n in names},
                    "runs": [asdict(r) for r in runs],
                    "summary": summary,
                    "max_ratio": args.max_ratio,
                    "failed": bad,
                },
                indent=2,
            )
        )
    else:
        print(
            f"{spec_label}, seeds {','.join(map(str, seeds))} (means over seeds; ratios to {args.baseline})"
        )
        print(
            f"{'variant':<12} {'train':>8} {'valid':>8} {'train/base':>10} {'valid/base':>10} {'s/run':>7}  engine"
        )
        for n in names:
            s = summary[n]
            extra = ",".join(f"{k}={v}" for k, v in variants[n].items() if k != "mode")
            print(
                f"{n:<12} {_fmt(s['train_loss']):>8} {_fmt(s['valid_loss']):>8} {_fmt(s['train_ratio'], '.3f'):>10} "
                f"{_fmt(s['valid_ratio'], '.3f'):>10} {_fmt(s['seconds'], '.1f'):>7}  {variants[n]['mode']} {extra}"
            )
            per_seed = s["valid_ratio_per_seed"]
            if n != args.baseline and per_seed:
                print(
                    "    valid/base per seed: "
                    + ", ".join(f"seed {k} {_fmt(v)}" for k, v in per_seed.items())
                )
        if bad:
            print(f"FAIL: valid loss above {args.max_ratio}x {args.baseline}: {', '.join(bad)}")
    if workdir is not None:
        workdir.cleanup()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
