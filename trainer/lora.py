"""LoRA and weight export: wrapping a model in a peft LoRA adapter, and the weights a checkpoint
exports (the model's state dict with the engine's newest values, LoRA deltas merged in).

Importing this module does not import torch or peft (the functions do).
"""

from __future__ import annotations

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
    peft_model.peft_config["default"].base_model_name_or_path = spec.model
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
