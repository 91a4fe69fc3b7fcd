"""A row-sharded (FSDP2) engine state through ``torch.distributed.checkpoint`` (DCP), so that a resume on any
number of ranks reads only the rows each rank will hold.

The mode state splits as :mod:`offload.row_recut` re-cuts it: per parameter, every tensor with a row
dimension (masters, moments, accumulators, zenflow's column moments, stash values and device
accumulators, the device values) is one *piece*, saved as a ``Shard(0)`` DTensor over the whole
parameter's rows (the host stores' pieces are views of their flat buffers: no copy). The rest (steps,
selections, schedule, the saving rank's layout) is the rank-count-free *skeleton*, saved once as bytes.
:func:`load_rows` builds each piece with this rank's rows of the whole (``torch.chunk``, as FSDP2 cuts),
lets DCP fill it, and :func:`join_rows` puts the pieces back into a mode state of this rank's rows.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["engine_pieces", "join_rows", "load_rows", "piece_rows", "save_rows", "split_rows"]

SKELETON = "skeleton"
_HOST_KEYS = ("master", "exp_avg", "exp_avg_sq", "acc")
_ZEN_ROW_KEYS = ("exp_avg", "exp_avg_sq", "master")
#: A host store's flat buffer saved as per-parameter pieces (in the skeleton).
_PIECE = "dcp-pieces"


def _rows(t: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0


def split_rows(mode_state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(pieces, skeleton)`` of this rank's mode state: its row tensors by key (views, no copy) and the
    state with each of them replaced by None."""
    pieces: dict[str, torch.Tensor] = {}
    sk: dict[str, Any] = {k: v for k, v in mode_state.items()}
    sk["device_params"] = _take(pieces, "device_params", mode_state["device_params"])
    if "masters" in mode_state:
        sk["masters"] = _take(pieces, "masters", mode_state["masters"])
    if "optimizer" in mode_state:
        opt = mode_state["optimizer"]
        state = {i: _take(pieces, f"optimizer/{i}", st) for i, st in opt["state"].items()}
        sk["optimizer"] = {**opt, "state": state}
    if "host" in mode_state:
        sk["host"] = [_take_host(pieces, g, h) for g, h in enumerate(mode_state["host"])]
    if "device_optimizer" in mode_state:
        _take_zenflow_device(pieces, mode_state, sk)
    return pieces, sk


def _take(
    pieces: dict[str, torch.Tensor], prefix: str, d: dict[Any, Any], keys: tuple[str, ...] | None = None
) -> dict[Any, Any]:
    """``d`` with its row tensors (those of ``keys``, or all) moved into ``pieces`` as ``prefix/key``."""
    out = dict(d)
    for k, v in d.items():
        if (keys is None or k in keys) and _rows(v):
            pieces[f"{prefix}/{k}"] = v
            out[k] = None
    return out


def _take_host(pieces: dict[str, torch.Tensor], g: int, h: dict[str, Any]) -> dict[str, Any]:
    """Host store ``g``'s flat buffers as per-parameter pieces ``host/g/key/j``, each marked _PIECE."""
    numels = [int(n) for n in h["numels"]]
    hk = dict(h)
    for k in _HOST_KEYS:
        if h.get(k) is None:
            continue
        flat = torch.as_tensor(h[k])
        for j, part in enumerate(flat.split(numels)):
            pieces[f"host/{g}/{k}/{j}"] = part
        hk[k] = _PIECE
    return hk


def _take_zenflow_device(
    pieces: dict[str, torch.Tensor], mode_state: dict[str, Any], sk: dict[str, Any]
) -> None:
    """zenflow's device parts: its column optimizer's row moments, the stash values, the accumulators."""
    sk["device_optimizer"] = {
        n: _take(pieces, f"zdev/{n}", e, _ZEN_ROW_KEYS) for n, e in mode_state["device_optimizer"].items()
    }
    stash = {}
    for n, (c, v) in mode_state["stash"].items():
        pieces[f"stash/{n}"] = v
        stash[n] = (c, None)
    sk["stash"] = stash
    sk["device_acc"] = _take(pieces, "zacc", mode_state["device_acc"])


