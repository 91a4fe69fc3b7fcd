"""Base models: the built-in config registry and local Hugging Face directories.

A job's ``model`` is either the name of a built-in config (random init from the job's seed, byte-level
tokenizer; nothing is downloaded, for the demo and tests) or a local directory holding a Hugging Face
causal-LM checkpoint (``config.json`` + weights + tokenizer files), loaded with
``local_files_only=True``. Anything else raises :class:`UnknownModelError`.

:func:`resolve_model`, :func:`default_learning_rate` and :func:`model_max_length` do not import torch
(the API checks a model name at job creation); :func:`load_tokenizer` and :func:`load_model` do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class BuiltinModel:
    """A named LlamaConfig trained from a seeded random init with the byte-level tokenizer."""

    name: str
    description: str
    config: dict[str, Any] = field(default_factory=dict)
    #: Base learning rate for full fine-tuning and for LoRA (``learning_rate: auto``).
    learning_rate: float = 1e-3
    lora_learning_rate: float = 3e-3


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "tiny-llama",
            "Llama, 2 layers, hidden 64, byte vocab (~0.13M params): demo and tests",
            dict(
                hidden_size=64,
                intermediate_size=172,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=1024,
            ),
            learning_rate=3e-3,
            lora_learning_rate=1e-2,
        ),
        BuiltinModel(
            "small-llama",
            "Llama, 8 layers, hidden 512, byte vocab (~25M params): GPU demo and benchmarks",
            dict(
                hidden_size=512,
                intermediate_size=1376,
                num_hidden_layers=8,
                num_attention_heads=8,
                num_key_value_heads=8,
                max_position_embeddings=2048,
            ),
            learning_rate=1e-3,
            lora_learning_rate=3e-3,
        ),
    )
}

#: Default base learning rates for local pretrained checkpoints.
PRETRAINED_LEARNING_RATE = 1e-5
PRETRAINED_LORA_LEARNING_RATE = 2e-4


class UnknownModelError(ValueError):
    """The model is neither a built-in config name nor a local directory with a config.json."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"unknown model {name!r}: not a built-in model ({', '.join(sorted(BUILTIN_MODELS))}) "
            "and not a local directory containing config.json"
        )


def resolve_model(name: str) -> BuiltinModel | Path:
    """The built-in entry or the local directory for ``name``; raises UnknownModelError."""
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]
    try:
        path = Path(name).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            return path.resolve()
    except (OSError, ValueError):  # a name too long for a path, or with a NUL byte, names no directory
        pass
    raise UnknownModelError(name)


def default_learning_rate(name: str, *, lora: bool) -> float:
    """Base learning rate used when the job says ``learning_rate: auto``."""
    m = resolve_model(name)
    if isinstance(m, BuiltinModel):
        return m.lora_learning_rate if lora else m.learning_rate
    return PRETRAINED_LORA_LEARNING_RATE if lora else PRETRAINED_LEARNING_RATE


def model_max_length(name: str) -> int:
    """Longest sequence the model supports (max_position_embeddings, else 2048)."""
    m = resolve_model(name)
    if isinstance(m, BuiltinModel):
        return int(m.config["max_position_embeddings"])
    cfg = json.loads((m / "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(cfg.get(key), int):
            return int(cfg[key])
    return 2048


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The model directory's tokenizer (with pad token and chat template ensured), or the byte one."""
    from trainer.tokenizer import build_byte_tokenizer, ensure_chat_ready

    m = resolve_model(name)
    if isinstance(m, BuiltinModel):
        return build_byte_tokenizer(model_max_length=int(m.config["max_position_embeddings"]))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(m), local_files_only=True)
    except (OSError, ValueError) as e:
        raise UnknownModelError(name) from e
    return ensure_chat_ready(tok)


def builtin_config(name: str) -> Any:
    """The ``transformers.LlamaConfig`` of a built-in model."""
    from transformers import LlamaConfig

    from trainer.tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS, byte_vocab_size

    m = BUILTIN_MODELS[name]
    vocab = (byte_vocab_size() + 7) // 8 * 8
    return LlamaConfig(
        vocab_size=vocab,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        tie_word_embeddings=False,
        **m.config,
    )


def load_model(
    name: str, *, dtype: torch.dtype, seed: int, tokenizer: PreTrainedTokenizerBase | None = None
) -> PreTrainedModel:
    """Build a built-in model from ``seed`` (deterministic) or load a local directory, on CPU.

    With ``tokenizer`` given, the embeddings grow when the tokenizer has more tokens than the model.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    m = resolve_model(name)
    if isinstance(m, BuiltinModel):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(builtin_config(name))
        model = model.to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(m), local_files_only=True, dtype=dtype)
    if tokenizer is not None and len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    return model
