"""Padding-free packing: whole examples packed into rows of at most ``max_seq_length`` tokens, positions
restarting at 0 for every example, no attention across examples, the assistant-only loss unchanged.

Mechanism, all transformers 5.x's own:

- each row is built by ``transformers.DataCollatorWithFlattening``: the examples' tokens concatenated,
  ``position_ids`` restarting per example, and the first label of every example set to -100, so no
  token is learned from the end of the previous example (exactly the labels the unpacked next-token
  loss uses: it never learns a row's first token either);
- the model is called with ``position_ids``, ``attention_mask=None`` and ``use_cache=False``
  (:func:`trainer.data.batching.loss_sum`); ``transformers.masking_utils`` then finds the packed sequences
  from the position ids (``find_packed_sequence_indices``; only without a 2D mask and without a
  cache) and builds a block-diagonal causal mask for the ``sdpa``, ``eager`` and ``flex_attention``
  implementations, while ``flash_attention_2``/``_3`` get the sequence boundaries for their varlen
  kernels.

Attention implementation (:func:`use_packing_attention`): ``sdpa`` with the block-diagonal mask
(rows x L x L booleans per layer call) on CPU and on CUDA; isolation is proved by
tests/trainer/run/test_microbatch.py. Not ``flash_attention_2``: transformers (5.24) detects packed
sequences for its varlen kernels only in a batch of one row, so with several packed rows per
micro-batch it would run plain causal attention over each row and let examples attend to each other.
(Using it would need each micro-batch flattened into one row; to be measured on a GPU first.) Rows of
one micro-batch are padded to the longest; the padding is a segment of its own (positions from 0,
labels ignored), so it attends only to itself.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, NamedTuple

from trainer.data.dataset import IGNORE_INDEX, Example

if TYPE_CHECKING:
    import torch


class PackedRows(NamedTuple):
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``capacity`` tokens, filled evenly.

    As many rows as the tokens need (``ceil(total / capacity)``) are opened, and each item, longest
    first, goes to the row with the most room (worst-fit decreasing), a new row when none has room
    (an item longer than ``capacity`` gets a row of its own). Even rows keep the padding to the
    longest row of a micro-batch small. Deterministic; rows come fullest first.
    """
    count = max(1, -(-sum(lengths) // capacity)) if lengths else 0
    rows: list[list[int]] = [[] for _ in range(count)]
    room = [capacity] * count
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = max(range(len(room)), key=lambda r: (room[r], -r), default=None)
        if r is None or lengths[i] > room[r]:
            rows.append([])
            room.append(capacity)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    order = sorted(range(len(rows)), key=lambda r: (room[r], r))
    return [rows[r] for r in order if rows[r]]


def flatten_rows(rows: list[list[Example]], pad_id: int, multiple: int = 8) -> PackedRows:
    """Rows of examples as padded (rows, width) tensors on the CPU, width the longest row rounded up to
    ``multiple``."""
    import torch
    from transformers import DataCollatorWithFlattening

    flatten = DataCollatorWithFlattening(
        return_position_ids=True, separator_id=IGNORE_INDEX, return_tensors="pt"
    )
    flat = [flatten([{"input_ids": e.input_ids, "labels": e.labels} for e in row]) for row in rows]
    longest = max(int(f["input_ids"].shape[1]) for f in flat)
    width = (longest + multiple - 1) // multiple * multiple
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    # Padding positions count from 0: a segment of its own, never attended to by the examples.
    positions = torch.arange(width, dtype=torch.long).repeat(len(rows), 1)
    for r, f in enumerate(flat):
        n = int(f["input_ids"].shape[1])
        ids[r, :n] = f["input_ids"][0]
        labels[r, :n] = f["labels"][0]
        positions[r, :n] = f["position_ids"][0]
        positions[r, n:] -= n
    return PackedRows(ids, labels, positions)


def use_packing_attention(model: Any, device: torch.device, dtype: torch.dtype) -> str:
    """Give ``model`` (a transformers model, before peft wraps it) the attention implementation packing
    uses on ``device`` (see the module docstring) and return its name.

    Raises ValueError for a model whose forward takes no ``position_ids`` (it could not restart them).
    """
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"packing needs position_ids, which {type(model).__name__} does not take; set packing to false"
        )
    wanted = "sdpa"  # on every device: see the module docstring for why not flash_attention_2
    if model.config._attn_implementation != wanted:
        model.set_attn_implementation(wanted)
    return str(model.config._attn_implementation)
