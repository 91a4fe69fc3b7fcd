"""Built-in inference against transformers ``generate`` on the same loaded model, in the same run.

    python -m bench.inference                                  # tiny-llama on the CPU, 4 and 16 streams
    python -m bench.inference --model small-llama --max-tokens 128 --streams 4
    python -m bench.inference --model "$(python -m bench.pretrained | tail -1)"   # a pretrained folder
    python -m bench.inference --json

Two comparisons, each against its baseline measured alongside it on the model the service itself
loaded (``serving.local.LocalEngine``'s built-in cache), greedy, one text prompt of ``--prompt-tokens`` bytes, at most
``--max-tokens`` new tokens (both sides stop at the model's eos the same way):

* **concurrent**: for each count in ``--streams`` (4 and 16), that many streamed ``/v1/completions``
  requests sent at once through the engine client (``serving.client``: admission, the generation
  threads, the server-sent events) against one direct ``model.generate`` of a batch of as many rows: completion tokens per second of each, and the
  ratio. Served one after another, the streams reach about 1/streams of the batched figure; decoded
  together in shared forward passes, close to it.
* **single**: one streamed request against one direct ``generate`` of one row: time to the first token
  (from the call; for the stream, its first text chunk) and the cost of each later token.

The engine is driven in process (``serving.local.LocalEngine``, as the serving process runs it; no HTTP,
no database, a client that never disconnects), so the figures are the backend's and the event bridge's, not the network's. Each
figure is the median of ``--repeats`` runs after one warm-up run of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Figures:
    tokens: int
    seconds: float
    first_token_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def per_token_seconds(self) -> float:
        """Time per token after the first (the decode step's cost, as the caller sees it)."""
        if self.tokens <= 1:
            return 0.0
        return (self.seconds - self.first_token_seconds) / (self.tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tokens_per_second": self.tokens_per_second,
            "per_token_seconds": self.per_token_seconds,
        }


def _median(runs: list[Figures]) -> Figures:
    return Figures(
        tokens=int(statistics.median(r.tokens for r in runs)),
        seconds=statistics.median(r.seconds for r in runs),
        first_token_seconds=statistics.median(r.first_token_seconds for r in runs),
    )


def _prompt(n: int) -> str:
    words = "the quick brown fox jumps over a lazy dog and then rests by the river bank "
    return (words * (n // len(words) + 1))[:n]


def direct(loaded: Any, prompt_ids: list[int], rows: int, max_tokens: int) -> Figures:
    """``model.generate`` of ``rows`` identical rows, greedy, stopping at the model's eos."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls = 0
            self.at = 0.0

        def put(self, value: torch.Tensor) -> None:
            self.calls += 1
            if self.calls == 2:  # the first call is the prompt
                self.at = time.perf_counter()

        def end(self) -> None:
            pass

    device = loaded.model.device
    ids = torch.tensor([prompt_ids] * rows, dtype=torch.long, device=device)
    config = GenerationConfig(
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=sorted(loaded.eos_ids) or None,
        pad_token_id=loaded.pad_id,
    )
    streamer = FirstToken()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = loaded.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=streamer
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    new = out[:, ids.shape[1] :].tolist()
    tokens = 0
    for row in new:  # up to and including the first eos (what the service counts), not the padding after it
        for t in row:
            tokens += 1
            if t in loaded.eos_ids:
                break
    return Figures(tokens, seconds, streamer.at - t0)


async def _stream(engine: Any, model: Any, body: Any, team: str) -> Figures:
    """One streamed completion through the engine client: its text chunks as they come."""
    from serving.client import Call, never_disconnected

    t0 = time.perf_counter()
    response = await engine.generate(Call(body, model, team, never_disconnected))
    first = 0.0
    tokens = 0
    async for chunk in response.body_iterator:
        line = chunk if isinstance(chunk, str) else chunk.decode()
        if not first and '"text":"' in line and '"text":""' not in line:
            first = time.perf_counter() - t0
        if '"usage":{' in line or '"error":' in line:  # the client's own cost kept small: parse only these
            obj = json.loads(line[len("data: ") :])
            if "error" in obj:
                raise RuntimeError(obj["error"])
            tokens = obj["usage"]["completion_tokens"]
    seconds = time.perf_counter() - t0
    await response._on_close()  # what the response does when it has been sent
    return Figures(tokens, seconds, first)


async def served(engine: Any, model: Any, prompt: str, streams: int, max_tokens: int) -> Figures:
    """``streams`` streamed requests at once (one team each, so no team's share gets in the way)."""
    from serving.schemas import CompletionRequest

    body = CompletionRequest(
        model=model.id,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    )
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(_stream(engine, model, body, f"bench-{i}") for i in range(streams)))
    seconds = time.perf_counter() - t0
    return Figures(sum(r.tokens for r in runs), seconds, min(r.first_token_seconds for r in runs))


def compare(
    model: str,
    *,
    streams: tuple[int, ...] = (4, 16),
    max_tokens: int = 64,
    prompt_tokens: int = 32,
    repeats: int = 3,
    device: str = "cpu",
) -> dict[str, Any]:
    """Each stream count's served tokens/s against a direct batch of as many rows, and one stream against
    one row, all on the one model the engine loaded, in this run."""
    from pathlib import Path

    from serving.client import ServedModel
    from serving.config import ServingSettings
    from serving.local import LocalEngine

    most = max(streams)
    settings = ServingSettings(
        _env_file=None,
        inference_device=device,
        inference_max_tokens=max(max_tokens, 16),
        inference_queue_size=max(8, most),
        inference_batch_rows=max(16, most),
    )
    path = Path(model) if Path(model).is_dir() else None
    ref = ServedModel(id=model, source=str(path) if path else model)
    prompt = _prompt(prompt_tokens)

    async def run() -> dict[str, Any]:
        engine = LocalEngine(settings)
        try:
            loaded = engine.builtin.cache.get(ref.source)
            ids = list(loaded.tokenizer(prompt)["input_ids"])
            # warm-up: the model, the threads, the allocator
            direct(loaded, ids, most, max_tokens)
            await served(engine, ref, prompt, most, max_tokens)
            out: dict[str, list[Figures]] = {}
            for _ in range(repeats):
                for n in streams:
                    out.setdefault(f"direct_batch_{n}", []).append(direct(loaded, ids, n, max_tokens))
                    out.setdefault(f"concurrent_{n}", []).append(
                        await served(engine, ref, prompt, n, max_tokens)
                    )
                out.setdefault("direct_one", []).append(direct(loaded, ids, 1, max_tokens))
                out.setdefault("one", []).append(await served(engine, ref, prompt, 1, max_tokens))
            return {k: _median(v).as_dict() for k, v in out.items()}
        finally:
            await engine.aclose()

    figures = asyncio.run(run())
    one, direct_one = figures["one"], figures["direct_one"]
    return {
        "model": model,
        "device": device,
        "streams": list(streams),
        "max_tokens": max_tokens,
        "prompt_tokens": prompt_tokens,
        "repeats": repeats,
        **figures,
        "concurrent_ratio": {
            n: figures[f"concurrent_{n}"]["tokens_per_second"]
            / figures[f"direct_batch_{n}"]["tokens_per_second"]
            for n in streams
        },
        "single_ratio": one["tokens_per_second"] / direct_one["tokens_per_second"],
        "first_token_extra_ms": 1000 * (one["first_token_seconds"] - direct_one["first_token_seconds"]),
        "per_token_extra_ms": 1000 * (one["per_token_seconds"] - direct_one["per_token_seconds"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.inference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama", help="a built-in config or a model folder")
    ap.add_argument(
        "--streams", default="4,16", help="stream counts, each against a direct batch of as many rows"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    doc = compare(
        args.model,
        streams=tuple(int(n) for n in args.streams.split(",")),
        max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        repeats=args.repeats,
        device=args.device,
    )
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"{doc['model']} on {doc['device']}: {doc['prompt_tokens']}-token prompt, at most "
        f"{doc['max_tokens']} new tokens, greedy, median of {doc['repeats']}"
    )
    print(f"{'run':34s} {'tokens':>7s} {'tokens/s':>10s} {'first token':>12s} {'per token':>10s}")
    rows = [
        *(
            row
            for n in doc["streams"]
            for row in (
                (f"direct_batch_{n}", f"direct generate, batch of {n}"),
                (f"concurrent_{n}", f"{n} concurrent streams"),
            )
        ),
        ("direct_one", "direct generate, one row"),
        ("one", "one stream"),
    ]
    for key, label in rows:
        r = doc[key]
        print(
            f"{label:34s} {r['tokens']:7d} {r['tokens_per_second']:10,.0f} "
            f"{1000 * r['first_token_seconds']:9.1f} ms {1000 * r['per_token_seconds']:7.2f} ms"
        )
    for n, ratio in doc["concurrent_ratio"].items():
        print(f"{n} streams / direct batch of {n}, tokens/s: {ratio:.2f}x")
    print(
        f"one stream / direct generate, tokens/s: {doc['single_ratio']:.2f}x "
        f"(first token {doc['first_token_extra_ms']:+.1f} ms, per token {doc['per_token_extra_ms']:+.2f} ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
