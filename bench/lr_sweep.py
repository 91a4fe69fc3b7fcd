"""The default learning rate against others on a pretrained base: supervised fine-tuning with everything
else at its default (epochs and batch from the data), one run per learning rate, in this process.

    python -m bench.lr_sweep                                    # docs-llama, 30 house-style examples
    python -m bench.lr_sweep --model "$(python -m bench.pretrained | tail -1)" --lora
    python -m bench.lr_sweep --lrs 1e-4,1e-3,3e-3 --json

For each run: the training loss of the first step, the mean of the last five, the drop between them (the
warning event's measure, trainer.run.loss_check), and the validation loss when a file is given. The
``auto`` row is the default the job would get (``trainer.model.catalog.default_learning_rate``, by the
base's parameter count); the rows around it say whether it sits where the loss falls fastest without
diverging.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from trainer.samples import MODELS_DIR, SAMPLES_DIR

DEFAULT_MODEL = str(MODELS_DIR / "docs-llama")
DEFAULT_DATA = str(SAMPLES_DIR / "style_train.jsonl")


def run(model: str, data: str, lr: float | str, *, lora: bool, seed: int, mode: str) -> dict[str, Any]:
    from trainer.events import Event, StepEvent
    from trainer.run.loop import run_training
    from trainer.spec import JobSpec

    losses: list[float] = []

    def on_event(e: Event) -> None:
        if isinstance(e, StepEvent):
            losses.append(e.loss)

    hp: dict[str, Any] = {"learning_rate": lr, "seed": seed}
    if lora:
        hp["lora"] = {"r": 8, "alpha": 16}
    with tempfile.TemporaryDirectory() as out:
        spec = JobSpec(
            model=model,
            training_file=Path(data),
            hyperparameters=hp,
            engine={"mode": mode},
            output_dir=Path(out),
            device="cpu",
            keep_checkpoints=1,
        )
        result = run_training(spec, on_event=on_event)
    last = statistics.fmean(losses[-5:])
    return {
        "lr": lr,
        "learning_rate": result.hyperparameters.get("learning_rate"),
        "steps": result.steps,
        "first_loss": losses[0],
        "last5_loss": last,
        "drop": 1 - last / losses[0] if math.isfinite(last) else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lr_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a base model folder")
    ap.add_argument("--data", default=DEFAULT_DATA, help="chat JSONL")
    ap.add_argument("--lrs", default="1e-4,3e-4,1e-3,3e-3,1e-2", help="learning rates beside auto")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", default="device", help="engine mode (the loss does not depend on it)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    lrs: list[float | str] = ["auto", *(float(x) for x in args.lrs.split(","))]
    rows = [run(args.model, args.data, lr, lora=args.lora, seed=args.seed, mode=args.mode) for lr in lrs]
    if args.json:
        print(json.dumps({"model": args.model, "data": args.data, "lora": args.lora, "runs": rows}, indent=2))
        return 0
    print(
        f"{Path(args.model).name} on {Path(args.data).name}, {'LoRA' if args.lora else 'full'}, seed {args.seed}"
    )
    print(f"{'lr':>8s} {'used':>9s} {'steps':>5s} {'first':>7s} {'last 5':>7s} {'drop':>6s}")
    for r in rows:
        print(
            f"{r['lr']!s:>8s} {r['learning_rate']:9.2e} {r['steps']:5d} {r['first_loss']:7.3f} "
            f"{r['last5_loss']:7.3f} {100 * r['drop']:5.1f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
