"""Checks of a local base-model folder before a job is accepted: config, weights, tokenizer.

A folder a user brings must hold a ``config.json`` naming a causal-LM architecture transformers knows,
weights (``*.safetensors``, or ``pytorch_model*.bin``, sharded through their index), and a tokenizer that
loads and has a vocabulary. :func:`check_model_folder` checks all three cheaply: the config and the
tokenizer are loaded, the weights only have their safetensors headers (or index) read, never their
tensors, and those headers' shapes must fit the config (trainer.model.weight_shapes: the model the
config describes is built on the meta device). What is wrong raises :class:`ModelFolderError`, whose message names the file and the cause.

Also here: the folder's position limit (:func:`folder_position_limit`): the config's limit under any of
its architectures' names for it, else a tokenizer's ``model_max_length`` when it is a real limit.

This module imports transformers and safetensors only inside the functions that load files, and nothing
from the rest of the job library (``trainer.model.catalog`` builds on it).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.model.folder_errors import ModelFolderError as ModelFolderError  # re-exported here
from trainer.model.folder_errors import first_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Config keys that hold the longest sequence the position embeddings (or the RoPE base length) allow,
#: by architecture: Llama/Qwen2/Mistral/Phi-3/Gemma (max_position_embeddings), GPT-2/GPT-J/CodeGen
#: (n_positions, older files n_ctx), ChatGLM (seq_length), MPT (max_seq_len), others
#: (max_sequence_length). Multimodal configs keep the language model's in ``text_config``.
POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
)
#: A tokenizer's ``model_max_length`` above this is transformers' "no limit" placeholder (1e30), not a limit.
SANE_TOKENIZER_MAX = 10_000_000
#: Files a tokenizer is built from (any one of them).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
)
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
#: Text every usable tokenizer turns into known tokens.
_PROBE = "hello"


@dataclass(frozen=True)
class ModelFolder:
    """What the check of a folder found."""

    path: Path
    model_type: str
    #: Longest sequence the model supports, or None when neither config nor tokenizer sets one.
    position_limit: int | None
    weight_files: tuple[str, ...]
    #: From the safetensors headers (None for .bin weights, whose count needs the tensors read).
    num_parameters: int | None
    vocab_size: int


# --- config ------------------------------------------------------------------------------------------


def _read_json(path: Path, folder: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFolderError(folder, f"{path.name} is missing") from None
    except UnicodeDecodeError as e:
        raise ModelFolderError(folder, f"{path.name} is not UTF-8 text ({e.reason})") from e
    except json.JSONDecodeError as e:
        raise ModelFolderError(
            folder, f"{path.name} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from e
    except OSError as e:
        raise ModelFolderError(folder, f"{path.name} cannot be read: {e.strerror or e}") from e
    if not isinstance(data, dict):
        raise ModelFolderError(folder, f"{path.name} must hold a JSON object, not {type(data).__name__}")
    return data


def read_config(folder: Path) -> dict[str, Any]:
    """``config.json`` as a dict; ModelFolderError when it is missing, not JSON or not an object."""
    return _read_json(folder / "config.json", folder)


def position_limit(config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None) -> int | None:
    """The longest sequence a model with this config supports: the config's own limit (see
    :data:`POSITION_KEYS`, also under ``text_config``), else the tokenizer's ``model_max_length`` when
    it is a real limit; None when neither says."""
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict):
            for key in POSITION_KEYS:
                v = cfg.get(key)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
    v = (tokenizer_config or {}).get("model_max_length")
    if isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= SANE_TOKENIZER_MAX:
        return int(v)
    return None


def folder_position_limit(folder: Path) -> int | None:
    """:func:`position_limit` of a folder's config.json and tokenizer_config.json (no transformers)."""
    tok_cfg = folder / "tokenizer_config.json"
    try:
        tok = _read_json(tok_cfg, folder) if tok_cfg.is_file() else None
    except ModelFolderError:
        tok = None  # the tokenizer check reports a broken tokenizer config
    return position_limit(read_config(folder), tok)


def _check_config(folder: Path, raw: dict[str, Any]) -> str:
    """The model_type, once transformers builds the config and knows a causal-LM class for it."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelFolderError(
            folder,
            'config.json has no "model_type": it must name the architecture '
            '(e.g. "llama", "qwen2", "gpt2"), as the base model\'s config.json does',
        )
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # a config class may raise anything on a value it does not expect
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ModelFolderError(
                folder,
                f'config.json\'s model_type "{model_type}" is not an architecture '
                "this server's transformers knows",
            ) from e
        raise ModelFolderError(folder, f"config.json does not load: {first_line(e)}") from e
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelFolderError(
            folder,
            f'model_type "{model_type}" has no causal language model class in '
            "transformers (AutoModelForCausalLM): it cannot be fine-tuned here",
        )
    return model_type


# --- weights -----------------------------------------------------------------------------------------


def _indexed_shards(folder: Path, index: Path) -> list[Path]:
    """The shard files an index's weight_map names; each must exist."""
    weight_map = _read_json(index, folder).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFolderError(folder, f'{index.name} has no "weight_map" naming the shard of each tensor')
    shards = sorted({str(v) for v in weight_map.values()})
    for name in shards:
        shard = folder / name
        if Path(name).name != name or not shard.is_file():
            raise ModelFolderError(
                folder, f"{index.name} names the shard {name!r}, which is not in the folder"
            )
    return [folder / name for name in shards]


