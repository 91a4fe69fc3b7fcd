"""The built-in backend's preparation of one request, run in a preparing thread
(``serving.builtin.generation_pool``): load the model (cache), encode the prompts (the chat template for
chat) one by one against the per-request caps, check them against the model's context, and hand each
prompt's choices to the decode threads (``serving.builtin.batcher``) as one :class:`Work`."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

from serving.builtin.batcher import Work
from serving.builtin.generation import Choice, Sampler
from serving.builtin.model_cache import LoadedModel, ModelCache, ModelTooLarge
from serving.builtin.sampling import SamplingParams
from serving.builtin.tickets import Started, Ticket
from serving.errors import ServingError

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
    #: ``server_max_tokens``: the server's ``inference_max_tokens``, less when the request's
    #: choices would pass ``inference_max_request_tokens``), and the parameter it came in.
    max_tokens: int | None
    max_tokens_param: str
    server_max_tokens: int
    endpoint: str  # metrics label
    team: str = ""
    #: Tokens of one prompt, and of all of them (``inference_max_prompt_tokens``,
    #: ``inference_max_request_prompt_tokens``).
    max_prompt_tokens: int = 1 << 62
    max_request_prompt_tokens: int = 1 << 62


def encode(loaded: LoadedModel, prompt: Prompt) -> list[int]:
    tok = loaded.tokenizer
    if prompt.messages is not None:
        try:
            text = tok.apply_chat_template(list(prompt.messages), tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that rejects the conversation (e.g. roles out of order)
            raise ServingError(
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
            raise ServingError(
                400,
                "The prompt is empty and the model has no bos or eos token to start from",
                param=prompt.param,
                code="invalid_value",
            )
        ids = [int(start)]
    return ids


def encode_all(loaded: LoadedModel, req: BuiltinRequest) -> list[list[int]]:
    """Every prompt encoded, one after another, stopping at the first over a per-request cap (400)."""
    encoded: list[list[int]] = []
    total = 0
    for prompt in req.prompts:
        ids = encode(loaded, prompt)
        if len(ids) > req.max_prompt_tokens:
            raise ServingError(
                400,
                f"{prompt.param}: {len(ids)} tokens, over this server's {req.max_prompt_tokens} per prompt",
                param=prompt.param,
                code="invalid_value",
            )
        total += len(ids)
        if total > req.max_request_prompt_tokens:
            param = prompt.param.split("[")[0]
            raise ServingError(
                400,
                f"{param}: over this server's {req.max_request_prompt_tokens} prompt tokens per request "
                f"(reached at {prompt.param})",
                param=param,
                code="invalid_value",
            )
        encoded.append(ids)
    return encoded


def new_token_limit(loaded: LoadedModel, prompt: Prompt, prompt_len: int, req: BuiltinRequest) -> int:
    """How many tokens this prompt's choices may generate; 400 when the context cannot hold them."""
    room = loaded.max_length - prompt_len
    if room < 1:
        raise ServingError(
            400,
            f"This model's maximum context length is {loaded.max_length} tokens; the prompt "
            f"alone has {prompt_len}",
            param=prompt.param,
            code="context_length_exceeded",
        )
    if req.max_tokens is None:
        return min(room, req.server_max_tokens)
    if req.max_tokens > room:
        raise ServingError(
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
        raise ServingError(
            503, f"The model cannot be served by this server: {e}", param="model", code="model_too_large"
        ) from e
    except Exception as e:  # unreadable files: not the caller's input, and no traceback for them
        log.exception("inference: loading %s failed", source)
        raise ServingError(
            503, "The model could not be loaded for inference", param="model", code="model_unavailable"
        ) from e


def prepare(cache: ModelCache, req: BuiltinRequest, ticket: Ticket) -> Work:
    """Everything before decoding, in a preparing thread; ``Started`` (and an echo's prompts) go to
    ``ticket``. The work's choices are indexed prompt by prompt, ``n`` each."""
    loaded = load_or_fail(cache, req.source)
    encoded = encode_all(loaded, req)
    limits = [new_token_limit(loaded, p, len(ids), req) for p, ids in zip(req.prompts, encoded, strict=True)]
    prompt_tokens = sum(len(ids) for ids in encoded)
    n = req.params.n
    choices: list[Choice] = []
    prefixes: dict[int, str] = {}
    for i, (prompt, ids, limit) in enumerate(zip(req.prompts, encoded, limits, strict=True)):
        for j in range(n):
            choices.append(Choice(i * n + j, tuple(ids), i, limit))
            if prompt.echo and prompt.text:
                prefixes[i * n + j] = prompt.text
    seed = secrets.randbits(63) if req.params.seed is None else req.params.seed % 2**63
    ticket.emit(Started(prompt_tokens))
    for index, prefix in prefixes.items():
        ticket.delta(index, prefix)
    return Work(
        ticket,
        req.team,
        loaded,
        Sampler(req.params, seed),
        req.params.stop,
        choices,
        prompt_tokens,
        req.endpoint,
        prefixes=prefixes,
    )
