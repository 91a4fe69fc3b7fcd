"""Base models: the built-in config registry and local Hugging Face directories.

A job's ``model`` is either the name of a built-in config (random init from the job's seed, byte-level
tokenizer; nothing is downloaded, for the demo and tests) or a local directory holding a Hugging Face
causal-LM checkpoint (``config.json`` + weights + tokenizer files), loaded with
``local_files_only=True``. Anything else raises :class:`UnknownModelError`.

:func:`find_model`, :func:`default_learning_rate` and :func:`model_max_length` do not import torch
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

    from trainer.model.folder_check import ModelFolder


@dataclass(frozen=True)
class BuiltinModel:
    """A named LlamaConfig trained from a seeded random init with the byte-level tokenizer."""

    name: str
    description: str
    config: dict[str, Any] = field(default_factory=dict)
    #: Base learning rate for full fine-tuning and for LoRA (``learning_rate: auto``).
    learning_rate: float = 1e-3
    lora_learning_rate: float = 3e-3
    #: Engine settings a job on this model gets for the fields it leaves unset (see
    #: :func:`model_engine_defaults`); empty = the contract's own defaults.
    engine_defaults: dict[str, Any] = field(default_factory=dict)


#: ZenFlow settings for tiny-llama, measured with ``python -m bench.convergence --seeds 0,1,2,3,4,5``
#: (the reasoning is in trainer/samples/tiny-llama.yaml): from a random init at lr 3e-3 the column
#: importance is neither skewed nor stable, and the paper's fine-tuning defaults (topk 0.1, window 4,
#: selection per epoch) ended at ~3.6x device mode's validation loss (measured under the old summed-lr
#: CPU step, scale_cpu_lr=True); these end within ~2-3% of it. On a pretrained base the paper's defaults
#: are within 1% (bench/convergence.py).
TINY_LLAMA_ZENFLOW = {
    "topk_ratio": 0.25,
    "update_interval": 1,
    "select_interval": 1,
    "full_warm_up_rounds": 16,
}

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
            engine_defaults=TINY_LLAMA_ZENFLOW,
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

#: A pretrained base's default learning rate, by its size: full fine-tuning takes LR_AT_7B at 7B
#: parameters (Llama 2's chat fine-tuning: 2e-5; Alpaca at 7B: 2e-5; we take the lower end) and more as the
#: base shrinks, LR_AT_7B * (7e9 / params) ** LR_SIZE_EXPONENT, within [LR_AT_7B, LR_MAX]; LoRA trains a
#: few new weights and takes LORA_LR_FACTOR times that (2e-4 at 7B, peft's and QLoRA's usual), within
#: LORA_LR_MAX. The exponent: ``python -m bench.lr_sweep`` on the demo base (1.4M parameters) and on a
#: ``bench.pretrained`` base (figures in docs/api.md, "Learning rate").
LR_AT_7B = 1e-5
LR_SIZE_EXPONENT = 0.5
LR_MAX = 3e-3
LORA_LR_FACTOR = 20.0
LORA_LR_MAX = 1e-2


class UnknownModelError(ValueError):
    """The model is neither a built-in config name nor a local directory with a config.json."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"unknown model {name!r}: not a built-in model ({', '.join(sorted(BUILTIN_MODELS))}) "
            "and not a local directory containing config.json"
        )


def find_model(name: str) -> BuiltinModel | Path:
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


def check_model(name: str) -> ModelFolder | None:
    """A local folder's check (config, weights, tokenizer: trainer.model.folder_check.check_model_folder,
    raising ModelFolderError with the cause); None for a built-in model."""
    from trainer.model.folder_check import check_model_folder

    m = find_model(name)
    return None if isinstance(m, BuiltinModel) else check_model_folder(m)


def default_learning_rate(name: str, *, lora: bool) -> float:
    """Base learning rate used when the job says ``learning_rate: auto``: a built-in model's own, a
    pretrained folder's by its size (:data:`LR_AT_7B`)."""
    m = find_model(name)
    if isinstance(m, BuiltinModel):
        return m.lora_learning_rate if lora else m.learning_rate
    return learning_rate_for_size(estimated_params(m), lora=lora)


def learning_rate_for_size(params: int, *, lora: bool) -> float:
    """The rule of :data:`LR_AT_7B` for a base of ``params`` parameters."""
    full = LR_AT_7B * float((7e9 / max(params, 1)) ** LR_SIZE_EXPONENT)
    full = min(max(full, LR_AT_7B), LR_MAX)
    return min(full * LORA_LR_FACTOR, LORA_LR_MAX) if lora else full


