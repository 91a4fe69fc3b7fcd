"""The built-in inference backend's parts without the HTTP layer: stop sequences on streamed text, and
the model cache's count and memory bounds (real tiny models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.inference.model_cache import ModelCache, ModelTooLarge
from api.inference.sampling import StopText
from tests.api.chat_support import write_model_folder


def _feed(stop: StopText, text: str) -> list[str]:
    """Released pieces as ``text`` grows one character at a time, then the final flush."""
    out = [stop.update(text[:i]) for i in range(1, len(text) + 1)]
    out.append(stop.update(text, final=True))
    return [p for p in out if p]


def test_stop_text_holds_back_a_possible_stop_and_cuts_before_it() -> None:
    s = StopText(("END", "\n\n"))
    # "E" and "EN" wait until the space rules END out; the text ends before END.
    assert _feed(s, "abc EN dEND tail") == ["a", "b", "c", " ", "EN ", "d"] and s.stopped
    s = StopText(("END",))
    assert (
        s.update("xx EN") == "xx " and s.update("xx EN", final=True) == "EN"
    )  # no stop: all of it at the end
    s = StopText(())
    assert s.update("caf\ufffd") == "caf" and s.update("café") == "é"  # a UTF-8 sequence cut between tokens


def test_stop_text_finds_a_stop_that_spans_pieces() -> None:
    s = StopText(("<|x|>",))
    assert "".join(_feed(s, "hello <|x|> world")) == "hello " and s.stopped


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("cache")
    return [write_model_folder(root / f"m{i}", seed=i) for i in range(3)]


def test_cache_keeps_the_most_recently_used_within_its_count(folders: list[Path]) -> None:
    cache = ModelCache(max_models=2, memory_bytes=1 << 30, device="cpu")
    a, b, c = (str(f) for f in folders)
    first = cache.get(a)
    cache.get(b)
    assert cache.get(a) is first  # a hit, now the most recent
    cache.get(c)
    assert cache.loaded() == [a, c]  # b was the least recently used
    assert cache.bytes_in_use == 2 * first.nbytes


def test_cache_stays_within_its_memory_budget(folders: list[Path]) -> None:
    probe = ModelCache(max_models=1, memory_bytes=1 << 30, device="cpu").get(str(folders[0]))
    cache = ModelCache(max_models=5, memory_bytes=int(probe.nbytes * 1.5), device="cpu")
    cache.get(str(folders[0]))
    cache.get(str(folders[1]))
    assert cache.loaded() == [str(folders[1])] and cache.bytes_in_use <= cache.memory_bytes
    with pytest.raises(ModelTooLarge):
        ModelCache(max_models=5, memory_bytes=probe.nbytes // 2, device="cpu").get(str(folders[2]))


def test_cache_loads_a_folder_again_once_its_weights_are_rewritten(tmp_path: Path) -> None:
    import torch

    folder = write_model_folder(tmp_path / "final", seed=1)
    cache = ModelCache(max_models=2, memory_bytes=1 << 30, device="cpu")
    first = cache.get(str(folder))
    assert cache.get(str(folder)) is first
    write_model_folder(tmp_path / "final", seed=2)  # a resumed run exports its final model again
    second = cache.get(str(folder))
    assert second is not first and cache.loaded() == [str(folder)]
    weight = "model.embed_tokens.weight"
    assert not torch.equal(first.model.state_dict()[weight], second.model.state_dict()[weight])
