"""Request and response bodies of ``/v1/chat/completions`` and ``/v1/completions`` (OpenAI's shapes).

Requests are validated here (a bad field is a 400 naming it, ``api.core.errors``); unknown fields are
refused like OpenAI does ("unrecognized parameter"), so a client never believes a knob took effect
that we ignore. The few no-op fields OpenAI clients commonly send (``user``, ``metadata``, ``store``)
are accepted. Bounds that depend on the server (``max_tokens`` against ``inference_max_tokens`` and the
model's context) are checked when the request runs.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from serving.builtin.sampling import SamplingParams

#: Stop sequences per request, as OpenAI allows.
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_N = 16
#: Hard ceiling of ``max_tokens`` in the schema; the server's own (``inference_max_tokens``) is lower.
MAX_TOKENS_CEILING = 1_000_000
_INT64 = 2**63 - 1


def _encodable(text: str) -> str:
    """JSON can carry a lone surrogate (``"\\ud800"``) that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode text (a lone surrogate)") from None
    return text


#: Text that goes to the tokenizer.
Text = Annotated[str, AfterValidator(_encodable)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """A text part of a message's ``content`` list (images and audio are not supported)."""

    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    """One message of the conversation. ``developer`` is OpenAI's newer name for ``system``."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: str | None = Field(None, max_length=256)

    def template_dict(self) -> dict[str, str]:
        """The message as the chat template sees it: role and plain text."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(_Strict):
    #: A last chunk with ``usage`` (and no choices) before ``[DONE]``.
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields both endpoints share."""

    model: str = Field(min_length=1, max_length=512, description="A base model or the team's `ft:` id")
    temperature: float | None = Field(
        None, ge=0, le=2, allow_inf_nan=False, description="0 = greedy (deterministic); default 1"
    )
    top_p: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False, description="Nucleus sampling; default 1"
    )
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CEILING)
    stop: Text | list[Text] | None = Field(
        None, description=f"Up to {MAX_STOP} sequences; the text ends before the first one generated"
    )
    seed: int | None = Field(None, ge=-_INT64, le=_INT64, description="Same seed and request: same sample")
    n: int = Field(1, ge=1, le=MAX_N, description="Choices to generate")
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=512)
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        for s in items:
            if not s:
                raise ValueError("a stop sequence must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence is at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, v: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return v

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=self.stop_list,
            seed=self.seed,
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
        )


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: the conversation goes through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CEILING)
    logprobs: Literal[False] | None = Field(None, description="Not supported: only false")

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) wins over the older ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: raw prompts, no chat template (for prompt-style models)."""

    prompt: Text | list[Text] = Field(description="A prompt, or a list of them (choices of each in turn)")
    echo: bool = Field(False, description="Prefix each choice's text with its prompt")

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("at least one prompt")
        return v

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


# --- responses (documented in the OpenAPI schema; the stream's chunks are described in docs/api.md) ---

FinishReason = Literal["stop", "length"]


class UsageObject(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoiceObject(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletionObject(BaseModel):
    """A chat completion. With ``stream: true`` the answer is server-sent ``chat.completion.chunk``
    objects instead, then ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoiceObject]
    usage: UsageObject
    system_fingerprint: str | None = None


class TextChoiceObject(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: None = None


class TextCompletionObject(BaseModel):
    """A text completion (``stream: true``: ``text_completion`` chunks, then ``data: [DONE]``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoiceObject]
    usage: UsageObject
    system_fingerprint: str | None = None
