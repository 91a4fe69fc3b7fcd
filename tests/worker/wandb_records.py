"""Records of a W&B offline run file (``run-<id>.wandb``), read with W&B's own protobuf messages.

The file is W&B's LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks
of chunks, each ``crc32 (4) | length (2) | kind (1) | data``; kind 1 is a whole record, 2/3/4 its
first/middle/last parts; a block's tail shorter than a chunk header is padding. wandb 0.31 keeps its
reader in the Go core, so the tests read the file here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_HEADER = 7
_BLOCK = 32 * 1024


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, parts = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        if kind == 0 and length == 0:  # zero fill at the end of a block
            pos += left - _HEADER
            continue
        parts += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            parts = b""
            yield rec


def history(path: Path) -> list[dict[str, Any]]:
    """The run's logged rows, each ``{key: value}`` with its ``_step``."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in rec.history.item
                }
            )
    return rows


def summary(path: Path) -> dict[str, Any]:
    """The run's summary as last updated."""
    out: dict[str, Any] = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "summary":
            for item in rec.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def run_record(path: Path) -> Any:
    """The run's ``RunRecord`` (project, display name, tags, config)."""
    return next(rec.run for rec in records(path) if rec.WhichOneof("record_type") == "run")
