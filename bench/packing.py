"""Padded vs packed training throughput: tokens/s of forward + backward over the same examples, the
padded run being the baseline measured in the same process.

    python -m bench.packing                                   # tiny-llama, sample data, CPU
    python -m bench.packing --model small-llama --device cuda --max-seq-length 2048 --micro-batch-size 4
    python -m bench.packing --data my.jsonl --json

Both variants cut each optimizer step (``--batch-size`` examples in the epoch order of seed 0) into
micro-batches of ``--micro-batch-size`` sequences with :func:`trainer.data.batching.micro_batches`: padded,
a sequence is one example right-padded to the micro-batch's longest; packed, a row of up to
``--max-seq-length`` tokens holding whole examples (trainer.data.packing; the attention implementation it
picks is printed). So both hold at most micro-batch x max_seq_length tokens per forward: the same
memory bound. Each micro-batch runs forward, the summed token loss and backward (no optimizer: what
packing changes is the forward/backward work). Tokens are real (non-padding) tokens; ``padding`` is
the share of computed positions that were padding. The first ``--warmup`` steps are not timed.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SAMPLES = Path(__file__).resolve().parents[1] / "trainer" / "samples"


@dataclass
class Throughput:
    packing: bool
    attention: str
    steps: int
    forwards: int
    tokens: int
    positions: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def padding(self) -> float:
        return 1.0 - self.tokens / self.positions if self.positions else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second, "padding": self.padding}


def measure(
    model_name: str,
    data: Path,
    *,
    packing: bool,
    batch_size: int = 8,
    micro_batch_size: int = 8,
    max_seq_length: int = 256,
    steps: int = 8,
    warmup: int = 1,
    device: str = "cpu",
) -> Throughput:
    """Forward + backward throughput of ``steps`` optimizer steps of ``data`` (see the module docstring)."""
    import torch

    from contract.hyperparameters import RuntimeChoices
    from trainer.data.batching import epoch_order, loss_sum, micro_batches
    from trainer.data.dataset import load_examples
    from trainer.model.catalog import load_model, load_tokenizer
    from trainer.run.setup import apply_runtime, pick_device

    dev = pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tokenizer = load_tokenizer(model_name)
    examples, _ = load_examples(data, tokenizer, max_seq_length)
    model = load_model(model_name, dtype=dtype, seed=0, tokenizer=tokenizer)
    choices = RuntimeChoices(micro_batch_size=micro_batch_size, gradient_checkpointing=False, packing=packing)
    attention = apply_runtime(model, choices, dev, dtype)
    model.to(dev).train()  # type: ignore[arg-type]
    order = epoch_order(len(examples), 0, 0)
    pad_id = int(tokenizer.pad_token_id)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    result = Throughput(packing, attention, 0, 0, 0, 0, 0.0)
    for step in range(warmup + steps):
        idx = [order[(step * batch_size + i) % len(order)] for i in range(batch_size)]
        sync()
        t0 = time.perf_counter()
        tokens = positions = forwards = 0
        for mb in micro_batches(
            [examples[i] for i in idx],
            micro_batch_size,
            pad_id=pad_id,
            device=dev,
            packing=packing,
            max_seq_length=max_seq_length,
        ):
            ls, _ = loss_sum(model, mb)
            ls.backward()
            tokens, positions, forwards = (
                tokens + mb.num_tokens,
                positions + mb.input_ids.numel(),
                forwards + 1,
            )
        model.zero_grad(set_to_none=True)
        sync()
        if step >= warmup:
            result.steps += 1
            result.forwards += forwards
            result.tokens += tokens
            result.positions += positions
            result.seconds += time.perf_counter() - t0
    return result


def compare(model_name: str, data: Path, **kw: Any) -> dict[str, Any]:
    """Padded (the baseline) then packed, in this process; ``ratio`` is packed over padded tokens/s."""
    padded = measure(model_name, data, packing=False, **kw)
    packed = measure(model_name, data, packing=True, **kw)
    ratio = packed.tokens_per_second / padded.tokens_per_second if padded.tokens_per_second else float("nan")
    return {
        "model": model_name,
        "data": str(data),
        "args": kw,
        "padded": padded.as_dict(),
        "packed": packed.as_dict(),
        "ratio": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.packing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--data", type=Path, default=SAMPLES / "capitals_train.jsonl")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--max-seq-length", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    doc = compare(
        args.model,
        args.data,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        max_seq_length=args.max_seq_length,
        steps=args.steps,
        warmup=args.warmup,
        device=args.device,
    )
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"{doc['model']} on {doc['data']}: batch {args.batch_size}, micro-batch {args.micro_batch_size}, "
        f"max_seq_length {args.max_seq_length}, {args.steps} timed steps, device {args.device}"
    )
    print(f"{'variant':8s} {'attention':18s} {'forwards':>8s} {'padding':>8s} {'tokens/s':>12s}")
    for name in ("padded", "packed"):
        r = doc[name]
        print(
            f"{name:8s} {r['attention']:18s} {r['forwards']:8d} {r['padding']:8.1%} {r['tokens_per_second']:12,.0f}"
        )
    print(f"packed / padded tokens/s: {doc['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
