"""A reinforcement job's rollout in the plan (trainer.method.reinforcement): before each optimizer step
the policy samples ``samples_per_prompt`` completions of each of the step's prompts, so a step also holds
a KV cache and spends its decoding time.

Memory: the cache of every row being sampled (K and V, each layer's KV heads, prompt plus completion
tokens, the weights' dtype) and the last position's logits; sampling ends before the training forward
starts, so only what exceeds the activations' peak adds to the device's total.

Time: the prefill is compute-bound (2 x matmul parameters x prompt tokens of every row); each decode step
reads the weights and the cache once (bandwidth-bound at small batches) or computes its rows (compute-
bound at large ones), whichever is longer, plus a per-layer overhead for the step's kernel launches and
Python in transformers' ``generate``.
"""

from __future__ import annotations

from typing import NamedTuple

from trainer.plan.gpus import Machine
from trainer.plan.shapes import ModelShape
from trainer.plan.speed import matmul_params

#: Seconds of a decode step per decoder layer beyond its roofline: transformers' eager ``generate``
#: (kernel launches, sampling, Python). CPU: ``python -m bench.rollout`` on docs-llama (4 layers) decoded
#: about 20 ms a step whatever its rows; CUDA: an assumption (launch-bound eager decoding of a 32-layer
#: model at ~25 ms a step), not measured here.
DECODE_OVERHEAD_S_PER_LAYER = {"cpu": 5e-3, "cuda": 8e-4}
#: Bytes per vocabulary entry of the last position's logits while sampling (fp32 logits and
#: probabilities).
LOGITS_BYTES_PER_ENTRY = 8


class RolloutQuery(NamedTuple):
    """What a reinforcement job samples per prompt: completions and their most tokens."""

    samples_per_prompt: int
    completion_tokens: int


def kv_cache_bytes(shape: ModelShape, rows: int, tokens: int, dtype_bytes: int) -> int:
    """The KV cache of ``rows`` sequences of ``tokens`` tokens."""
    return 2 * shape.num_layers * shape.kv_heads * shape.head_dim * rows * tokens * dtype_bytes


def rollout_bytes(shape: ModelShape, rows: int, seq: int, dtype_bytes: int) -> int:
    """What sampling ``rows`` sequences of up to ``seq`` tokens holds at its peak: the cache and the logits."""
    return kv_cache_bytes(shape, rows, seq, dtype_bytes) + rows * shape.vocab * LOGITS_BYTES_PER_ENTRY


def generation_seconds(
    shape: ModelShape,
    machine: Machine,
    *,
    rows: int,
    prompt_tokens: int,
    completion_tokens: int,
    dtype_bytes: int,
) -> float:
    """Seconds to sample ``completion_tokens`` tokens for ``rows`` sequences after a prefill of
    ``prompt_tokens`` each (see the module doc)."""
    flops, bandwidth = machine.gpu_flops, machine.gpu_memory_gbps * 1e9
    work = 2 * matmul_params(shape)
    prefill = work * rows * prompt_tokens / flops
    mean_cache = kv_cache_bytes(shape, rows, prompt_tokens + completion_tokens // 2, dtype_bytes)
    read = (shape.params * dtype_bytes + mean_cache) / bandwidth
    step = (
        max(work * rows / flops, read) + DECODE_OVERHEAD_S_PER_LAYER[machine.device_type] * shape.num_layers
    )
    return prefill + completion_tokens * step
