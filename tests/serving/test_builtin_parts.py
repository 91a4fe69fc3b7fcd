"""The built-in inference backend's parts without the HTTP layer: stop sequences on streamed text, and
the model cache's count and memory bounds (real tiny models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.builtin.model_cache import ModelCache, ModelTooLarge
from serving.builtin.sampling import StopText
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


def test_stop_text_append_matches_update_however_the_text_is_cut() -> None:
    import random

    rng = random.Random(3)
    text = "ab END cd E\nEN\n\nx END y" * 3
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), 12))
        whole, pieces = StopText(("END", "\n\n")), StopText(("END", "\n\n"))
        out_whole, out_pieces = [], []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            out_whole.append(whole.update(text[:b]))
            out_pieces.append(pieces.append(text[a:b]))
        assert out_pieces == out_whole and pieces.text == whole.text == "ab "


def test_incremental_decoder_adds_up_to_the_whole_decode() -> None:
    """Byte tokens cut UTF-8 characters: nothing half-made is released, and the pieces join into
    ``decode`` of all the tokens, also for bytes that never make a valid character."""
    from serving.builtin.detokenize import IncrementalDecoder
    from trainer.model.catalog import load_tokenizer

    tok = load_tokenizer("tiny-llama")
    for text in ("héllo wörld, 日本語 ok", "plain ascii", "🙂🙂 x"):
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        dec = IncrementalDecoder(tok)
        pieces = [dec.push(t) for t in ids]
        pieces.append(dec.flush())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
        assert not any("\ufffd" in p for p in pieces)
    broken = [*tok("ab", add_special_tokens=False)["input_ids"], 200, 201]  # lone continuation bytes
    dec = IncrementalDecoder(tok)
    joined = "".join(dec.push(t) for t in broken) + dec.flush()
    assert joined == tok.decode(broken, skip_special_tokens=True)


def test_team_shares_give_a_newcomer_a_slot_while_the_first_team_holds_them_all() -> None:
    from serving.builtin.team_shares import TeamShares

    shares = TeamShares(4)
    assert all(shares.admit("a") is None for _ in range(4))  # alone: every slot
    refused = shares.admit("a")
    assert refused is not None and refused.team_full and (refused.share, refused.teams) == (4, 1)
    assert shares.admit("b") is None  # two teams: 2 each; b holds none, so it gets in (5 of 8)
    assert shares.admit("b") is None
    refused = shares.admit("b")
    assert refused is not None and (refused.team_held, refused.share) == (2, 2)
    assert shares.admit("c") is None and shares.admit("d") is None  # ceil(4 / 4) = 1 each
    assert shares.admit("c") is not None
    for _ in range(4):
        shares.release("a")
    assert shares.held("a") == 0 and shares.total == 4
    assert shares.admit("e") is None  # a left: four teams, 1 each


def test_team_shares_never_pass_twice_the_slots() -> None:
    from serving.builtin.team_shares import TeamShares

    shares = TeamShares(2)
    admitted = sum(shares.admit(f"t{i}") is None for i in range(10))
    assert admitted == 4 and shares.total == 4  # 2 slots, each newcomer under its share, bound 2 x 2
    refused = shares.admit("t99")
    assert refused is not None and not refused.team_full


class _Owner:
    """What a request is to the batch: its sampler, its team, and where its text goes."""

    def __init__(self, temperature: float = 0.0, seed: int = 0, penalty: float = 0.0) -> None:
        from serving.builtin.generation import Sampler
        from serving.builtin.sampling import SamplingParams

        params = SamplingParams(temperature=temperature, presence_penalty=penalty)
        self.sampler = Sampler(params, seed)
        self.team = "t"
        self.text: dict[int, str] = {}
        self.reasons: dict[int, str] = {}

    def delta(self, index: int, text: str) -> None:
        self.text[index] = self.text.get(index, "") + text

    def finished(self, row: object, reason: str) -> None:
        self.reasons[row.index] = reason  # type: ignore[attr-defined]


def _greedy_reference(loaded: object, prompt: list[int], max_new: int) -> str:
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = loaded.model.generate(  # type: ignore[attr-defined]
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=sorted(loaded.eos_ids),  # type: ignore[attr-defined]
            pad_token_id=loaded.pad_id,  # type: ignore[attr-defined]
        )
    text: str = loaded.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)  # type: ignore[attr-defined]
    return text


def test_batch_rows_that_join_mid_decode_answer_like_generate_alone() -> None:
    """Prompts of different lengths join a running batch steps apart (left-padded caches appended);
    one is cancelled halfway; every other row's greedy text is transformers' own for its prompt."""
    import torch

    from serving.builtin.generation import Batch, Choice
    from serving.builtin.model_cache import load

    loaded = load("tiny-llama", "cpu", torch.float32)
    prompts = ["hello there", "a much longer prompt about rivers and foxes", "x", "to be cancelled"]
    owners = [_Owner() for _ in prompts]
    batch = Batch(loaded)
    max_rows = 0
    with torch.inference_mode():
        for k, (p, o) in enumerate(zip(prompts, owners, strict=True)):
            ids = tuple(loaded.tokenizer(p)["input_ids"])
            batch.add([(o, [Choice(0, ids, 0, 24)], ())])
            for _ in range(3):
                batch.step()
                max_rows = max(max_rows, len(batch.rows))
            if k == 3:
                batch.halt(o)
        for _ in range(100):
            if batch.empty:
                break
            batch.step()
    assert batch.empty and max_rows >= 3  # decoded together
    for p, o in zip(prompts[:3], owners[:3], strict=True):
        assert o.text[0] == _greedy_reference(loaded, list(loaded.tokenizer(p)["input_ids"]), 24)
        assert o.reasons == {0: "length"}
    assert owners[3].reasons == {}  # halted: no finish reported


def test_batch_sampling_is_seeded_per_request_and_choices_differ() -> None:
    import torch

    from serving.builtin.generation import Batch, Choice
    from serving.builtin.model_cache import load

    loaded = load("tiny-llama", "cpu", torch.float32)
    ids = tuple(loaded.tokenizer("hi")["input_ids"])

    def sample(seed: int) -> dict[int, str]:
        owner = _Owner(temperature=1.0, seed=seed, penalty=0.5)
        batch = Batch(loaded)
        with torch.inference_mode():
            batch.add([(owner, [Choice(i, ids, 0, 16) for i in range(3)], ())])
            for _ in range(40):
                if batch.empty:
                    break
                batch.step()
        return owner.text

    first = sample(5)
    assert sample(5) == first and len(set(first.values())) > 1 and sample(6) != first
