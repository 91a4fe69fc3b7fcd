"""Do a folder's safetensors weights fit its config? Shapes compared without reading a weight.

A config that does not match its weights (``hidden_size`` 256 over 128-wide tensors, another
``vocab_size``, a missing layer) loads nowhere: transformers stops at run time with a load report.
:func:`check_weight_shapes` finds it before a job is accepted: the model the config describes is
built on torch's meta device (shapes only, no memory), and each of its parameters is compared with
the tensor of the same name in the safetensors headers (``safe_open(...).get_slice(name).get_shape()``:
the header alone; no tensor is read). What differs raises
:class:`~trainer.model.folder_errors.ModelFolderError` naming the tensor and both shapes.

What transformers itself tolerates is tolerated here: tied weights (the output layer shares the
embedding, so the file holds one of the two), checkpoints saved without the base model's prefix
(``h.0.attn...`` for ``transformer.h.0.attn...``), buffers the model rebuilds (rotary ``inv_freq``),
and the names its ``_keys_to_ignore_on_load_*`` patterns ignore. For architectures whose checkpoints
transformers renames or fuses on load (a conversion mapping: Mixtral's experts, say) only the tensors
whose names match are compared; missing and extra names are then not reported.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.model.folder_errors import ModelFolderError, first_line

Shape = tuple[int, ...]
#: How many missing or unexpected names a message lists before "and N more".
_SHOWN = 5


def header_shapes(folder: Path, files: Iterable[Path]) -> dict[str, Shape]:
    """Every tensor's shape from the safetensors headers of ``files`` (no tensor data read)."""
    from safetensors import safe_open

    shapes: dict[str, Shape] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  # safe_open is not a mapping
                    shapes[name] = tuple(int(d) for d in f.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own SafetensorError (an Exception) on a bad header
            raise ModelFolderError(
                folder, f"{file.name} is not a readable safetensors file: {first_line(e)}"
            ) from e
    return shapes


def _fmt(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _ignored(patterns: Any, name: str) -> bool:
    return any(re.search(p, name) for p in (patterns or ()))


def _config_hint(name: str, config: Any) -> str:
    """Which config value a mismatched tensor most likely comes from."""
    keys: tuple[str, ...] = (
        ("vocab_size",) if "embed" in name or "lm_head" in name or name.endswith("wte.weight") else ()
    )
    keys += ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    vals = [f"{k} {getattr(config, k)}" for k in keys if isinstance(getattr(config, k, None), int)]
    return f" (config.json: {', '.join(vals)})" if vals else ""


def check_weight_shapes(folder: Path, found: dict[str, Shape]) -> None:
    """Raise ModelFolderError when the tensors ``found`` in the safetensors headers
    (:func:`header_shapes`) are not the model ``folder``'s config.json describes: a tensor of another shape (named, with both shapes), parameters the
    files lack, or tensors the model has no place for."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    config, model = _meta_model(folder)
    params = _Parameters(model)
    present, extra = _compare_shapes(folder, config, params, found)
    if get_checkpoint_conversion_mapping(str(config.model_type)) is not None:
        return  # names are converted on load: only the shapes of names that match are comparable
    _raise_missing(folder, params, present, getattr(model, "_keys_to_ignore_on_load_missing", None))
    _raise_extra(folder, found, extra)


def _meta_model(folder: Path) -> tuple[Any, Any]:
    """The folder's config and the model it describes on the meta device (shapes, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # a config a model class refuses (heads that do not divide hidden_size...)
        raise ModelFolderError(
            folder, f"config.json does not describe a model transformers can build: {first_line(e)}"
        ) from e
    return config, model


class _Parameters:
    """A model's parameter and buffer shapes by name, and the names a file's key may stand for."""

    def __init__(self, model: Any) -> None:
        # Parameters by object: tied ones (lm_head = embed_tokens) are one group, any name of it will do.
        self.groups: dict[int, list[str]] = {}
        self.expected: dict[str, Shape] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.groups.setdefault(id(p), []).append(name)
            self.expected[name] = tuple(p.shape)
        self.buffers = {name: tuple(b.shape) for name, b in model.named_buffers(remove_duplicate=False)}
        self.prefix = str(getattr(model, "base_model_prefix", "") or "")
        self.ignore_unexpected = getattr(model, "_keys_to_ignore_on_load_unexpected", None)

    def name(self, key: str) -> str | None:
        """The model's name for a file's ``key`` (perhaps saved without the base model's prefix)."""
        if key in self.expected or key in self.buffers:
            return key
        if self.prefix and f"{self.prefix}.{key}" in self.expected:
            return f"{self.prefix}.{key}"
        return None

    def shape(self, name: str) -> Shape | None:
        return self.expected.get(name, self.buffers.get(name))


def _compare_shapes(
    folder: Path, config: Any, params: _Parameters, found: dict[str, Shape]
) -> tuple[set[str], list[str]]:
    """The model's names the files hold and the files' keys it has no place for; raises at the first
    tensor of another shape."""
    present: set[str] = set()
    extra: list[str] = []
    for key, shape in found.items():
        name = params.name(key)
        if name is None:
            if not _ignored(params.ignore_unexpected, key):
                extra.append(key)
            continue
        present.add(name)
        want = params.shape(name)
        if want is not None and want != shape:
            raise ModelFolderError(
                folder,
                f"the weights do not fit config.json: tensor {key} has shape {_fmt(shape)} in the "
                f"safetensors files, the config makes it {_fmt(want)}{_config_hint(name, config)}",
            )
    return present, extra


def _raise_missing(folder: Path, params: _Parameters, present: set[str], ignore_missing: Any) -> None:
    missing = sorted(
        names[0]
        for names in params.groups.values()
        if not present.intersection(names) and not any(_ignored(ignore_missing, n) for n in names)
    )
    if missing:
        raise ModelFolderError(
            folder,
            f"the weights do not fit config.json: {len(missing)} tensor(s) the config's model has are "
            f"not in the safetensors files: {_listed(missing)} (shape {_fmt(params.expected[missing[0]])})",
        )


def _raise_extra(folder: Path, found: dict[str, Shape], extra: list[str]) -> None:
    if extra:
        extra.sort()
        raise ModelFolderError(
            folder,
            f"the weights do not fit config.json: {len(extra)} tensor(s) in the safetensors files have "
            f"no place in the config's model: {_listed(extra)} (shape {_fmt(found[extra[0]])}); is "
            "config.json the one these weights were saved with?",
        )
