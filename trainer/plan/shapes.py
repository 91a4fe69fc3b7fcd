"""A model's shape for the plan: parameters per module counted on torch's meta device (no weights
read or allocated), and the activation bytes autograd saves for a micro-batch.

Activation formula (Llama-family decoder, transformers' SDPA attention, per micro-batch of ``b``
rows of ``s`` tokens, ``N = b * s``, ``e`` = bytes of the parameter dtype), the tensors autograd
keeps for backward, each storage counted once (derived from the ops' saved tensors and checked against
``torch.autograd.graph.saved_tensors_hooks`` in tests/trainer/plan/test_plan.py):

- each RMSNorm: its input in fp32 (``4Nh``), ``rsqrt`` (``4N``), the normalized value and the output
  (``2Nh·e``); with a frozen norm weight (LoRA) the normalized value is not kept;
- attention: the query after RoPE and the attention output (``2N·heads·head_dim·e``), key and value
  (``2N·kv_heads·head_dim·e``; at the query width when a padding mask makes transformers repeat the KV
  heads), the log-sum-exp (``4N·heads``), and a padding mask once for all layers (``2·b·s²·e``);
- SwiGLU MLP: gate, activation, up and their product (``4N·intermediate·e``);
- LoRA: each adapted module's ``lora_A`` output (``N·r·e``);
- the loss: fp32 log-softmax of the logits (``4N·vocab``) and the targets.

With activation checkpointing (non-reentrant, per decoder layer) a layer keeps only its input
(``Nh·e``) and recomputes the rest during backward: one layer's full set is live at a time
(:attr:`Activations.recompute_bytes`). :attr:`Activations.transient_bytes` is what backward adds on
top at its peak: the loss's logits gradient in fp32 and in the model dtype.

Other architectures (GPT-2, Phi-3, Gemma-2, ...) are counted with the same formula from their
config's hidden, intermediate, head and vocab sizes: an estimate, not a count.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from contract.lora import LoraSpec

#: Linear modules of a Llama-family decoder layer that ``all-linear`` LoRA adapts.
_LAYER_LINEARS = 7


@dataclass(frozen=True)
class Weight:
    """One trainable parameter's name and shape (what the engine will see)."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: sizes and its parameters, trainable ones by shape."""

    model_type: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    params: int
    trainable: tuple[Weight, ...]
    #: Parameters by top-level part: ``embeddings``, ``layers``, ``final_norm``, ``lm_head``, ``lora``.
    modules: dict[str, int] = field(default_factory=dict)
    lora_rank: int | None = None
    #: LoRA-adapted modules per decoder layer (0 without LoRA).
    lora_modules_per_layer: int = 0
    #: Every parameter, trainable or frozen (tied ones once): what sharding cuts (trainer.plan.shards).
    weights: tuple[Weight, ...] = ()

    @property
    def trainable_params(self) -> int:
        return sum(w.numel for w in self.trainable)

    @property
    def frozen_params(self) -> int:
        return self.params - self.trainable_params


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch (see the module doc)."""

    saved_bytes: int  # what autograd keeps from the forward until backward
    recompute_bytes: int  # checkpointing: one layer's full set, rebuilt during backward
    transient_bytes: int  # backward's peak on top: logits gradients

    @property
    def peak_bytes(self) -> int:
        return self.saved_bytes + self.recompute_bytes + self.transient_bytes


def _config_of(model: str) -> Any:
    from transformers import AutoConfig

    from trainer.model.catalog import BuiltinModel, builtin_config, find_model

    m = find_model(model)
    if isinstance(m, BuiltinModel):
        return builtin_config(model)
    return AutoConfig.from_pretrained(str(m), local_files_only=True)


def _part(name: str) -> str:
    if "lora_" in name:
        return "lora"
    if ".layers." in name or ".h." in name or ".blocks." in name:
        return "layers"
    if "lm_head" in name:
        return "lm_head"
    if "embed" in name or ".wte." in name or ".wpe." in name:
        return "embeddings"
    return "final_norm"


@functools.lru_cache(maxsize=32)
def _shape(model: str, stamp: float, lora_key: str | None) -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM

    config = _config_of(model)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
        if lora_key is not None:
            from peft import LoraConfig, get_peft_model

            lora = json.loads(lora_key)
            net = get_peft_model(
                net,
                LoraConfig(
                    r=lora["r"],
                    lora_alpha=lora["alpha"],
                    lora_dropout=lora["dropout"],
                    target_modules=lora["target_modules"],
                    task_type="CAUSAL_LM",
                ),
            )
    modules: dict[str, int] = {}
    seen: set[int] = set()
    trainable, weights = [], []
    for name, p in net.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied weights count once
            continue
        seen.add(id(p))
        part = _part(name)
        modules[part] = modules.get(part, 0) + p.numel()
        weights.append(Weight(name, tuple(p.shape)))
        if p.requires_grad:
            trainable.append(Weight(name, tuple(p.shape)))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", None) or text.n_embd)
    heads = int(getattr(text, "num_attention_heads", None) or text.n_head)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    inter = int(getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden)
    layers = int(getattr(text, "num_hidden_layers", None) or text.n_layer)
    positions = int(
        getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 2048
    )
    adapted = 0
    if lora_key is not None:
        adapted = sum(1 for w in trainable if "lora_A" in w.name) // max(1, layers)
    return ModelShape(
        model_type=str(getattr(config, "model_type", "unknown")),
        num_layers=layers,
        hidden=hidden,
        intermediate=inter,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        vocab=int(text.vocab_size),
        max_positions=positions,
        params=sum(modules.values()),
        trainable=tuple(trainable),
        modules=modules,
        lora_rank=None if lora_key is None else int(json.loads(lora_key)["r"]),
        lora_modules_per_layer=adapted,
        weights=tuple(weights),
    )


def model_shape(model: str, lora: LoraSpec | None = None) -> ModelShape:
    """The shape of a built-in model or a local directory's config (with ``lora`` applied through
    peft), built on the meta device; raises UnknownModelError or ValueError for a config that cannot
    be built."""
    from trainer.model.catalog import BuiltinModel, find_model

    m = find_model(model)
    stamp = 0.0 if isinstance(m, BuiltinModel) else (m / "config.json").stat().st_mtime
    key = None if lora is None else json.dumps(lora.model_dump(), sort_keys=True)
    try:
        return _shape(model, stamp, key)
    except Exception as exc:  # transformers' and peft's config checks raise assorted types
        raise ValueError(f"cannot build the model from its config: {exc}") from exc


def activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    seq: int,
    dtype_bytes: int,
    *,
    checkpointing: bool,
    masked: bool = True,
) -> Activations:
    """Bytes autograd keeps for one micro-batch of ``micro_batch`` x ``seq`` tokens (module doc).

    ``masked``: the batch carries a padding mask (right-padded batches); packed rows without one keep
    the key/value heads at their own width.
    """
    n, e, h = micro_batch * seq, dtype_bytes, shape.hidden
    q_width = shape.heads * shape.head_dim
    kv_width = q_width if masked and shape.kv_heads < shape.heads else shape.kv_heads * shape.head_dim
    lora = shape.lora_rank is not None
    norm_weight_trains = not lora  # a frozen norm weight needs no normalized value for its gradient
    norm = n * h * 4 + n * 4 + n * h * e * (2 if norm_weight_trains else 1)
    layer = (
        2 * norm
        + 2 * n * q_width * e  # query after RoPE, attention output
        + 2 * n * kv_width * e  # key, value
        + n * shape.heads * 4  # log-sum-exp
        + 4 * n * shape.intermediate * e  # SwiGLU
        + shape.lora_modules_per_layer * n * (shape.lora_rank or 0) * e
    )
    mask = 2 * micro_batch * seq * seq * e if masked else 0
    # the final norm's output is kept only when lm_head's weight trains
    final = n * h * 4 + n * 4 + (2 * n * h * e if not lora else 0)
    loss = n * shape.vocab * 4 + n * 8
    outside = n * 8 + 2 * seq * shape.head_dim * e + final + loss  # token ids, RoPE cos/sin
    transient = n * shape.vocab * (4 + e)
    if checkpointing:
        return Activations(shape.num_layers * n * h * e + outside, layer + mask, transient)
    return Activations(shape.num_layers * layer + mask + outside, 0, transient)
