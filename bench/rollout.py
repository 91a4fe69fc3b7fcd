"""Where a reinforcement step's time goes: sampling the rollout, grading it, and training on it, for a few
group sizes and completion lengths, in this process (trainer.method.reinforcement as a run drives it).

    python -m bench.rollout                                   # docs-llama, the keyword task, 3 steps
    python -m bench.rollout --samples 4,8,16 --max-tokens 24,64 --steps 2
    python -m bench.rollout --model path/to/folder --device cuda --json

For each setting (``samples_per_prompt`` x ``max_completion_tokens``) and each of ``--steps`` steps of
``--batch`` prompts: the step's rollout (KV-cached ``generate``), graded by the keyword task's
string_check, then the GRPO loss's forward/backward and an AdamW step. Reported: rollout tokens/s
(completion tokens sampled per second of generation) and the share of the step spent generating,
grading and training. The baseline, measured on the same completions in the same process: a plain
teacher-forced forward of the prompt + completion rows (the loss's forward, no grad); ``gen/fwd`` is
how many times longer sampling the tokens took than scoring them. Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.samples import KEYWORD_GRADER, KEYWORD_TRAIN_FILE, MODELS_DIR

DEFAULT_MODEL = str(MODELS_DIR / "docs-llama")
DEFAULT_DATA = str(KEYWORD_TRAIN_FILE)


@dataclass
class StepTimes:
    """One step's seconds by phase and what it sampled."""

    tokens: int
    generate_s: float
    grade_s: float
    train_s: float
    total_s: float
    forward_s: float
    reward: float


@dataclass
class Row:
    """A setting's figures: means over its steps."""

    samples_per_prompt: int
    max_completion_tokens: int
    tokens_per_step: float
    rollout_tok_s: float
    forward_tok_s: float
    gen_over_forward: float
    generate_share: float
    grade_share: float
    train_share: float
    step_s: float
    reward_mean: float


@dataclass
class Task:
    """The model, its tokenizer and the prompts, loaded once."""

    model: Any
    tokenizer: Any
    prompts: list[Any]
    device: Any


def load_task(model: str, data: str, device: str) -> Task:
    import torch

    from trainer.data.dataset import DataOptions, validate_file
    from trainer.model.catalog import load_model, load_tokenizer

    tok = load_tokenizer(model)
    dev = torch.device(device)
    m = load_model(model, dtype=torch.float32, seed=0, tokenizer=tok, device=dev)
    rep = validate_file(
        data,
        tokenizer=tok,
        max_seq_length=256,
        options=DataOptions(method="reinforcement"),
        keep_examples=True,
    )
    return Task(m, tok, list(rep.examples), dev)


