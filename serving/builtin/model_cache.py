"""The models the built-in backend keeps loaded: loaded on first use, the most recently used few kept
within a count and a memory budget, the least recently used dropped first.

A source is what ``trainer.model.catalog`` loads: a built-in config name (random init from seed 0, the
byte-level tokenizer) or a model directory (a job's ``final/`` or a checkpoint: merged safetensors,
config, tokenizer). Dropping a model from the cache drops only the cache's reference: a generation
still using it finishes, and its memory is freed after that.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving import prometheus

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class ModelTooLarge(Exception):
    """The model's weights alone exceed the cache's memory budget."""


@dataclass(frozen=True)
class LoadedModel:
    source: str
    model: Any  # transformers.PreTrainedModel, in eval mode on ``device``
    tokenizer: Any  # transformers.PreTrainedTokenizerBase with a chat template
    nbytes: int
    #: Longest sequence (prompt + new tokens) the model takes.
    max_length: int
    eos_ids: frozenset[int]
    pad_id: int
    #: :func:`weights_stamp` when it was loaded.
    stamp: tuple[int, ...] = ()


def pick_device(setting: str) -> str:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    import torch

    if setting != "auto":
        return setting
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(setting: str, device: str) -> torch.dtype:
    """``auto``: bfloat16 on a GPU that has it, float16 on another GPU, float32 on the CPU."""
    import torch

    if setting != "auto":
        dtype: torch.dtype = getattr(torch, setting)
        return dtype
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _weight_files(source: str) -> list[Path]:
    path = Path(source)
    if not path.is_dir():
        return []  # a built-in config
    return sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))


def weights_bytes(source: str) -> int:
    """Size of a model directory's weight files (0 for a built-in config): the budget check before
    loading, so a model that cannot fit is refused without being read."""
    return sum(f.stat().st_size for f in _weight_files(source))


def weights_stamp(source: str) -> tuple[int, ...]:
    """When the weights were last written: a folder rewritten in place (a resumed run re-exporting
    its final model) is loaded again."""
    return tuple(f.stat().st_mtime_ns for f in _weight_files(source))


def load(source: str, device: str, dtype: torch.dtype) -> LoadedModel:
    """Load ``source`` with ``trainer.model.catalog`` onto ``device``, in eval mode; it stops on the ids of the
    generation config's eos (eos and end-of-turn marker) and the tokenizer's eos."""
    from trainer.model.catalog import load_model, load_tokenizer, model_max_length

    tokenizer = load_tokenizer(source)
    # On a GPU the folder's shards go straight to the device (no full host copy); the generation config
    # stops on eos and the chat template's end-of-turn marker (trainer.data.tokenizer.stop_token_ids).
    model = load_model(source, dtype=dtype, seed=0, tokenizer=tokenizer, device=device)
    model.eval()
    nbytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids, default=0)
    return LoadedModel(
        source,
        model,
        tokenizer,
        nbytes,
        model_max_length(source),
        frozenset(eos_ids),
        int(pad),
        weights_stamp(source),
    )


class ModelCache:
    """Thread-safe LRU of :class:`LoadedModel` bounded by ``max_models`` and ``memory_bytes``."""

    def __init__(
        self,
        *,
        max_models: int,
        memory_bytes: int,
        device: str = "auto",
        dtype: str = "auto",
        loader: Callable[[str, str, Any], LoadedModel] = load,
    ) -> None:
        self.max_models = max_models
        self.memory_bytes = memory_bytes
        self._device_setting = device
        self._dtype_setting = dtype
        self._loader = loader
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}

    def get(self, source: str) -> LoadedModel:
        """The loaded model for ``source``, loading it (once, however many ask at the same time)."""
        with self._lock:
            hit = self._touch(source)
            if hit is not None:
                return hit
            gate = self._loading.setdefault(source, threading.Lock())
        with gate:
            try:
                return self._load(source)
            finally:
                with self._lock:
                    self._loading.pop(source, None)

    def _load(self, source: str) -> LoadedModel:
        with self._lock:
            hit = self._touch(source)  # loaded by the caller that held the gate before us
            if hit is not None:
                return hit
        estimate = weights_bytes(source)
        if estimate > self.memory_bytes:
            raise ModelTooLarge(
                f"its weights ({estimate} bytes) exceed inference_memory_bytes ({self.memory_bytes})"
            )
        device = pick_device(self._device_setting)
        loaded = self._loader(source, device, pick_dtype(self._dtype_setting, device))
        if loaded.nbytes > self.memory_bytes:
            raise ModelTooLarge(
                f"it takes {loaded.nbytes} bytes, over inference_memory_bytes ({self.memory_bytes})"
            )
        with self._lock:
            self._make_room(loaded.nbytes)
            self._models[source] = loaded
        prometheus.model_loaded(loaded.nbytes)
        log.info("inference: loaded %s (%d bytes) on %s", source, loaded.nbytes, device)
        return loaded

    def loaded(self) -> list[str]:
        """Sources in the cache, least recently used first."""
        with self._lock:
            return list(self._models)

    @property
    def bytes_in_use(self) -> int:
        with self._lock:
            return sum(m.nbytes for m in self._models.values())

    def clear(self) -> None:
        with self._lock:
            for m in self._models.values():
                prometheus.model_unloaded(m.nbytes)
            self._models.clear()

    def _touch(self, source: str) -> LoadedModel | None:
        hit = self._models.get(source)
        if hit is None:
            return None
        if hit.stamp != weights_stamp(source):  # rewritten since: load it again
            del self._models[source]
            prometheus.model_unloaded(hit.nbytes)
            return None
        self._models.move_to_end(source)
        return hit

    def _make_room(self, nbytes: int) -> None:
        used = sum(m.nbytes for m in self._models.values())
        while self._models and (len(self._models) >= self.max_models or used + nbytes > self.memory_bytes):
            source, old = self._models.popitem(last=False)
            used -= old.nbytes
            prometheus.model_unloaded(old.nbytes)
            log.info("inference: dropped %s (least recently used)", source)
