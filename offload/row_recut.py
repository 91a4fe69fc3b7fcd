"""Re-cutting FSDP2 row-sharded engine state for another number of ranks (every mode).

Under ``shard_params`` every rank's engine state is its mode's state over its *local rows* of each parameter
(:mod:`offload.fsdp`). FSDP2 cuts a parameter's rows as ``torch.chunk(p, N, dim=0)`` (ranks past the last
chunk hold none), so the rank-count-free layout is the whole parameter: each rank's rows concatenated in
rank order. Resuming on another N (or from/to whole parameters) goes through it: :func:`to_whole` gives
the state one process would hold, :func:`cut_rows` this rank's rows of it. Nothing is recomputed, so the
resumed run continues as the saving one would have, up to the new rank count's reduction order.

This re-cut builds every parameter's whole state in each resuming rank's host memory at once: the trainer's
sharded checkpoints go through :mod:`offload.dcp_state` instead (``torch.distributed.checkpoint``, each
rank reading only its rows). This module serves ``ZenFlowEngine.load_state_dict`` given a list of
states: a single process's (or replicated ranks') whole state loaded into a sharded group, and sharded
checkpoints written before the DCP format (per-rank files with their engine state).

Per parameter the tensors with a row dimension are concatenated / chunked along dim 0; scalars (the
optimizer's step count) and the counters are the same on every rank and taken from the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch

__all__ = ["RECUT_MODES", "cut_rows", "rows_of", "to_whole"]

#: The modes whose row-sharded state this module re-cuts.
RECUT_MODES = ("device", "offload", "zenflow")

Shapes = list[list[tuple[int, ...]]]


def rows_of(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``rank``'s rows of whole ``t`` as FSDP2 cuts them (``torch.chunk`` along dim 0; empty past the last
    chunk), a contiguous copy."""
    chunks = torch.chunk(t, world, dim=0)
    if rank < len(chunks):
        return chunks[rank].contiguous().clone()
    return t.new_empty((0, *t.shape[1:]))


def _cat(parts: Sequence[Any]) -> Any:
    if isinstance(parts[0], torch.Tensor) and parts[0].dim() > 0:
        return torch.cat([torch.as_tensor(p) for p in parts], dim=0)
    return parts[0]


def _cut(t: Any, rank: int, world: int) -> Any:
    if isinstance(t, torch.Tensor) and t.dim() > 0:
        return rows_of(t, rank, world)
    return t


def _by_name(parts: Sequence[dict[Any, Any]], rows: bool) -> dict[Any, Any]:
    return {k: (_cat([p[k] for p in parts]) if rows else parts[0][k]) for k in parts[0]}


def _optimizer(parts: Sequence[dict[str, Any]], rows: bool) -> dict[str, Any]:
    state = {i: _by_name([p["state"][i] for p in parts], rows) for i in parts[0]["state"]}
    return {"state": state, "param_groups": parts[0]["param_groups"]}


def _host_whole(parts: Sequence[dict[str, Any]], shapes: list[tuple[int, ...]], rows: bool) -> dict[str, Any]:
    """One host store's state over whole parameters (``shapes``, in the store's order), from every rank's."""
    keys = ["master", "exp_avg", "exp_avg_sq"] + (["acc"] if parts[0]["acc"] is not None else [])
    out: dict[str, Any] = {k: None for k in ("acc",)}
    if not rows:  # replicated: a flat 1/N slice each, in rank order
        spans = [tuple(p["shard"]) for p in parts]
        if any(a[1] != b[0] for a, b in pairwise(spans)):
            raise ValueError(f"the host shards do not cover the parameters: {spans}")
        for k in keys:
            out[k] = torch.cat([torch.as_tensor(p[k]) for p in parts])
    else:
        for k in keys:
            per_param: list[torch.Tensor] = []
            flats = [torch.as_tensor(p[k]).split(list(p["numels"])) for p in parts]
            for j, shape in enumerate(shapes):
                whole = torch.cat([f[j].view(-1, *shape[1:]) for f in flats], dim=0)
                if tuple(whole.shape) != shape:
                    raise ValueError(
                        f"host state rows {tuple(whole.shape)} do not make a parameter of {shape}"
                    )
                per_param.append(whole.reshape(-1))
            out[k] = torch.cat(per_param) if per_param else torch.as_tensor(parts[0][k])
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if list(parts[0]["numels"]) != numels and not rows:
        raise ValueError("host optimizer state was saved for differently shaped parameters")
    total = sum(numels)
    return {
        **out,
        "acc_index": parts[0]["acc_index"],
        "steps": list(parts[0]["steps"]),
        "numels": numels,
        "shard": [0, total],
    }


