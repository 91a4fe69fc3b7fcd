"""Text embeddings for text_similarity's ``cosine``: a Hugging Face model folder the operator names
(``ZENFLOW_GRADER_EMBEDDING_MODEL``: a sentence-embedding model such as a sentence-transformers folder, or
any model transformers' ``AutoModel`` loads), on the CPU of the process that grades. A text's vector is
its last hidden state mean-pooled over its tokens, normalised (the sentence-transformers recipe for
mean-pooling models); a text is cut at :data:`MAX_TOKENS`. The model loads at the first text, once per
process and folder, and embeds one batch at a time (the grading threads take turns)."""

from __future__ import annotations

import functools
import threading
from typing import Any

from trainer.graders.metrics import MetricUnavailable

MAX_TOKENS = 512


class Embedder:
    """:data:`trainer.graders.text_similarity.Embed` over the model in ``folder``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._loaded: tuple[Any, Any] | None = None

    def _load(self) -> tuple[Any, Any]:
        if self._loaded is None:
            from transformers import AutoModel, AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(self.folder)
                model = AutoModel.from_pretrained(self.folder, dtype="float32").eval()
            except (OSError, ValueError) as err:
                raise MetricUnavailable(f"the embedding model {self.folder!r} did not load: {err}") from None
            if tokenizer.pad_token is None:  # a decoder's tokenizer: padding is masked out anyway
                tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
            self._loaded = tokenizer, model
        return self._loaded

    def __call__(self, texts: list[str]) -> list[list[float]]:
        import torch

        with self._lock, torch.inference_mode():
            tokenizer, model = self._load()
            batch = tokenizer(
                texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
            )
            hidden = model(**batch).last_hidden_state.float()
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            return torch.nn.functional.normalize(mean, dim=-1).tolist()


@functools.cache
def embedder(folder: str) -> Embedder:
    """The process's embedder of ``folder`` (loaded at its first text)."""
    return Embedder(folder)
