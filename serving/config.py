"""The inference settings (env prefix ``ZENFLOW_API_``, the names they had when inference ran only inside
the API, so one environment configures the API and the serving process alike).

Read by the serving process (``python -m serving``) and by the API, which is its own serving process
when ``inference_server_url`` is empty (the embedded default) and otherwise sends every chat and
completion request there (``serving.remote``). Where the serving process is (its URL, token and request
timeout) is ``store.serving_endpoint``'s, which the workers read too.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, Self

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from store.serving_endpoint import ServingEndpoint


class ServingSettings(ServingEndpoint):
    model_config = SettingsConfigDict(env_prefix="ZENFLOW_API_", env_file=".env", extra="ignore")

    #: ``builtin``: transformers ``generate`` in the serving process; ``vllm``: forward to ``inference_vllm_url``
    #: the models vLLM serves (LoRA adapters loaded per model id), the others stay built-in.
    inference_backend: Literal["builtin", "vllm"] = "builtin"
    inference_vllm_url: str = ""
    #: Requests forwarded to vLLM at once (it batches and queues them itself); more: 429.
    inference_vllm_max_requests: int = Field(64, ge=1)
    #: Decode threads of the built-in backend (models decoding at once; the requests for one model are
    #: decoded together), and the requests admitted beyond them: ``inference_threads +
    #: inference_queue_size`` admission slots, of which each of the T teams asking may hold
    #: ceil(slots / T); more: 429 (serving.builtin.team_shares).
    inference_threads: int = Field(1, ge=1, le=64)
    inference_queue_size: int = Field(8, ge=0)
    #: Choices (rows) decoded together in one forward pass per model; a request's choices beyond the
    #: room left join as rows finish.
    inference_batch_rows: int = Field(16, ge=1, le=1024)
    #: How long a decode thread stays on one model while another model waits for a thread (its batch
    #: parked, resumed at its next turn; serving.builtin.batcher): what a request to another model waits
    #: per model ahead of it.
    inference_slice_seconds: float = Field(0.2, gt=0, le=60)
    #: ``Retry-After`` of that 429.
    inference_retry_after_seconds: float = Field(2.0, gt=0)
    #: Per request: prompts in a ``/v1/completions`` list, tokens of one prompt (chat: the rendered
    #: conversation), tokens of all its prompts, and completion tokens it may ask for, prompts x ``n`` x
    #: ``max_tokens`` (without ``max_tokens`` its default shrinks to fit). Over one: 400 naming the field,
    #: the counts checked before admission, the tokens as the prompts are encoded (stopping at the first over).
    inference_max_prompts: int = Field(64, ge=1)
    inference_max_prompt_tokens: int = Field(8192, ge=1)
    inference_max_request_prompt_tokens: int = Field(32768, ge=1)
    inference_max_request_tokens: int = Field(16384, ge=1)
    #: Loaded models kept (least recently used dropped first), and their memory budget in bytes.
    inference_max_models: int = Field(2, ge=1)
    inference_memory_bytes: int = Field(8 * 1024**3, gt=0)
    #: ``auto``: the first GPU when there is one, else the CPU; dtype ``auto``: bf16/fp16 on a GPU, fp32 on the CPU.
    inference_device: str = "auto"
    inference_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: Largest ``max_tokens`` a request may ask for (and the default cap when it gives none).
    inference_max_tokens: int = Field(2048, ge=1)

    @model_validator(mode="after")
    def _vllm_needs_its_url(self) -> Self:
        if self.inference_backend == "vllm" and not self.inference_vllm_url:
            raise ValueError("inference_vllm_url is required with inference_backend=vllm")
        return self


def server_token(settings: ServingSettings) -> str:
    """The token the serving process requires of every call; ValueError when none is set."""
    token = settings.inference_server_token.get_secret_value()
    if not token:
        raise ValueError(
            "the serving process needs ZENFLOW_API_INFERENCE_SERVER_TOKEN (the API sends the same): "
            "it serves any team's models to whoever reaches it with that token"
        )
    return token


@lru_cache(maxsize=1)
def get_serving_settings() -> ServingSettings:
    return ServingSettings()