def _check_weights(folder: Path) -> tuple[tuple[str, ...], int | None]:
    """The weight files and (for safetensors) their parameter count; ModelFolderError when none are
    usable or (safetensors) when their shapes do not fit the config (trainer.model.weight_shapes)."""
    if (folder / SAFETENSORS_INDEX).is_file():
        files = _indexed_shards(folder, folder / SAFETENSORS_INDEX)
    else:  # a safetensors file beside a .pt of its name is a checkpoint's streamed training state
        files = sorted(f for f in folder.glob("*.safetensors") if not f.with_suffix(".pt").is_file())
    if files:
        from trainer.model.weight_shapes import check_weight_shapes, header_shapes

        shapes = header_shapes(folder, files)
        check_weight_shapes(folder, shapes)  # ModelFolderError naming the tensor that does not fit
        return tuple(f.name for f in files), sum(math.prod(shape) for shape in shapes.values())
    if (folder / BIN_INDEX).is_file():
        bins = _indexed_shards(folder, folder / BIN_INDEX)
    else:
        bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelFolderError(
            folder,
            "no weights: expected model.safetensors (or shards with "
            f"{SAFETENSORS_INDEX}) or pytorch_model.bin (or shards with {BIN_INDEX})",
        )
    empty = [b.name for b in bins if b.stat().st_size == 0]
    if empty:
        raise ModelFolderError(folder, f"{empty[0]} is empty")
    return tuple(b.name for b in bins), None


# --- tokenizer ---------------------------------------------------------------------------------------


def load_folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, loaded with transformers (local files only), checked to have a vocabulary.

    transformers builds a tokenizer of one token from a folder with no tokenizer files (from the
    config's model_type alone), so both the files and the loaded vocabulary are checked.
    """
    present = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    if not present:
        raise ModelFolderError(
            folder,
            "no tokenizer: none of " + ", ".join(TOKENIZER_FILES) + " is in the "
            "folder; copy the base model's tokenizer files into it",
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # tokenizer back ends raise anything from OSError to a Rust panic exception
        raise ModelFolderError(
            folder,
            f"the tokenizer ({', '.join(present)}) does not load: {type(e).__name__}: {first_line(e)}",
        ) from e
    special = set(tok.all_special_ids)
    ids = tok(_PROBE, add_special_tokens=False)["input_ids"]
    if not ids or all(i in special for i in ids):
        raise ModelFolderError(
            folder,
            f"the tokenizer ({', '.join(present)}) has no vocabulary: it turns "
            f"{_PROBE!r} into {tok.convert_ids_to_tokens(ids)} ({len(tok)} tokens)",
        )
    return tok


# --- the whole folder --------------------------------------------------------------------------------


def _fingerprint(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """Names, sizes and modification times of the folder's files: a changed file is checked again."""
    return tuple(
        sorted((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in folder.iterdir() if p.is_file())
    )


def check_model_folder(folder: Path | str) -> ModelFolder:
    """Check ``folder`` as a base model (config, weights and their shapes, tokenizer; see the module
    docstring).

    Raises ModelFolderError naming the first problem. The outcome (passed or the problem) is remembered
    until one of the folder's files changes (names, sizes, modification times), so a listing of base
    models checks each folder once.
    """
    path = Path(folder).expanduser().resolve()
    if not path.is_dir():
        raise ModelFolderError(path, "not a directory")
    try:
        fingerprint = _fingerprint(path)
    except OSError as e:
        raise ModelFolderError(path, f"cannot be listed: {e.strerror or e}") from e
    outcome = _check(path, fingerprint)
    if isinstance(outcome, str):
        raise ModelFolderError(path, outcome)
    return outcome


def folder_problem(folder: Path | str) -> str | None:
    """Why ``folder`` is not a usable base model (:func:`check_model_folder`'s problem, without the
    folder's path), or None when it is."""
    try:
        check_model_folder(folder)
    except ModelFolderError as e:
        return e.problem
    except Exception as e:  # a listing must not fail on one folder a library chokes on
        return f"the folder could not be checked: {type(e).__name__}: {first_line(e)}"
    return None


@functools.lru_cache(maxsize=64)
def _check(path: Path, fingerprint: tuple[tuple[str, int, int], ...]) -> ModelFolder | str:
    """The folder's check, or the problem it found (kept like a pass: a broken folder is not checked
    again until it changes)."""
    try:
        raw = read_config(path)
        model_type = _check_config(path, raw)
        files, n_params = _check_weights(path)
        tok = load_folder_tokenizer(path)
        limit = folder_position_limit(path)
    except ModelFolderError as e:
        return e.problem
    return ModelFolder(
        path=path,
        model_type=model_type,
        position_limit=limit,
        weight_files=files,
        num_parameters=n_params,
        vocab_size=len(tok),
    )
