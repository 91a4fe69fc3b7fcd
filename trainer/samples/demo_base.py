"""The demo's base model: a small Llama pretrained here on English prose, built once and cached.

``make run`` fine-tunes a base that already knows some language, so the answers it prints before and
after fine-tuning show what the job taught (the built-in ``tiny-llama`` is a random init: it learns the
answers' shape but not their words in a demo's few steps). Nothing is downloaded: the corpus is the
docstrings of the Python standard library (English paragraphs about programs, no geography), which
every machine with this repository has, and the base is pretrained from a fixed seed with a fixed
thread count (1.4M parameters, 240 steps: about a minute on 2 idle CPU cores, ten on a loaded one).

The result is a local Hugging Face folder (byte-level tokenizer, ``trainer.data.tokenizer``) that the
service offers as a base model when its parent is one of ``ZENFLOW_MODEL_ROOTS``. :func:`build` caches
it under ``root/<key>/`` where the key digests everything that shapes the weights (the recipe, the
corpus, the Python, torch and transformers versions). The demo does not pretrain: the repository ships
the result in bfloat16 (2.9 MB) as ``trainer/samples/models/docs-llama`` (:func:`ship`, with its
``pretrain.json``: recipe, seed, losses, key), so ``make run`` spends its time on the fine-tuning job.

    python -m trainer.samples.demo_base [--root DIR] [--ship]   # build (or find) it; --ship: copy it in
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: The base's name under its model root (the job's ``model``; ``ft:<this>:...`` after fine-tuning).
MODEL_NAME = "docs-llama"
#: Bump when the recipe changes in a way the key does not capture.
FORMAT = 1
_DOCSTRING = re.compile(r'"""(.*?)"""', re.S)
#: A paragraph kept for the corpus: plain English sentences (letters and punctuation), ending in a period.
_PROSE = re.compile(r"[A-Z][A-Za-z ,.;:'()-]*\.")


@dataclass(frozen=True)
class Recipe:
    """Everything that shapes the base's weights (with the corpus and the library versions)."""

    hidden: int = 192
    intermediate: int = 512
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    seq: int = 128
    batch: int = 16
    steps: int = 240
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    corpus_chars: int = 400_000
    seed: int = 0
    #: torch threads while pretraining: fixed, so a machine's result does not depend on its core count.
    threads: int = 2


@dataclass(frozen=True)
class DemoBase:
    """Where the base is and how it was made."""

    name: str
    root: Path
    folder: Path
    cached: bool
    seconds: float
    info: dict[str, Any]


