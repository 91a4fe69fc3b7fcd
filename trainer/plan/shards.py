"""Sharded weights (``engine.shard_params``: PyTorch FSDP2 over the job's N ranks) in the plan's
arithmetic: what one rank holds and what it sends per step.

Each rank holds a row shard of every weight: dim 0 cut into N equal pieces, rounded up (FSDP2 pads the
last rank's shard), so ``ceil(d0 / N) x d1`` elements of a ``d0 x d1`` weight; its gradient after the
reduce-scatter likewise; and the engine's optimizer state for its shards only (:func:`row_shards`: the
engine's byte formulas applied to the shards' shapes, so zenflow's selected columns keep their count
and lose rows). FSDP2 wraps each decoder layer and the rest (embeddings, final norm, LM head) as the
root, its blocks (:func:`blocks`); forward and backward all-gather a block's weights before its
compute, in the compute dtype, the next one prefetched while the current one runs: two blocks' unsharded
weights at once (:func:`gather_bytes`), and backward reduce-scatters each block's gradient from an
unsharded buffer (:func:`reduce_scatter_bytes`).

Traffic per micro-batch (:func:`traffic_bytes`, ring algorithms: each rank sends ``(N - 1) / N`` of
the full tensor): an all-gather of every weight for forward and again for backward (the blocks are
resharded after forward), and a reduce-scatter of every trainable weight's gradient (gradients stay
sharded between micro-batches, so each one is reduced).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from trainer.plan.shapes import ModelShape, Weight

#: Unsharded blocks alive at once: the one computing and the one prefetched.
PREFETCHED_BLOCKS = 2
_LAYER = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")


def row_shard(w: Weight, ranks: int) -> Weight:
    """One rank's shard of ``w``: dim 0 rounded up to a multiple of ``ranks``, divided by it."""
    if not w.shape or ranks == 1:
        return w
    return Weight(w.name, (-(-w.shape[0] // ranks), *w.shape[1:]))


def row_shards(weights: Iterable[Weight], ranks: int) -> tuple[Weight, ...]:
    return tuple(row_shard(w, ranks) for w in weights)


def shard_numel(weights: Iterable[Weight], ranks: int) -> int:
    """Elements one rank holds of ``weights`` (padding included)."""
    return sum(w.numel for w in row_shards(weights, ranks))


def blocks(weights: Iterable[Weight]) -> dict[str, int]:
    """Elements per FSDP block: ``layer N`` per decoder layer, ``root`` for the rest."""
    out: dict[str, int] = {}
    for w in weights:
        m = _LAYER.search(w.name)
        key = f"layer {m.group(1)}" if m else "root"
        out[key] = out.get(key, 0) + w.numel
    return out


def _all_weights(shape: ModelShape) -> tuple[Weight, ...]:
    return shape.weights or shape.trainable


def gather_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """Device bytes of the unsharded weights of the ``PREFETCHED_BLOCKS`` largest blocks."""
    sizes = sorted(blocks(_all_weights(shape)).values(), reverse=True)
    return sum(sizes[:PREFETCHED_BLOCKS]) * dtype_bytes


def reduce_scatter_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """Device bytes of the largest block's unsharded gradient (the reduce-scatter's input)."""
    sizes = blocks(shape.trainable).values()
    return max(sizes, default=0) * dtype_bytes


def traffic_bytes(shape: ModelShape, dtype_bytes: int, ranks: int, micro_batches: int) -> float:
    """Bytes one rank sends over the GPU interconnect per optimizer step (see the module doc)."""
    if ranks == 1:
        return 0.0
    part = (ranks - 1) / ranks
    gathered = 2 * shard_numel(_all_weights(shape), ranks) * ranks * dtype_bytes
    reduced = shard_numel(shape.trainable, ranks) * ranks * dtype_bytes
    return micro_batches * part * (gathered + reduced)
