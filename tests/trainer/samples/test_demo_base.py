"""trainer.samples.demo_base: the demo's base is rebuilt from its recipe and seed, identically, and cached."""

from __future__ import annotations

from pathlib import Path

from trainer.model.catalog import check_model
from trainer.samples.demo_base import MODEL_NAME, Recipe, build, corpus, ship

#: The recipe's shape, small enough for a unit test.
TINY = Recipe(
    hidden=32,
    intermediate=64,
    layers=1,
    heads=2,
    kv_heads=1,
    seq=32,
    batch=2,
    steps=3,
    warmup=1,
    corpus_chars=20_000,
)


def test_the_corpus_is_english_prose_without_the_demo_facts() -> None:
    text = corpus(Recipe().corpus_chars)
    assert len(text) == Recipe().corpus_chars and text.count("\n") > 1000
    assert "the" in text.split()
    assert not [w for w in ("France", "Paris", "Japan", "Tokyo") if w in text]  # the job teaches those


def test_build_is_reproducible_and_cached(tmp_path: Path) -> None:
    logged: list[str] = []
    first = build(tmp_path / "a", TINY, log=logged.append)
    again = build(tmp_path / "a", TINY, log=logged.append)
    other = build(tmp_path / "b", TINY, log=logged.append)
    assert not first.cached and again.cached and again.folder == first.folder
    assert first.name == MODEL_NAME and first.folder == first.root / MODEL_NAME
    assert sum(m.startswith("pretraining") for m in logged) == 2  # the cached one did not pretrain
    weights = (first.folder / "model.safetensors").read_bytes()
    assert (other.folder / "model.safetensors").read_bytes() == weights  # same recipe, same seed, same bytes
    assert check_model(str(first.folder)) is not None
    shipped = ship(first, tmp_path / "shipped")
    assert check_model(str(shipped)) is not None
    assert (shipped / "model.safetensors").stat().st_size < len(weights)  # bfloat16