def corpus(limit: int) -> str:
    """English paragraphs of the standard library's docstrings (test suites left out), in path order,
    one a line, up to ``limit`` characters."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    size = 0
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).parts
        if rel[0] in ("test", "idlelib", "lib2to3", "site-packages") or "tests" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for doc in _DOCSTRING.finditer(text):
            for para in re.split(r"\n\s*\n", textwrap.dedent(doc.group(1))):
                line = " ".join(para.split())
                if len(line) >= 60 and _PROSE.fullmatch(line):
                    lines.append(line)
                    size += len(line) + 1
                    if size >= limit:
                        return "\n".join(lines)[:limit]
    if not lines:
        raise RuntimeError(f"no docstrings found under {stdlib}")
    return "\n".join(lines)


def _key(recipe: Recipe, text: str) -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    meta = {
        "format": FORMAT,
        "recipe": asdict(recipe),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    h.update(json.dumps(meta, sort_keys=True).encode())
    h.update(text.encode("utf-8"))
    return h.hexdigest()[:16]


def build(root: Path, recipe: Recipe | None = None, *, log: Callable[[str], None] = print) -> DemoBase:
    """The cached base under ``root`` for ``recipe`` (pretrained now if not cached yet)."""
    recipe = recipe or Recipe()
    t0 = time.perf_counter()
    text = corpus(recipe.corpus_chars)
    model_root = root / _key(recipe, text)
    folder = model_root / MODEL_NAME
    if (folder / "config.json").is_file() and (folder / "pretrain.json").is_file():
        info = json.loads((folder / "pretrain.json").read_text())
        return DemoBase(MODEL_NAME, model_root, folder, True, time.perf_counter() - t0, info)
    log(
        f"pretraining the demo's base model ({MODEL_NAME}) on {len(text) / 1e3:.0f} kB of English "
        f"docstrings ({recipe.steps} steps of {recipe.batch}x{recipe.seq} bytes, {recipe.threads} threads), "
        f"cached in {model_root}"
    )
    model, info = _pretrain(recipe, text, log)
    model_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=model_root))
    try:
        from trainer.data.tokenizer import build_byte_tokenizer

        model.save_pretrained(tmp)
        build_byte_tokenizer(model_max_length=model.config.max_position_embeddings).save_pretrained(tmp)
        info["seconds"] = round(time.perf_counter() - t0, 1)
        (tmp / "pretrain.json").write_text(json.dumps(info, indent=2))
        if folder.exists():  # a half-written folder of an interrupted run
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(
        f"pretrained: valid loss {info['valid_loss_before']:.2f} -> {info['valid_loss_after']:.2f} "
        f"in {info['seconds']:.0f} s"
    )
    return DemoBase(MODEL_NAME, model_root, folder, False, time.perf_counter() - t0, info)


def _pretrain(recipe: Recipe, text: str, log: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
    """A Llama trained from ``recipe.seed`` on ``text`` (last 5% held out) with ``recipe.threads``
    torch threads (trainer.samples.pretrain); the model and its numbers."""
    import torch

    from trainer.data.tokenizer import build_byte_tokenizer
    from trainer.samples.pretrain import pretrain_llama

    ids = torch.tensor(build_byte_tokenizer()(text, add_special_tokens=False)["input_ids"])
    n_valid = len(ids) // 20
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        model, first, last, curve = pretrain_llama(
            recipe,
            ids[:-n_valid],
            ids[-n_valid:],
            max_positions=1024,
            valid_batches=4,
            log_points=4,
            digits=3,
            log=log,
        )
    finally:
        torch.set_num_threads(threads)
    info = {
        "model": MODEL_NAME,
        "recipe": asdict(recipe),
        "corpus": "docstrings of the Python standard library (trainer.samples.demo_base.corpus)",
        "corpus_chars": len(text),
        "params": sum(p.numel() for p in model.parameters()),
        "valid_loss_before": round(first, 4),
        "valid_loss_after": round(last, 4),
        "train_curve": curve,
    }
    return model, info


def default_root() -> Path:
    """``var/models`` of the repository (ignored by git)."""
    return Path(__file__).resolve().parents[2] / "var" / "models"


def ship(base: DemoBase, models_dir: Path) -> Path:
    """Save ``base`` in bfloat16 as ``models_dir/<name>`` (what the repository ships for the demo)."""
    import torch
    from transformers import LlamaForCausalLM

    out = models_dir / base.name
    if out.exists():
        shutil.rmtree(out)
    model = LlamaForCausalLM.from_pretrained(base.folder, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for f in base.folder.iterdir():  # tokenizer files and pretrain.json as they are
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    info = {**base.info, "key": base.root.name, "shipped_dtype": "bfloat16"}
    (out / "pretrain.json").write_text(json.dumps(info, indent=2))
    (out / "README.md").write_text(model_card(info, model.config.max_position_embeddings))
    return out


def model_card(info: dict[str, Any], context: int) -> str:
    """The shipped folder's README.md: what the base is (its first paragraph is what /v1/models shows)."""
    r = info["recipe"]
    return (
        f"# {info['model']}\n\n"
        f"A small Llama ({info['params'] / 1e6:.1f}M parameters: {r['layers']} layers, hidden {r['hidden']}, "
        f"a byte-level tokenizer, {context}-token context) pretrained here on {info['corpus_chars']:,} "
        f"characters of the Python standard library's docstrings ({r['steps']} steps, validation loss "
        f"{info['valid_loss_before']} -> {info['valid_loss_after']}): it writes English-like text and knows "
        "none of the demo's facts, so what a fine-tuning job teaches it shows. `make run` fine-tunes it.\n\n"
        "Made by `python -m trainer.samples.demo_base` (trainer/samples/demo_base.py); `pretrain.json` has "
        "the recipe and the losses.\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=default_root(), help="cache folder (a model root's parent)")
    ap.add_argument("--ship", action="store_true", help="save it in bfloat16 in trainer/samples/models")
    args = ap.parse_args(argv)
    base = build(args.root, log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.ship:
        from trainer.samples import MODELS_DIR

        print(f"shipped as {ship(base, MODELS_DIR)}", file=sys.stderr)
    print(json.dumps({"model": base.name, "model_root": str(base.root), "cached": base.cached, **base.info}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