def method_for(task: Task, samples: int, max_tokens: int, batch: int) -> tuple[Any, Any]:
    """The reinforcement method prepared on the task's model, and its batching."""
    from types import SimpleNamespace

    from contract.method import ResolvedReinforcement
    from trainer.method.base import Batching, MethodSetup
    from trainer.method.reinforcement import ReinforcementTraining

    resolved = ResolvedReinforcement.model_validate(
        {
            "grader": KEYWORD_GRADER,
            "compute_multiplier": samples / 8,
            "samples_per_prompt": samples,
            "eval_samples": 1,
            "max_completion_tokens": max_tokens,
            "temperature": 1.0,
            "kl_beta": 0.0,
        }
    )
    pad = task.tokenizer.pad_token_id if task.tokenizer.pad_token_id is not None else 0
    hp: Any = SimpleNamespace(seed=0, micro_batch_size=batch)
    b = Batching(hp, pad_id=pad, device=task.device)
    m = ReinforcementTraining(resolved)
    out = Path(tempfile.gettempdir())
    setup = MethodSetup(
        task.model, [], [], out, b, "bench", False, None, False, lambda e: None, task.tokenizer
    )
    m.prepare(setup)
    return m, b


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_seconds(task: Task, batches: list[Any]) -> float:
    """The baseline: the step's rows scored by one teacher-forced forward each (no grad)."""
    import torch

    from trainer.method.reinforcement import token_logps

    _sync(task.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for rb in batches:
            token_logps(task.model, rb.batch)
    _sync(task.device)
    return time.perf_counter() - t0


def one_step(task: Task, m: Any, b: Any, opt: Any, step: int, batch: int) -> StepTimes:
    """A step as the run takes it: rollout and grading (micro_batches), the loss's backward, AdamW."""
    n = len(task.prompts)
    index = [(step * batch + k) % n for k in range(batch)]
    t0 = time.perf_counter()
    batches = list(m.micro_batches([task.prompts[i] for i in index], index, b, step=step))
    t1 = time.perf_counter()
    learned = sum(rb.num_learned for rb in batches)
    for rb in batches:
        (m.loss(task.model, rb) / max(learned, 1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(task.device)
    t2 = time.perf_counter()
    sums = m.step_metrics(None)
    tokens = round(sums.completion_tokens_mean * sums.samples)
    gen, grade = sums.generation_seconds, sums.grading_seconds
    fwd = forward_seconds(task, batches)
    return StepTimes(tokens, gen, grade, t2 - t1, t2 - t0, fwd, sums.reward_mean)


def measure(task: Task, samples: int, max_tokens: int, *, steps: int, batch: int) -> Row:
    """``steps`` steps of one setting (after one untimed warm-up step); the model's weights restored."""
    import torch

    saved = {k: v.detach().clone() for k, v in task.model.state_dict().items()}
    m, b = method_for(task, samples, max_tokens, batch)
    opt = torch.optim.AdamW([p for p in task.model.parameters() if p.requires_grad], lr=1e-4)
    one_step(task, m, b, opt, 0, batch)
    times = [one_step(task, m, b, opt, s + 1, batch) for s in range(steps)]
    task.model.load_state_dict(saved)
    return summarise(samples, max_tokens, times)


def summarise(samples: int, max_tokens: int, times: list[StepTimes]) -> Row:
    tokens = sum(t.tokens for t in times)
    gen, fwd, total = (sum(getattr(t, k) for t in times) for k in ("generate_s", "forward_s", "total_s"))
    rollout, forward = tokens / gen if gen > 0 else 0.0, tokens / fwd if fwd > 0 else 0.0
    return Row(
        samples_per_prompt=samples,
        max_completion_tokens=max_tokens,
        tokens_per_step=tokens / len(times),
        rollout_tok_s=rollout,
        forward_tok_s=forward,
        gen_over_forward=gen / fwd if fwd > 0 else 0.0,
        generate_share=gen / total,
        grade_share=sum(t.grade_s for t in times) / total,
        train_share=sum(t.train_s for t in times) / total,
        step_s=total / len(times),
        reward_mean=statistics.fmean(t.reward for t in times),
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def print_table(task: Task, args: argparse.Namespace, rows: list[Row]) -> None:
    print(
        f"{Path(args.model).name} on {Path(args.data).name}, {args.batch} prompts a step, "
        f"{args.steps} steps each, {args.device}"
    )
    print(
        f"{'n':>3s} {'max':>4s} {'tok/step':>8s} {'rollout/s':>9s} {'fwd/s':>9s} {'gen/fwd':>7s} "
        f"{'gen':>5s} {'grade':>5s} {'train':>5s} {'step s':>6s} {'reward':>6s}"
    )
    for r in rows:
        print(
            f"{r.samples_per_prompt:3d} {r.max_completion_tokens:4d} {r.tokens_per_step:8.0f} "
            f"{r.rollout_tok_s:9.0f} {r.forward_tok_s:9.0f} {r.gen_over_forward:6.1f}x "
            f"{100 * r.generate_share:4.0f}% {100 * r.grade_share:4.0f}% {100 * r.train_share:4.0f}% "
            f"{r.step_s:6.2f} {r.reward_mean:6.2f}"
        )


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(prog="python -m bench.rollout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a base model folder")
    ap.add_argument("--data", default=DEFAULT_DATA, help="reinforcement JSONL with a 'keyword' field")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per setting (after one warm-up)")
    ap.add_argument("--batch", type=int, default=4, help="prompts a step")
    ap.add_argument("--samples", default="4,8,16", help="samples_per_prompt values")
    ap.add_argument("--max-tokens", default="24,64", help="max_completion_tokens values")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    task = load_task(args.model, args.data, args.device)
    rows = [
        measure(task, n, t, steps=args.steps, batch=args.batch)
        for t in _ints(args.max_tokens)
        for n in _ints(args.samples)
    ]
    if args.json:
        print(
            json.dumps(
                {"model": args.model, "device": args.device, "rows": [asdict(r) for r in rows]}, indent=2
            )
        )
    else:
        print_table(task, args, rows)
    return rows


if __name__ == "__main__":
    main()
