"""Sampling a group of completions per prompt from the current policy (a reinforcement job's rollout).

One ``generate`` call per rollout: the prompts left-padded into one batch, each repeated ``n`` times,
decoded with the KV cache under ``no_grad`` in eval mode. The sampling is seeded from the job's seed and
what identifies the rollout (a training step's: the step and its prompts' indices), in a forked RNG, so
a resumed run samples what the uninterrupted one would have and the training's own RNG is untouched.
Each completion is cut after its first stop token here.

With sharded weights every rank must run as many forwards as the others (each forward all-gathers
FSDP's weights): a rollout is then ``synced``, ``generate``'s ``synced_gpus`` (one all-reduce of "my rows
are done" a token), and a rank whose completions have all stopped keeps running forwards, sampling
nothing, until every rank's have (or ``max_new_tokens``). It samples what an unsynced rollout does.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Rollout:
    """``n`` completions of each prompt, prompt-major (rows ``i * n`` to ``i * n + n - 1`` are prompt i's)."""

    completions: list[list[int]]
    #: The completion ran to ``max_new_tokens`` without an end-of-sequence token.
    truncated: list[bool]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.completions)


@dataclass(frozen=True)
class Sampling:
    """How a rollout samples."""

    n: int
    max_new_tokens: int
    temperature: float
    pad_id: int
    #: The tokens that end a completion: eos and the chat template's end of turn.
    stop_ids: tuple[int, ...]
    #: Every rank of the default process group decodes until all are done (sharded weights: every rank
    #: the same forwards).
    synced: bool = False


def rollout_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed of the job's seed and what identifies the rollout (its step, its prompts' indices)."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _left_padded(prompts: list[list[int]], n: int, pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids, mask = [], []
    for p in prompts:
        for _ in range(n):
            ids.append([pad_id] * (width - len(p)) + p)
            mask.append([0] * (width - len(p)) + [1] * len(p))
    return ids, mask


def cut_at_stop(tokens: list[int], stop_ids: tuple[int, ...], limit: int) -> tuple[list[int], bool]:
    """A generated row's completion: up to and including its first stop token (then True: it stopped;
    ``generate`` pads a stopped row after it), else its ``limit`` tokens, every one sampled (False)."""
    for k, t in enumerate(tokens[:limit]):
        if t in stop_ids:
            return tokens[: k + 1], True
    return tokens[:limit], False


def sample_completions(
    model: Any, prompts: list[list[int]], s: Sampling, *, device: torch.device, seed: int
) -> Rollout:
    """``s.n`` completions of each prompt from ``model`` as it is now (see the module doc)."""
    import torch

    t0 = time.perf_counter()
    ids, mask = _left_padded(prompts, s.n, s.pad_id)
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    attention = torch.tensor(mask, dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                do_sample=True,
                temperature=s.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=s.max_new_tokens,
                pad_token_id=s.pad_id,
                eos_token_id=list(s.stop_ids) if s.stop_ids else None,
                use_cache=True,
                synced_gpus=s.synced,
            )
    finally:
        model.train(was_training)
    rows = out[:, input_ids.shape[1] :].tolist()
    cut = [cut_at_stop(r, s.stop_ids, s.max_new_tokens) for r in rows]
    return Rollout([c for c, _ in cut], [not stopped for _, stopped in cut], time.perf_counter() - t0)