def estimated_params(folder: Path) -> int:
    """A decoder's parameter count from its ``config.json`` alone (no torch): embeddings, attention with
    its key-value heads, the MLP (gated, Llama's names; or GPT-2's two matrices and learned positions),
    norms, and a separate output head unless tied. Exact for Llama-like configs, close for GPT-2 (biases
    left out), which is all a learning rate needs; 7B when it cannot tell."""
    try:
        c = json.loads((folder / "config.json").read_text())
        c = c.get("text_config", c)
        gpt2 = "hidden_size" not in c
        hidden = int(c["n_embd"] if gpt2 else c["hidden_size"])
        layers = int(c["n_layer"] if gpt2 else c["num_hidden_layers"])
        heads = int((c.get("n_head") if gpt2 else c.get("num_attention_heads")) or 1)
        inter = int((c.get("n_inner") if gpt2 else c.get("intermediate_size")) or 4 * hidden)
        kv = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or hidden // heads)
        vocab = int(c["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 7_000_000_000
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    mlp = (2 if gpt2 else 3) * hidden * inter
    positions = int(c.get("n_positions") or 0) * hidden if gpt2 else 0
    tied = c.get("tie_word_embeddings", gpt2)  # each family's own default when the file omits it
    head = 0 if tied else vocab * hidden
    return vocab * hidden + positions + layers * (attention + mlp + 2 * hidden) + hidden + head


def model_engine_defaults(name: str) -> dict[str, Any]:
    """The model's own defaults of the public engine settings (contract.engine.EngineKnobs fields), for
    those a job leaves unset: a built-in random-init config's measured zenflow settings; none for a local
    checkpoint (trainer.resolve applies them: a field the job gives always wins)."""
    m = find_model(name)
    return dict(m.engine_defaults) if isinstance(m, BuiltinModel) else {}


def pretrained_placement(device: torch.device) -> dict[str, Any]:
    """``from_pretrained`` options that put the weights on ``device`` shard by shard (CUDA); none on
    the CPU, where from_pretrained already fills the meta-initialised model shard by shard."""
    return {"device_map": {"": device}} if device.type == "cuda" else {}


def model_max_length(name: str) -> int:
    """Longest sequence the model supports: a local folder's position limit under any architecture's
    name for it (trainer.model.folder_check.position_limit), else 2048."""
    from trainer.model.folder_check import folder_position_limit

    m = find_model(name)
    if isinstance(m, BuiltinModel):
        return int(m.config["max_position_embeddings"])
    return folder_position_limit(m) or 2048


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The model directory's tokenizer (with pad token and chat template ensured), or the byte one."""
    from trainer.data.tokenizer import build_byte_tokenizer, ensure_chat_ready

    m = find_model(name)
    if isinstance(m, BuiltinModel):
        return build_byte_tokenizer(model_max_length=int(m.config["max_position_embeddings"]))
    from trainer.model.folder_check import load_folder_tokenizer

    return ensure_chat_ready(load_folder_tokenizer(m))  # ModelFolderError names what is wrong


def builtin_config(name: str) -> Any:
    """The ``transformers.LlamaConfig`` of a built-in model."""
    from transformers import LlamaConfig

    from trainer.data.tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS, byte_vocab_size

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
    name: str,
    *,
    dtype: torch.dtype,
    seed: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
    device: torch.device | str | None = None,
) -> PreTrainedModel:
    """Build a built-in model from ``seed`` (deterministic) or load a local directory, on ``device``
    (default: CPU).

    A local directory is loaded straight onto a CUDA device (transformers' ``device_map``: the model is
    made on the meta device and each safetensors shard is read and moved in turn), so the host never
    holds a full copy: peak RSS is about one shard beyond the process. A built-in model (small) is made
    on the CPU, so a seed gives the same weights on every device, then moved.
    With ``tokenizer`` given, the embeddings grow when the tokenizer has more tokens than the model, and
    the generation config stops on the tokenizer's stop tokens (trainer.data.tokenizer.stop_token_ids).
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    target = torch.device("cpu" if device is None else device)
    m = find_model(name)
    model: PreTrainedModel
    if isinstance(m, BuiltinModel):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(builtin_config(name))
        model.to(dtype)  # type: ignore[arg-type]  # mypy mis-binds transformers' wrapped Module.to
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(m), local_files_only=True, dtype=dtype, **pretrained_placement(target)
        )
    model.to(target)  # type: ignore[arg-type]  # no-op where the weights already are
    if tokenizer is not None:
        fit_to_tokenizer(model, tokenizer)
    return model


def fit_to_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    """Grow the embeddings to the tokenizer's tokens and make generation stop on eos and the
    end-of-turn marker; the number of rows added (tokens the tokenizer gained, e.g. an end-of-turn
    marker; see trainer.data.tokenizer: a LoRA adapter must then carry the embeddings to be usable)."""
    import torch

    from trainer.data.tokenizer import align_generation_config

    vocab = model.get_input_embeddings().weight
    assert isinstance(vocab, torch.Tensor)
    added = max(0, len(tokenizer) - vocab.shape[0])
    if added:
        model.resize_token_embeddings(len(tokenizer))
    align_generation_config(model, tokenizer)
    return added