def _host_cut(sd: dict[str, Any], shapes: list[tuple[int, ...]], rank: int, world: int) -> dict[str, Any]:
    keys = ["master", "exp_avg", "exp_avg_sq"] + (["acc"] if sd["acc"] is not None else [])
    out: dict[str, Any] = {"acc": None}
    numels: list[int] = []
    for k in keys:
        mine = [
            rows_of(flat.view(shape), rank, world)
            for flat, shape in zip(sd[k].split(list(sd["numels"])), shapes, strict=True)
        ]
        numels = [t.numel() for t in mine]
        out[k] = torch.cat([t.reshape(-1) for t in mine])
    return {**out, "acc_index": sd["acc_index"], "steps": list(sd["steps"]), "numels": numels,
            "shard": [0, sum(numels)]}  # fmt: skip


def to_whole(states: Sequence[dict[str, Any]], rows: bool, host_shapes: Shapes) -> dict[str, Any]:
    """The mode state one process over whole parameters holds, from every saving rank's (rank order).
    ``rows``: they are FSDP2 row shards (else replicated ranks' states); ``host_shapes``: per host store
    (offload mode), its parameters' whole shapes in order."""
    mode = states[0]["mode"]
    if mode not in RECUT_MODES:
        raise ValueError(
            f"{mode} engine state cannot be re-cut to or from row-sharded (FSDP2) parameters: a sharded "
            f"{mode} checkpoint resumes sharded on the same number of ranks only (re-cut modes: {list(RECUT_MODES)})"
        )
    out: dict[str, Any] = {
        "mode": mode,
        "device_params": _by_name([s["device_params"] for s in states], rows),
    }
    if mode == "device":
        out["masters"] = _by_name([s["masters"] for s in states], rows)
        out["optimizer"] = _optimizer([s["optimizer"] for s in states], rows)
    else:
        out["host"] = [
            _host_whole([s["host"][g] for s in states], shapes, rows) for g, shapes in enumerate(host_shapes)
        ]
    if mode == "zenflow":
        out.update(_zenflow_whole(states, rows))
    return out


#: zenflow's per-parameter device optimizer entries with a row dimension ("cols" and "steps" are per
#: selected column: the same on every rank).
_ROW_KEYS = ("exp_avg", "exp_avg_sq", "master")


def _zenflow_whole(states: Sequence[dict[str, Any]], rows: bool) -> dict[str, Any]:
    """zenflow's own parts: the selection, pending window's columns and schedule are global (FSDP2 ranks
    select the same columns and end windows together: offload.fsdp), so the first rank's; the column
    moments, stash values and device accumulators are rows, concatenated."""
    first = states[0]
    if not rows:
        return {k: first[k] for k in ("device_optimizer", "pending", "stash", "device_acc", "schedule")}
    dev = {
        n: {
            k: _cat([s["device_optimizer"][n][k] for s in states]) if k in _ROW_KEYS and v is not None else v
            for k, v in e.items()
        }
        for n, e in first["device_optimizer"].items()
    }
    stash = {n: (c, _cat([s["stash"][n][1] for s in states])) for n, (c, _) in first["stash"].items()}
    acc = _by_name([s["device_acc"] for s in states], True) if first["device_acc"] else {}
    return {
        "device_optimizer": dev,
        "pending": first["pending"],
        "stash": stash,
        "device_acc": acc,
        "schedule": first["schedule"],
    }


def _zenflow_cut(whole: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    dev = {
        n: {k: _cut(v, rank, world) if k in _ROW_KEYS else v for k, v in e.items()}
        for n, e in whole["device_optimizer"].items()
    }
    return {
        "device_optimizer": dev,
        "pending": whole["pending"],
        "stash": {n: (c, _cut(v, rank, world)) for n, (c, v) in whole["stash"].items()},
        "device_acc": {n: _cut(t, rank, world) for n, t in whole["device_acc"].items()},
        "schedule": whole["schedule"],
    }


def cut_rows(whole: dict[str, Any], rank: int, world: int, host_shapes: Shapes) -> dict[str, Any]:
    """``rank``'s row-sharded mode state of a group of ``world`` from :func:`to_whole`'s."""
    out: dict[str, Any] = {
        "mode": whole["mode"],
        "device_params": {n: _cut(t, rank, world) for n, t in whole["device_params"].items()},
    }
    if whole["mode"] == "device":
        out["masters"] = {n: _cut(t, rank, world) for n, t in whole["masters"].items()}
        opt = whole["optimizer"]
        out["optimizer"] = {
            "state": {i: {k: _cut(v, rank, world) for k, v in st.items()} for i, st in opt["state"].items()},
            "param_groups": opt["param_groups"],
        }
    else:
        out["host"] = [_host_cut(h, s, rank, world) for h, s in zip(whole["host"], host_shapes, strict=True)]
    if whole["mode"] == "zenflow":
        out.update(_zenflow_cut(whole, rank, world))
    return out
