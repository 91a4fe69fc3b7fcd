"""Batched decoding of the built-in backend: the choices of every request for one model decoded
together, one forward pass per step for all of them (:class:`Batch`).

A batch holds rows, one per choice, each with its own request's sampling (:class:`Sampler`:
presence/frequency penalties, temperature, top-p, a ``torch.Generator`` of the request's own, so a seeded
request draws the same tokens whatever else runs), stop sequences, token limit and eos. Prompts of
different lengths are left-padded, with the attention mask and per-row position ids telling the model
where each row's text starts. Rows join a running batch at the next step: their prompts are prefilled
in a forward of their own (a prompt shared by a request's ``n`` choices once) and their KV cache is
padded on the left to the batch's length and appended; finished or cancelled rows leave it, and the
padding columns no row needs any more are cut off the cache's left. That needs the plain KV cache of a
decoder (every layer a ``DynamicLayer``); a model with another kind (sliding-window layers) keeps its
rows together from the first step to the last and admits new ones in the next batch.

Each new token is turned into text incrementally (``serving.builtin.detokenize``) and cut at a stop
sequence (``serving.builtin.sampling.StopText``) without going over the text generated before.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from serving.builtin.detokenize import IncrementalDecoder
from serving.builtin.model_cache import LoadedModel
from serving.builtin.sampling import SamplingParams, StopText

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length"]


class Owner(Protocol):
    """The request a row belongs to (``serving.builtin.batcher.Work``)."""

    sampler: Sampler
    team: str

    def delta(self, index: int, text: str) -> None: ...

    def finished(self, row: Row, reason: FinishReason) -> None: ...


@dataclass(frozen=True)
class Choice:
    """One choice a request asks for: ``prompt`` shared by the choices of the same ``prompt_key``."""

    index: int
    prompt: tuple[int, ...]
    prompt_key: int
    max_tokens: int


class Sampler:
    """A request's pick of the next token over its rows' scores."""

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.params = params
        self.seed = seed
        self.penalties = bool(params.presence_penalty or params.frequency_penalty)
        #: Needs more than the batch's argmax.
        self.special = self.penalties or not params.greedy
        self._generator: torch.Generator | None = None

    def choose(self, scores: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        """``scores`` [rows, vocab] (float32), ``counts`` of each row's generated tokens: one token a row."""
        import torch

        p = self.params
        if counts is not None:
            scores = (
                scores - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(scores.dtype)
            )
        if p.greedy:
            return scores.argmax(-1)
        if p.temperature != 1.0:
            scores = scores / p.temperature
        if p.top_p < 1.0:
            # Keep the most likely tokens whose probabilities add up to top_p (at least one).
            ordered, order = scores.sort(dim=-1)
            beyond = ordered.softmax(-1).cumsum(-1) <= 1.0 - p.top_p
            beyond[:, -1] = False
            scores = scores.scatter(-1, order, ordered.masked_fill(beyond, float("-inf")))
        if self._generator is None:
            self._generator = torch.Generator(device=scores.device)
            self._generator.manual_seed(self.seed)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=self._generator).squeeze(1)


class Row:
    """One choice being generated: its tokens, text and how it ended."""

    def __init__(self, owner: Owner, choice: Choice, loaded: LoadedModel, stops: tuple[str, ...]) -> None:
        self.owner, self.choice = owner, choice
        self.index = choice.index
        self.generated = 0
        self.decoder = IncrementalDecoder(loaded.tokenizer)
        self.stop = StopText(stops)
        self.eos_ids = loaded.eos_ids
        self.finish_reason: FinishReason | None = None
        self.halted = False
        self.counts: torch.Tensor | None = None  # generated tokens by id, for the penalties

    @property
    def active(self) -> bool:
        return self.finish_reason is None and not self.halted

    def accept(self, token: int) -> None:
        self.generated += 1
        if self.counts is not None:
            self.counts[token] += 1
        if token in self.eos_ids:
            self._finish("stop")
            return
        piece = self.decoder.push(token)
        if piece:
            self._show(self.stop.append(piece))
        if self.stop.stopped:
            self._finish("stop")
        elif self.generated >= self.choice.max_tokens:
            self._finish("length")

    def _show(self, text: str) -> None:
        if text:
            self.owner.delta(self.index, text)

    def _finish(self, reason: FinishReason) -> None:
        if not self.stop.stopped:
            self._show(self.stop.append(self.decoder.flush(), final=True))
        self.finish_reason = reason
        self.owner.finished(self, reason)


