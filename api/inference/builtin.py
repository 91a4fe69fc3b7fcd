"""The built-in backend's job for one request, run in a generation thread (``api.inference.generation_pool``):
load the model (cache), encode the prompts (the chat template for chat), check them against the
model's context, generate each prompt's choices, report usage."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from api.core.errors import APIError
from api.inference import metrics
from api.inference.generation_pool import Completed, Started, Ticket, TimedOut
from api.inference.model_cache import LoadedModel, ModelCache, ModelTooLarge
from api.inference.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat ``messages`` (through the chat template) or raw ``text``; ``param`` names it
    in errors (``messages``, ``prompt``, ``prompt[2]``)."""

    param: str
    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None
    #: /v1/completions with ``echo``: each choice's text starts with the prompt.
    echo: bool = False


@dataclass(frozen=True)
class BuiltinRequest:
    source: str  # what trainer.model.catalog loads: a built-in name or a model directory
    prompts: tuple[Prompt, ...]
    params: SamplingParams
    #: The limit of new tokens the request gave (None: the model's remaining context, up to
    #: ``server_max_tokens``), and the parameter it came in.
    max_tokens: int | None
    max_tokens_param: str
    server_max_tokens: int
    endpoint: str  # metrics label


def encode(loaded: LoadedModel, prompt: Prompt) -> list[int]:
    tok = loaded.tokenizer
    if prompt.messages is not None:
        try:
            text = tok.apply_chat_template(list(prompt.messages), tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that rejects the conversation (e.g. roles out of order)
            raise APIError(
                400,
                f"The model's chat template refused the messages: {e}",
                param=prompt.param,
                code="invalid_value",
            ) from e
        # The template writes the special tokens (bos) itself.
        return list(tok(text, add_special_tokens=False)["input_ids"])
    ids = list(tok(prompt.text or "")["input_ids"])
    if not ids:  # an empty prompt (OpenAI accepts ""): generation starts from bos, else eos
        start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        if start is None:
            raise APIError(
                400,
                "The prompt is empty and the model has no bos or eos token to start from",
                param=prompt.param,
                code="invalid_value",
            )
        ids = [int(start)]
    return ids


def new_token_limit(loaded: LoadedModel, prompt: Prompt, prompt_len: int, req: BuiltinRequest) -> int:
    """How many tokens this prompt's choices may generate; 400 when the context cannot hold them."""
    room = loaded.max_length - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {loaded.max_length} tokens; the prompt "
            f"alone has {prompt_len}",
            param=prompt.param,
            code="context_length_exceeded",
        )
    if req.max_tokens is None:
        return min(room, req.server_max_tokens)
    if req.max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {loaded.max_length} tokens; you asked for "
            f"{prompt_len + req.max_tokens} ({prompt_len} in the prompt, {req.max_tokens} in the "
            "completion)",
            param=req.max_tokens_param,
            code="context_length_exceeded",
        )
    return req.max_tokens


def load_or_fail(cache: ModelCache, source: str) -> LoadedModel:
    try:
        return cache.get(source)
    except ModelTooLarge as e:
        raise APIError(
            503, f"The model cannot be served by this server: {e}", param="model", code="model_too_large"
        ) from e
    except Exception as e:  # unreadable files: not the caller's input, and no traceback for them
        log.exception("inference: loading %s failed", source)
        raise APIError(
            503, "The model could not be loaded for inference", param="model", code="model_unavailable"
        ) from e


def run(cache: ModelCache, req: BuiltinRequest, ticket: Ticket) -> None:
    """The whole request in the generation thread; events go to ``ticket``. Tokens are counted in
    the metrics here, those of a generation stopped early included (they were computed)."""
    from api.inference.generation import Halted, generate_choices

    loaded = load_or_fail(cache, req.source)
    encoded = [encode(loaded, p) for p in req.prompts]
    limits = [new_token_limit(loaded, p, len(ids), req) for p, ids in zip(req.prompts, encoded, strict=True)]
    prompt_tokens = sum(len(ids) for ids in encoded)
    ticket.emit(Started(prompt_tokens))
    n = req.params.n
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    completion_tokens = 0
    for i, (prompt, ids, limit) in enumerate(zip(req.prompts, encoded, limits, strict=True)):
        prefix = (prompt.text or "") if prompt.echo else ""
        for j in range(n):
            if prefix:
                ticket.delta(i * n + j, prefix)
        try:
            results = generate_choices(
                loaded, ids, req.params, limit, ticket, first_index=i * n, should_stop=ticket.should_stop
            )
        except Halted as h:
            metrics.tokens(req.endpoint, prompt_tokens, completion_tokens + h.completion_tokens)
            if ticket.timed_out:
                raise TimedOut() from None
            return  # cancelled: nobody is waiting for the result
        for r in results:
            texts[r.index] = prefix + r.text
            reasons[r.index] = r.finish_reason
            completion_tokens += r.completion_tokens
    metrics.tokens(req.endpoint, prompt_tokens, completion_tokens)
    ticket.emit(Completed(texts, reasons, prompt_tokens, completion_tokens))
