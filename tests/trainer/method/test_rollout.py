"""A reinforcement job's rollout (trainer.method.rollout): completions cut at their first stop token,
seeds stable and distinct, and sampling on docs-llama: ``n`` completions a prompt, the same for a seed
and others for another, the training's RNG and train mode untouched, a fixed length when asked."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from trainer.method.rollout import Sampling, cut_at_stop, rollout_seed, sample_completions
from trainer.samples import MODELS_DIR

pytestmark = pytest.mark.usefixtures("torch_single_thread")

DOCS_LLAMA = str(MODELS_DIR / "docs-llama")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def docs_llama() -> tuple[Any, Any]:
    """docs-llama (1.4M parameters) in float32 and its tokenizer."""
    from trainer.model.catalog import load_model, load_tokenizer

    tok = load_tokenizer(DOCS_LLAMA)
    return load_model(DOCS_LLAMA, dtype=torch.float32, seed=0, tokenizer=tok), tok


def prompts_of(tok: Any, *texts: str) -> list[list[int]]:
    msgs = ([{"role": "user", "content": t}] for t in texts)
    texts_ = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts_]


def sampling(tok: Any, **kw: Any) -> Sampling:
    from trainer.data.tokenizer import stop_token_ids

    args: dict[str, Any] = {
        "n": 3,
        "max_new_tokens": 12,
        "temperature": 1.0,
        "pad_id": tok.pad_token_id if tok.pad_token_id is not None else 0,
        "stop_ids": tuple(stop_token_ids(tok)),
        **kw,
    }
    return Sampling(**args)


def test_cut_at_stop_keeps_the_stop_token_or_the_limit() -> None:
    assert cut_at_stop([5, 6, 2, 0, 0], (2,), 5) == ([5, 6, 2], True)
    assert cut_at_stop([5, 6, 7, 8, 9], (2,), 4) == ([5, 6, 7, 8], False)
    assert cut_at_stop([9, 3, 2], (3, 2), 3) == ([9, 3], True)  # the first of any stop token
    assert cut_at_stop([5, 6, 7, 2], (2,), 3) == ([5, 6, 7], False)  # a stop past the limit is not seen
    assert cut_at_stop([2], (2,), 1) == ([2], True)
    assert cut_at_stop([4, 5], (), 8) == ([4, 5], False)


def test_rollout_seed_is_stable_distinct_and_63_bits() -> None:
    a = rollout_seed(0, "train", (1, 2))
    assert a == rollout_seed(0, "train", (1, 2))
    others = {
        rollout_seed(1, "train", (1, 2)),
        rollout_seed(0, "eval", (1, 2)),
        rollout_seed(0, "train", (2, 1)),
    }
    assert a not in others and len(others) == 3
    assert all(0 <= s < 2**63 for s in (a, *others))


def test_n_completions_per_prompt_seeded(docs_llama: tuple[Any, Any]) -> None:
    model, tok = docs_llama
    prompts = prompts_of(tok, "Use the word 'return'.", "Say something short about lists and objects.")
    s = sampling(tok)
    r = sample_completions(model, prompts, s, device=CPU, seed=7)
    assert len(r.completions) == len(r.truncated) == 2 * s.n
    assert all(1 <= len(c) <= s.max_new_tokens for c in r.completions)
    for c, trunc in zip(r.completions, r.truncated, strict=True):
        stops = [t for t in c if t in s.stop_ids]
        assert stops == ([] if trunc else [c[-1]])  # a stopped completion ends with its one stop token
        assert trunc == (len(c) == s.max_new_tokens and not stops)
    assert r.tokens == sum(len(c) for c in r.completions) and r.seconds > 0
    again = sample_completions(model, prompts, s, device=CPU, seed=7)
    assert again.completions == r.completions and again.truncated == r.truncated
    other = sample_completions(model, prompts, s, device=CPU, seed=8)
    assert other.completions != r.completions
    assert len({tuple(c) for c in r.completions}) > 1  # sampled, not greedy


def test_the_global_rng_and_train_mode_are_left_as_they_were(docs_llama: tuple[Any, Any]) -> None:
    model, tok = docs_llama
    prompts = prompts_of(tok, "Use the word 'class'.")
    model.train()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    sample_completions(model, prompts, sampling(tok, n=2), device=CPU, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training
    model.eval()
    sample_completions(model, prompts, sampling(tok, n=2), device=CPU, seed=1)
    assert not model.training
    model.train()


def _sharded_rollout(rank: int, world: int) -> tuple[int, list[list[int]], list[list[int]]]:
    """One rank: docs-llama's completions of its own prompt unsharded, then with the weights sharded over
    the ranks (FSDP2) and ``synced``; rank 0 stops at a token every sample has at once, rank 1 never
    stops. The forwards the sharded model ran, and both rollouts."""
    from trainer.model.catalog import load_model, load_tokenizer
    from trainer.run.distributed import init_from_env
    from trainer.run.fsdp_model import shard_model

    tok = load_tokenizer(DOCS_LLAMA)
    model = load_model(DOCS_LLAMA, dtype=torch.float32, seed=0, tokenizer=tok)
    prompts = prompts_of(tok, ["Use the word 'yield'.", "A sentence with 'string' in it, please."][rank])
    s = sampling(tok, n=3, max_new_tokens=10, stop_ids=tuple(range(len(tok))) if rank == 0 else ())
    alone = sample_completions(model, prompts, s, device=CPU, seed=3 + rank)
    ctx = init_from_env(device="cpu", timeout_seconds=60)
    assert ctx is not None
    shard_model(model, ctx, CPU)
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    synced = sample_completions(model, prompts, replace(s, synced=True), device=CPU, seed=3 + rank)
    return forwards[0], synced.completions, alone.completions


@pytest.mark.slow
def test_sharded_ranks_decode_in_step_until_every_rank_is_done() -> None:
    """FSDP2 weights: each forward all-gathers every rank's rows, so a rank whose samples all stopped at
    their first token keeps running forwards until the other's reach ``max_new_tokens`` (else the other
    waits in its gathers: the deadline); the completions are the unsharded, unsynced ones."""
    from tests.dist_ranks import run_ranks

    (early, stopped, alone0), (late, running, alone1) = run_ranks(_sharded_rollout, 2, timeout=120)
    assert early == late == 10  # the prefill and 9 decoding steps on both ranks
    assert all(len(c) == 1 for c in stopped) and all(len(c) == 10 for c in running)
    assert stopped == alone0 and running == alone1
