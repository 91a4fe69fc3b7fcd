"""A small pretrained base model for the convergence benchmark, made here and cached.

ZenFlow's premise (the gradient's important columns are few and stable) holds when fine-tuning a
pretrained model, not on a random init. Every machine with this repository has a Python standard
library, so the benchmark pretrains a small Llama-shaped model (byte-level tokenizer, ~3M parameters
by default) on its sources and docstrings, and saves it as a local Hugging Face directory that
``trainer.model.catalog`` loads like any local checkpoint. The fine-tuning task is a different one: short
chat exchanges about words and numbers (:func:`write_chat_task`).

The directory is cached under ``$ZENFLOW_BENCH_CACHE`` (default ``~/.cache/zenflow/bench``) keyed by
everything that shapes the weights (the shape, the recipe, the Python version and a digest of the
corpus), so the first run pretrains (minutes on a few CPU cores) and later runs load it.

    python -m bench.pretrained            # build (or find) the base; print its directory and losses
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FORMAT = 1  # bump when the recipe changes in a way the key does not capture


@dataclass(frozen=True)
class Recipe:
    hidden: int = 256
    intermediate: int = 688
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    seq: int = 128
    batch: int = 16
    steps: int = 1200
    lr: float = 2e-3
    warmup: int = 60
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    corpus_bytes: int = 24 << 20
    seed: int = 0


def cache_root() -> Path:
    return Path(os.environ.get("ZENFLOW_BENCH_CACHE", Path.home() / ".cache" / "zenflow" / "bench"))


def corpus(limit: int) -> str:
    """The standard library's ``.py`` sources (test suites left out), in path order, up to ``limit`` bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).parts
        if rel[0] in ("test", "idlelib", "lib2to3", "site-packages") or "tests" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(f"# file: {'/'.join(rel)}\n{text}\n")
        size += len(parts[-1])
        if size >= limit:
            break
    if not parts:
        raise RuntimeError(f"no Python sources found under {stdlib}")
    return "".join(parts)[:limit]


def _key(recipe: Recipe, text: str) -> str:
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {"format": FORMAT, "recipe": asdict(recipe), "python": sys.version.split()[0]}, sort_keys=True
        ).encode()
    )
    h.update(text.encode("utf-8", errors="replace"))
    return h.hexdigest()[:16]


def _byte_ids() -> Any:
    """id of each byte value in the byte-level tokenizer (GPT-2's byte-to-unicode alphabet, sorted)."""
    import torch

    from trainer.data.tokenizer import build_byte_tokenizer

    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}
    tok = build_byte_tokenizer()
    return torch.tensor([tok.convert_tokens_to_ids(char[b]) for b in range(256)])


def encode(text: str) -> Any:
    """``text`` as byte-level token ids (what the tokenizer gives, without its per-call overhead)."""
    import torch

    raw = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    return _byte_ids()[raw.long()]


def build(recipe: Recipe, *, log: Any = print) -> Path:
    """The cached base model directory for ``recipe`` (pretrained now if not cached yet)."""
    text = corpus(recipe.corpus_bytes)
    out = cache_root() / f"stdlib-llama-{_key(recipe, text)}"
    if (out / "config.json").is_file() and (out / "pretrain.json").is_file():
        return out
    from trainer.data.tokenizer import build_byte_tokenizer
    from trainer.samples.pretrain import pretrain_llama

    log(
        f"pretraining the base model on {len(text) / 1e6:.1f} MB of the Python standard library "
        f"({recipe.steps} steps of {recipe.batch}x{recipe.seq} tokens), cached in {out}"
    )
    ids = encode(text)
    n_valid = min(len(ids) // 20, 200_000)
    t0 = time.perf_counter()
    model, first, last, curve = pretrain_llama(
        recipe,
        ids[:-n_valid],
        ids[-n_valid:],
        max_positions=max(512, recipe.seq),
        valid_batches=8,
        log_points=10,
        digits=4,
        log=log,
    )
    info = {
        "recipe": asdict(recipe),
        "python": sys.version.split()[0],
        "corpus_bytes": len(text),
        "params": sum(p.numel() for p in model.parameters()),
        "valid_loss_before": first,
        "valid_loss_after": last,
        "train_curve": curve,
        "seconds": time.perf_counter() - t0,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        build_byte_tokenizer(model_max_length=model.config.max_position_embeddings).save_pretrained(tmp)
        (tmp / "pretrain.json").write_text(json.dumps(info, indent=2))
        if out.exists():  # a half-written directory of an interrupted run
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"pretrained: valid loss {first:.3f} -> {last:.3f} in {info['seconds']:.0f} s")
    return out


def _words(text: str, n: int = 400) -> list[str]:
    """Frequent lowercase English-looking words of the corpus's docstrings and comments."""
    counts: dict[str, int] = {}
    for w in re.findall(r"(?<![A-Za-z_])[a-z]{4,9}(?![A-Za-z_0-9])", text):
        counts[w] = counts.get(w, 0) + 1
    return sorted(sorted(counts, key=lambda w: (-counts[w], w))[:n])


def _example(rng: random.Random, words: list[str]) -> dict[str, Any]:
    kind = rng.randrange(5)
    w, w2 = rng.choice(words), rng.choice(words)
    a, b = rng.randrange(50), rng.randrange(50)
    q, ans = {
        0: (f"Spell the word {w} backwards.", w[::-1]),
        1: (f"Write {w} in capital letters.", w.upper()),
        2: (f"What is {a} plus {b}?", str(a + b)),
        3: (f"Which comes first in alphabetical order: {w} or {w2}?", min(w, w2)),
        4: (f"How many letters are in the word {w}?", str(len(w))),
    }[kind]
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]}


def write_chat_task(
    directory: Path, *, train: int = 600, valid: int = 120, seed: int = 1234
) -> tuple[Path, Path]:
    """The fine-tuning task (chat about words and numbers), as train/valid JSONL files in ``directory``."""
    words = _words(corpus(Recipe().corpus_bytes))
    rng = random.Random(seed)
    paths = []
    for name, n in (("chat_train.jsonl", train), ("chat_valid.jsonl", valid)):
        path = directory / name
        with path.open("w", encoding="utf-8") as f:
            for _ in range(n):
                f.write(json.dumps(_example(rng, words)) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=Recipe.steps)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = build(Recipe(steps=args.steps), log=lambda m: print(m, file=sys.stderr, flush=True))
    info = json.loads((out / "pretrain.json").read_text())
    print(
        json.dumps(
            {
                "directory": str(out),
                **{k: info[k] for k in ("params", "valid_loss_before", "valid_loss_after", "seconds")},
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