def _plain(cache: Any) -> bool:
    from transformers.cache_utils import DynamicLayer

    layers: list[Any] = list(getattr(cache, "layers", None) or ())
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    import torch.nn.functional as F

    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [missing, 0]
    return F.pad(t, pad)


def _unique_prompts(
    joining: Sequence[tuple[Owner, Sequence[Choice], tuple[str, ...]]], *, plain: bool
) -> tuple[list[tuple[int, ...]], list[int]]:
    """The prompts to compute (a request's choices with one prompt share it when the cache is
    ``plain``) and, per choice, the index of its prompt."""
    slot: dict[tuple[int, int], int] = {}
    prompts: list[tuple[int, ...]] = []
    which: list[int] = []
    for owner, choices, _ in joining:
        for c in choices:
            key = (id(owner), c.prompt_key if plain else len(prompts))
            if key not in slot:
                slot[key] = len(prompts)
                prompts.append(c.prompt)
            which.append(slot[key])
    return prompts, which


class Batch:
    """The rows being decoded for one model, and their KV cache (see the module docstring)."""

    def __init__(self, loaded: LoadedModel) -> None:
        import torch

        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.model.device
        self.rows: list[Row] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [rows, length]: 1 where a row has a token
        self.lengths: torch.Tensor | None = None  # [rows]: each row's tokens so far (its next position)
        self.last: list[int] = []  # each row's latest token, the next step's input
        self.plain = True
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        self._torch = torch

    @property
    def empty(self) -> bool:
        return not self.rows

    @property
    def joinable(self) -> bool:
        """New rows may join at the next step (else they wait for this batch to end)."""
        return self.empty or self.plain

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, Any]:
        """The last position's logits (float32) and the cache (None: the model makes its own kind)."""
        kwargs: dict[str, Any] = {self._cache_kw: cache} if cache is not None else {}
        if self._keep_kw:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
        made = out.get("cache") if "cache" in out else out.get("past_key_values")  # the name before 5.x
        return out.logits[:, -1, :].float(), made

    def add(self, joining: Sequence[tuple[Owner, Sequence[Choice], tuple[str, ...]]]) -> list[list[Row]]:
        """Prefill the choices of each ``(owner, choices, stop sequences)`` together, in one forward pass,
        and take their first tokens; they decode with the batch from the next step on. Each group's rows
        are returned (those done at their first token already left the batch)."""
        torch = self._torch
        assert self.joinable and joining
        # A prompt shared by several choices of a request is computed once, then its cache is repeated
        # (a plain cache, as the batch's first prefill shows; until then it is assumed).
        prompts, which = _unique_prompts(joining, plain=self.plain)
        logits, cache, mask = self._prefill(prompts)
        if self.plain and not _plain(cache):  # seen at the batch's first prefill (a model makes one kind)
            self.plain = False
            if len(prompts) != len(which):
                return self.add(joining)  # again, a row of its own for each choice
        if len(prompts) != len(which):
            idx = torch.tensor(which, device=self.device)
            cache.batch_select_indices(idx)
            mask, logits = mask[idx], logits[idx]
        lengths = torch.tensor([len(c.prompt) for _, cs, _ in joining for c in cs], device=self.device)
        groups = self._new_rows(joining, logits)
        rows = [r for g in groups for r in g]
        if self.empty:
            self.cache, self.mask, self.lengths = cache, mask, lengths
            self.rows, self.last = rows, [self.loaded.pad_id] * len(rows)
        else:
            self._merge(cache, mask, lengths, rows)
        first = len(self.rows) - len(rows)
        tokens = self._choose(logits, rows)
        for i, (r, t) in enumerate(zip(rows, tokens, strict=True)):
            self.last[first + i] = t
            r.accept(t)
        self._compact()
        return groups

    def _prefill(self, prompts: list[tuple[int, ...]]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One forward pass over the prompts, left-padded: the last position's logits, the cache made,
        the attention mask."""
        torch = self._torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.loaded.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(ids, mask, positions, None)
        return logits, cache, mask

    def _new_rows(
        self, joining: Sequence[tuple[Owner, Sequence[Choice], tuple[str, ...]]], logits: torch.Tensor
    ) -> list[list[Row]]:
        """A row per choice, grouped by request (token counts for samplers with penalties)."""
        groups = [[Row(owner, c, self.loaded, stops) for c in choices] for owner, choices, stops in joining]
        for r in (r for g in groups for r in g):
            if r.owner.sampler.penalties:
                r.counts = self._torch.zeros(logits.shape[-1], dtype=self._torch.float32, device=self.device)
        return groups

    def _merge(self, cache: Any, mask: torch.Tensor, lengths: torch.Tensor, rows: list[Row]) -> None:
        torch = self._torch
        assert self.mask is not None and self.lengths is not None
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width, 2), _pad_left(theirs.keys, width, 2)])
            mine.values = torch.cat([_pad_left(mine.values, width, 2), _pad_left(theirs.values, width, 2)])
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(mask, width, 1)])
        self.lengths = torch.cat([self.lengths, lengths])
        self.rows += rows
        self.last += [self.loaded.pad_id] * len(rows)

    def step(self) -> None:
        """One token for every row: one forward pass over the batch."""
        torch = self._torch
        assert self.mask is not None and self.lengths is not None
        ids = torch.tensor(self.last, dtype=torch.long, device=self.device).unsqueeze(1)
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
        logits, _ = self._forward(ids, self.mask, self.lengths.unsqueeze(1), self.cache)
        self.lengths = self.lengths + 1
        tokens = self._choose(logits, self.rows)
        for i, (r, t) in enumerate(zip(self.rows, tokens, strict=True)):
            if r.active:
                self.last[i] = t
                r.accept(t)
        self._compact()

    def halt(self, owner: Owner) -> None:
        """Stop ``owner``'s rows (cancelled, or past its deadline): they leave at the next compaction."""
        for r in self.rows:
            if r.owner is owner:
                r.halted = True
        self._compact()

    def _choose(self, logits: torch.Tensor, rows: list[Row]) -> list[int]:
        torch = self._torch
        out = logits.argmax(-1)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if r.active and r.owner.sampler.special:
                groups.setdefault(id(r.owner), []).append(i)
        for positions in groups.values():
            sampler = rows[positions[0]].owner.sampler
            idx = torch.tensor(positions, device=logits.device)
            counts = None
            if sampler.penalties:
                counts = torch.stack([c for c in (rows[i].counts for i in positions) if c is not None])
            out[idx] = sampler.choose(logits.index_select(0, idx), counts)
        chosen: list[int] = out.tolist()
        return chosen

    def _compact(self) -> None:
        """Drop the rows that are done (a plain cache: out of the cache too) and the padding no row needs."""
        torch = self._torch
        keep = [i for i, r in enumerate(self.rows) if r.active]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.last, self.cache, self.mask, self.lengths = [], [], None, None, None
            return
        if not self.plain:
            return  # the finished rows ride along (their tokens unused) until the batch ends
        assert self.mask is not None and self.lengths is not None
        idx = torch.tensor(keep, device=self.device)
        self.cache.batch_select_indices(idx)
        self.mask, self.lengths = self.mask[idx], self.lengths[idx]
        self.rows = [self.rows[i] for i in keep]
        self.last = [self.last[i] for i in keep]
        lead = int((self.mask.cumsum(1) == 0).sum(1).min())
        if lead > 0:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, lead:]
                layer.values = layer.values[:, :, lead:]
            self.mask = self.mask[:, lead:]