def piece_rows(
    pieces: dict[str, torch.Tensor], shapes: list[list[tuple[int, ...]]]
) -> dict[str, torch.Tensor]:
    """The host pieces as row blocks: ``host/g/k/j`` (flat) viewed as ``(-1, *shape[1:])`` of its parameter
    (``shapes``: per host store, its parameters' whole shapes in order)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in pieces.items():
        if key.startswith("host/"):
            _, g, _, j = key.split("/")
            t = t.view(-1, *shapes[int(g)][int(j)][1:])
        out[key] = t
    return out


def join_rows(skeleton: dict[str, Any], pieces: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The inverse of :func:`split_rows`: the skeleton with every piece put back (host stores flat again,
    their ``numels`` and ``shard`` those of the pieces given)."""
    st: dict[str, Any] = dict(skeleton)

    def put(prefix: str, d: dict[Any, Any]) -> dict[Any, Any]:
        return {k: pieces.get(f"{prefix}/{k}", v) for k, v in d.items()}

    st["device_params"] = put("device_params", skeleton["device_params"])
    if "masters" in skeleton:
        st["masters"] = put("masters", skeleton["masters"])
    if "optimizer" in skeleton:
        opt = skeleton["optimizer"]
        st["optimizer"] = {**opt, "state": {i: put(f"optimizer/{i}", s) for i, s in opt["state"].items()}}
    if "host" in skeleton:
        hosts = []
        for g, h in enumerate(skeleton["host"]):
            hk = dict(h)
            count = len(h["numels"])
            numels: list[int] = []
            for k in _HOST_KEYS:
                if h.get(k) != _PIECE:
                    continue
                parts = [pieces[f"host/{g}/{k}/{j}"].reshape(-1) for j in range(count)]
                numels = [p.numel() for p in parts]
                hk[k] = torch.cat(parts) if parts else torch.empty(0)
            hk["numels"], hk["shard"] = numels, [0, sum(numels)]
            hosts.append(hk)
        st["host"] = hosts
    if "device_optimizer" in skeleton:
        st["device_optimizer"] = {n: put(f"zdev/{n}", e) for n, e in skeleton["device_optimizer"].items()}
        st["stash"] = {n: (c, pieces[f"stash/{n}"]) for n, (c, _) in skeleton["stash"].items()}
        st["device_acc"] = put("zacc", skeleton["device_acc"])
    return st


def _chunk(whole: int, rank: int, world: int) -> tuple[int, int]:
    """``(offset, rows)`` of ``rank``'s ``torch.chunk`` of ``whole`` rows into ``world``."""
    size = -(-whole // world) if whole else 0
    start = min(rank * size, whole)
    return start, min(whole, start + size) - start


def save_rows(
    path: Path, pieces: dict[str, torch.Tensor], skeleton: dict[str, Any], group: ProcessGroup
) -> None:
    """Every rank of ``group`` (CPU, gloo) saves its pieces as ``Shard(0)`` DTensors and the skeleton
    (each rank's; DCP keeps one) into DCP folder ``path``. The mesh is the CPU group's, so pieces on a
    GPU (device mode's state, zenflow's column moments) are copied to the host first; host pieces are
    saved from their own storage."""
    import torch.distributed as tdist
    from torch.distributed.checkpoint.state_dict_saver import save
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group, "cpu")
    rows = {k: int(t.shape[0]) for k, t in pieces.items()}
    every: list[dict[str, int] | None] = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(every, rows, group=group)
    state: dict[str, Any] = {}
    for k, t in pieces.items():
        whole = (sum(r[k] for r in every if r is not None), *t.shape[1:])
        state[k] = DTensor.from_local(
            t.detach().to("cpu").contiguous(),
            mesh,
            [Shard(0)],
            shape=torch.Size(whole),
            stride=_stride(whole),
            run_check=False,
        )
    blob = io.BytesIO()
    torch.save(skeleton, blob)
    state[SKELETON] = blob
    save(state, checkpoint_id=str(path), process_group=group)


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(torch.empty(0).new_empty(shape, device="meta").stride())


def load_rows(
    path: Path, rank: int, world: int, group: ProcessGroup | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(pieces, skeleton)`` of DCP folder ``path`` with this rank's rows of each piece (``group``: the
    loading ranks, row-sharded; None: one process, whole pieces). Each rank reads only its rows."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata()
    local: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    mesh = None
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group, "cpu")
    for k, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        whole = tuple(md.size)
        if mesh is None:
            local[k] = state[k] = torch.empty(whole, dtype=md.properties.dtype)
            continue
        from torch.distributed.tensor import DTensor, Shard

        _, n = _chunk(whole[0], rank, world)
        local[k] = torch.empty((n, *whole[1:]), dtype=md.properties.dtype)
        state[k] = DTensor.from_local(
            local[k], mesh, [Shard(0)], shape=torch.Size(whole), stride=_stride(whole), run_check=False
        )
    from torch.distributed.checkpoint.state_dict_loader import load

    blob = io.BytesIO()
    state[SKELETON] = blob
    load(state, checkpoint_id=str(path), process_group=group, no_dist=group is None)
    got = state[SKELETON]  # DCP's planner puts the unpickled value in place of the buffer
    if isinstance(got, io.BytesIO):
        got.seek(0)
        got = torch.load(got, weights_only=False)  # our own checkpoint
    skeleton: dict[str, Any] = got
    return local, skeleton


def engine_pieces(engine: Any, mode_state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`split_rows` of a row-sharded engine's mode state, host pieces as row blocks of their
    parameters (views of the flat stores)."""
    from offload.engine_state import host_shapes

    pieces, skeleton = split_rows(mode_state)
    return piece_rows(pieces, host_shapes(engine._mode, engine._rows)), skeleton
