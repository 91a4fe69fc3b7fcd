"""LoRA and weight export: wrapping a model in a peft LoRA adapter, and the weights a checkpoint
exports (the model's state dict with the engine's newest values, LoRA deltas merged in).

Importing this module does not import torch or peft (the functions do).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trainer.spec import JobSpec


def apply_lora(model: Any, spec: JobSpec, seed: int) -> Any:
    """``spec.lora`` applied to ``model`` through peft; the adapter init draws from its own seed (seed + 1)."""
    import torch
    from peft import LoraConfig, get_peft_model

    assert spec.lora is not None
    cfg = LoraConfig(
        r=spec.lora.r,
        lora_alpha=spec.lora.alpha,  # type: ignore[arg-type]  # peft annotates int; a float scales alike
        lora_dropout=spec.lora.dropout,
        target_modules=spec.lora.target_modules,
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed + 1) % 2**63)
        peft_model = get_peft_model(model, cfg)
    from trainer.run.model_card import base_model_id

    # the API's id of the base (never a server path): what others download and load the adapter onto
    peft_model.peft_config["default"].base_model_name_or_path = base_model_id(spec)
    return peft_model


def current_state(model: Any, consolidated: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """model.state_dict() on CPU with each parameter replaced by the engine's newest value."""
    names_by_ptr = {p.data_ptr(): n for n, p in model.named_parameters()}
    out = {}
    for k, v in model.state_dict().items():
        n = names_by_ptr.get(v.data_ptr())
        src = consolidated.get(n, consolidated.get(k)) if n is not None else consolidated.get(k)
        out[k] = (src if src is not None else v).detach().to("cpu")
    return out


def merged_lora_state(peft_model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base-model weights with each LoRA delta (B @ A * scaling) merged in, from a peft state dict.

    Computed from ``state`` (not from the live modules) so it sees the engine's newest values.
    """
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if ".lora_" in k:
            continue
        out[k.removeprefix(prefix).replace(".base_layer.", ".")] = v
    for mod_name, mod in peft_model.get_base_model().named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        for ad in mod.active_adapters:
            a_key = f"{prefix}{mod_name}.lora_A.{ad}.weight"
            if a_key not in state:
                continue
            a = state[a_key].float()
            b = state[f"{prefix}{mod_name}.lora_B.{ad}.weight"].float()
            delta = (b @ a) * mod.scaling[ad]
            if getattr(mod, "fan_in_fan_out", False):
                delta = delta.T
            w = out[f"{mod_name}.weight"]
            out[f"{mod_name}.weight"] = (w.float() + delta).to(w.dtype)
    return out


# --- checking target_modules before a job runs ------------------------------------------------------


def _adaptable_types() -> tuple[type, ...]:
    """The module classes peft's LoRA can wrap (it refuses any other class a target names)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    nn = torch.nn
    return (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D)


@functools.lru_cache(maxsize=16)
def _module_table(model: str, config_stamp: float) -> tuple[tuple[str, str, bool], ...]:
    """(name, class name, LoRA can adapt it) of every module of ``model``, built from its config on
    torch's meta device (no weights read or allocated). ``config_stamp`` keys the cache to a local
    directory's config.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model.catalog import BuiltinModel, builtin_config, find_model

    m = find_model(model)
    config = (
        builtin_config(model)
        if isinstance(m, BuiltinModel)
        else AutoConfig.from_pretrained(str(m), local_files_only=True)
    )
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    ok = _adaptable_types()
    return tuple((name, type(mod).__name__, isinstance(mod, ok)) for name, mod in net.named_modules() if name)


def lora_target_problems(model: str, targets: list[str]) -> list[str]:
    """Why LoRA with these ``target_modules`` would fail (or silently adapt less) on ``model``: each
    entry that matches no module, or matches one that LoRA cannot adapt; empty when all is well.

    Matching is peft's for a list: a module whose name equals the entry or ends with ``"." + entry``.
    Raises ValueError when the model cannot be built from its config at all.
    """
    from trainer.model.catalog import BuiltinModel, find_model

    m = find_model(model)
    stamp = 0.0 if isinstance(m, BuiltinModel) else (m / "config.json").stat().st_mtime
    try:
        table = _module_table(model, stamp)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot build the model from its config to check target_modules: {exc}") from exc
    problems = []
    for target in targets:
        hits = [(name, cls, ok) for name, cls, ok in table if name == target or name.endswith("." + target)]
        if not hits:
            leaves = sorted({name.rsplit(".", 1)[-1] for name, _, ok in table if ok})
            problems.append(
                f"{target!r} matches no module of the model (adaptable names: {', '.join(leaves)})"
            )
        elif not all(ok for _, _, ok in hits):
            bad = sorted({cls for _, cls, ok in hits if not ok})
            problems.append(f"{target!r} matches {', '.join(bad)} modules, which LoRA cannot adapt")
    return problems
