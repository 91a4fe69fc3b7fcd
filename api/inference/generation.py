"""One prompt's choices with transformers ``generate``: the built-in backend's decoding.

``generate`` runs greedy decoding over logits processors of ours: presence/frequency penalties, then
for sampling transformers' temperature and top-p warpers and a sampler drawing from this request's own
``torch.Generator`` (a seeded request is reproducible whatever else runs in the process; the global RNG
is never touched). A streamer sees each new token of every choice as it is made, cuts the text at a
stop sequence and hands the visible part on; a stopping criterion ends a choice that hit one, and every
choice when the request is cancelled (client gone) or past its deadline.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper
from transformers.generation.streamers import BaseStreamer

from api.inference.model_cache import LoadedModel
from api.inference.sampling import SamplingParams, StopText

FinishReason = Literal["stop", "length"]


class Sink(Protocol):
    """Where a generation's output goes as it is made."""

    def delta(self, index: int, text: str) -> None: ...

    def finished(self, index: int, reason: FinishReason) -> None: ...


@dataclass(frozen=True)
class ChoiceResult:
    index: int
    text: str
    finish_reason: FinishReason
    completion_tokens: int


class _Penalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the tokens generated so far."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        made = input_ids[:, self.prompt_len :]
        if made.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, made, torch.ones_like(made, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)  # type: ignore[return-value]


class _Sampler(LogitsProcessor):
    """Draws the next token from the (warped) distribution with a private generator and leaves only
    that token standing, so the greedy step around it picks it."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.generator: torch.Generator | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.generator is None:
            self.generator = torch.Generator(device=scores.device)
            self.generator.manual_seed(self.seed)
        probs = torch.softmax(scores.float(), dim=-1)
        picked = torch.multinomial(probs, 1, generator=self.generator)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, picked, 0.0)  # type: ignore[return-value]


def logits_processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    procs: list[LogitsProcessor] = []
    if params.presence_penalty or params.frequency_penalty:
        procs.append(_Penalties(prompt_len, params.presence_penalty, params.frequency_penalty))
    if not params.greedy:
        if params.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_p < 1.0:
            procs.append(TopPLogitsWarper(params.top_p))
        seed = secrets.randbits(63) if params.seed is None else params.seed % 2**63
        procs.append(_Sampler(seed))
    return LogitsProcessorList(procs)


@dataclass
class _Choice:
    index: int
    stop: StopText
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None


class Halted(Exception):
    """The generation was stopped from outside (cancelled or past its deadline) before it finished."""

    def __init__(self, completion_tokens: int) -> None:
        super().__init__(f"halted after {completion_tokens} tokens")
        self.completion_tokens = completion_tokens


class _Halt(StoppingCriteria):
    """Ends the rows whose choice is finished, and all of them once ``should_stop()`` says so."""

    def __init__(self, choices: list[_Choice], should_stop: Callable[[], bool]) -> None:
        self.choices, self.should_stop = choices, should_stop
        self.halted = False

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        done = [c.finish_reason is not None for c in self.choices]
        if not all(done) and self.should_stop():
            self.halted = True
            done = [True] * len(done)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


class _ChoiceStreamer(BaseStreamer):
    """Receives every step's new token of each row (``generate``'s streamer protocol); the first call
    is the prompt."""

    def __init__(
        self, loaded: LoadedModel, choices: list[_Choice], max_tokens: int, sink: Sink, halt: _Halt
    ) -> None:
        self.loaded, self.choices, self.max_tokens, self.sink, self.halt = (
            loaded,
            choices,
            max_tokens,
            sink,
            halt,
        )
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for choice, token in zip(self.choices, value.reshape(-1).tolist(), strict=True):
            if choice.finish_reason is not None:
                continue  # a finished row is padded to the others' length
            choice.tokens.append(int(token))
            if int(token) in self.loaded.eos_ids:
                self._finish(choice, "stop")
                continue
            self._release(choice, final=False)
            if choice.stop.stopped:
                self._finish(choice, "stop")
            elif len(choice.tokens) >= self.max_tokens:
                self._finish(choice, "length")

    def end(self) -> None:
        if self.halt.halted:
            return
        for choice in self.choices:
            if choice.finish_reason is None:
                self._finish(choice, "length")

    def _release(self, choice: _Choice, *, final: bool) -> None:
        text = self.loaded.tokenizer.decode(choice.tokens, skip_special_tokens=True)
        delta = choice.stop.update(text, final=final)
        if delta:
            self.sink.delta(choice.index, delta)

    def _finish(self, choice: _Choice, reason: FinishReason) -> None:
        if not choice.stop.stopped:
            self._release(choice, final=True)
        choice.finish_reason = reason
        self.sink.finished(choice.index, reason)


def generate_choices(
    loaded: LoadedModel,
    prompt_ids: list[int],
    params: SamplingParams,
    max_tokens: int,
    sink: Sink,
    *,
    first_index: int = 0,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[ChoiceResult]:
    """``params.n`` choices for one prompt (one batch of identical rows), indexed from ``first_index``;
    :class:`Halted` when ``should_stop()`` ended it first."""
    choices = [_Choice(first_index + i, StopText(params.stop)) for i in range(params.n)]
    device = loaded.model.device
    input_ids = torch.tensor([prompt_ids] * params.n, dtype=torch.long, device=device)
    config = GenerationConfig(
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=sorted(loaded.eos_ids) or None,
        pad_token_id=loaded.pad_id,
    )
    halt = _Halt(choices, should_stop)
    with torch.inference_mode():
        loaded.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            logits_processor=logits_processors(params, len(prompt_ids)),
            stopping_criteria=StoppingCriteriaList([halt]),
            streamer=_ChoiceStreamer(loaded, choices, max_tokens, sink, halt),
        )
    if halt.halted:
        raise Halted(sum(len(c.tokens) for c in choices))
    return [ChoiceResult(c.index, c.stop.text, c.finish_reason or "length", len(c.tokens)) for c in choices]
