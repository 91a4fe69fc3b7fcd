"""The engine over PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``): every rank holds 1/N of the weights.

After ``fully_shard`` a parameter is a DTensor placed ``Shard(0)`` on a 1-D device mesh: each rank keeps a
block of its rows (``to_local()``), FSDP all-gathers the whole weight around each block's forward and
backward, and reduce-scatters the gradient so that ``p.grad`` is a DTensor holding this rank's rows of
the mean gradient over the ranks. So the engine needs none of its own data-parallel collectives
(:mod:`offload.collectives`): its modes run exactly as in one process over each rank's *local rows*
(fp32 master, moments and accumulators sized to the shard), updating them in place so FSDP's storage stays
the one it gathers from. What is global goes through a collective on the mesh's group:

- the clipping norm and with it the non-finite verdict (:func:`clip_rows_`: each parameter's squared
  norm summed over the ranks, then the norm of those as one process computes it);
- zenflow's column importance (:func:`column_scores_`: each rank's per-column sums over its rows, added
  in one all-reduce of ``cols`` floats per weight, so every rank selects the same columns) and its
  ``"adaptive"`` window masses (:func:`all_sum_`), so every rank ends its windows at the same steps.

A column is an index into dim 1 and rows are dim 0, so a row block holds every column: the same split
into device columns and host rest on every rank. 1-D parameters are row-sharded too and stay whole-updated
(their local slice).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from offload.clipping import grad_norms
from offload.selection import column_scores

__all__ = ["RowShards", "all_sum_", "clip_rows_", "column_scores_", "is_row_sharded"]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        return None
    return DTensor


def is_row_sharded(named: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Whether the parameters are DTensors (``fully_shard`` applied to the model)."""
    dt = _dtensor_type()
    return dt is not None and any(isinstance(p, dt) for _, p in named)


class RowShards:
    """A model's FSDP2 parameters and the local row blocks the engine trains (see the module docstring).

    ``named`` are the DTensor parameters with ``requires_grad``; they must all be ``Shard(0)`` on one 1-D
    mesh. ``local`` is each one's local rows (an alias of FSDP's sharded storage: the engine's in-place
    updates are what FSDP gathers next). ``bind_grads()`` points each local block's ``.grad`` at the
    rank's rows of the reduce-scattered gradient before a step; ``clear_grads()`` drops both.
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        from torch.distributed.tensor import DTensor, Shard

        meshes = set()
        for n, p in named:
            if not isinstance(p, DTensor):
                raise ValueError(
                    f"{n}: not sharded while other parameters are (apply fully_shard to every block and the root)"
                )
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise ValueError(
                    f"{n}: placements {tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh; the engine takes "
                    "fully_shard's row sharding (Shard(0)) on a 1-D mesh"
                )
            meshes.add(id(p.device_mesh))
        if len(meshes) != 1:
            raise ValueError("every sharded parameter must live on the same device mesh")
        first = named[0][1]
        assert isinstance(first, DTensor)
        mesh = first.device_mesh
        self.group: Any = mesh.get_group()
        self.world: int = dist.get_world_size(self.group)
        self.rank: int = dist.get_rank(self.group)
        self.params: list[Any] = [p for _, p in named]
        with torch.no_grad():
            self.local: list[torch.Tensor] = [p.to_local() for p in self.params]
        self.named_local: list[tuple[str, torch.nn.Parameter]] = [
            (n, loc)  # type: ignore[misc]  # a plain tensor aliasing the parameter's rows, used as one
            for (n, _), loc in zip(named, self.local, strict=True)
        ]
        #: Parameters' full shapes (the consolidated model's), by name.
        self.shapes = {n: tuple(p.shape) for n, p in named}

    @classmethod
    def of(
        cls, named: Sequence[tuple[str, torch.Tensor]], shard_params: bool, process_group: Any
    ) -> RowShards | None:
        """The engine's row shards (``EngineConfig.shard_params``), None for whole parameters; refuses a
        model sharded otherwise than the config says, and a process group beside the mesh's."""
        if is_row_sharded(named) != shard_params:
            raise ValueError(
                "engine.shard_params is true but the model is not sharded (apply fully_shard first)"
                if shard_params
                else "the model's parameters are FSDP2-sharded: set shard_params=True"
            )
        if not shard_params:
            return None
        if process_group is not None:
            raise ValueError("sharded parameters carry their device mesh's group: pass no process_group")
        return cls(named)

    def check_storage(self) -> None:
        """Raise if FSDP replaced a parameter's local storage (``model.to()``, ``load_state_dict(assign=True)``
        after the engine was built): the engine would update a tensor FSDP no longer gathers from."""
        for p, loc in zip(self.params, self.local, strict=True):
            mine = p._local_tensor
            if loc.numel() and mine.untyped_storage().data_ptr() != loc.untyped_storage().data_ptr():
                raise RuntimeError(
                    "an FSDP parameter's local storage changed after the engine was built; build the engine "
                    "after moving or loading the sharded model"
                )

    @torch.no_grad()
    def bind_grads(self) -> None:
        """Each local block's ``.grad`` := this rank's rows of its parameter's reduce-scattered gradient
        (after checking FSDP still gathers from the blocks the engine updates)."""
        self.check_storage()
        for p, loc in zip(self.params, self.local, strict=True):
            g = p.grad
            loc.grad = None if g is None else g.to_local()

    def clear_grads(self) -> None:
        for p, loc in zip(self.params, self.local, strict=True):
            p.grad = None
            loc.grad = None


def all_sum_(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` summed over the group's ranks, in place (gloo: CPU tensors, NCCL: the rank's device)."""
    dist.all_reduce(t, group=group)
    return t


@torch.no_grad()
def clip_rows_(
    grads: list[torch.Tensor],
    max_norm: float | None,
    device: torch.device,
    group: Any,
    *,
    inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`offload.clipping.clip_` over row-sharded gradients (every rank's local rows of the same
    parameters, in the same order): each parameter's squared norm is summed over the ranks (one all-reduce
    of a float per parameter), then the total is the norm of those norms, as one process computes it.
    Same ``(total_norm, coef)`` on every rank; gradients scaled in place as ``clip_`` does."""
    if not grads:
        return torch.zeros((), device=device), torch.ones((), device=device)
    sq = all_sum_(grad_norms(grads, inv).square(), group)
    total = torch.linalg.vector_norm(sq.sqrt())
    if max_norm is None:
        return total, torch.ones((), device=device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scaled = grads if inv is None else [g for g in grads if g.dtype != torch.float16]
    if scaled:
        torch._foreach_mul_(scaled, coef)
    return total, coef


@torch.no_grad()
def column_scores_(params: Sequence[tuple[str, torch.Tensor]], group: Any) -> dict[str, torch.Tensor]:
    """Global column importance of row-sharded 2-D weights: each rank's per-column ``sum |g|`` over its
    rows, added over the ranks in one all-reduce (``cols`` floats per weight). Every rank gets the same
    scores, so the same top-k. A weight without a gradient is left out (it keeps its columns), alike on
    every rank since FSDP gives a gradient on all ranks or none."""
    names: list[str] = []
    parts: list[torch.Tensor] = []
    for n, p in params:
        g = p.grad
        if g is None:
            continue
        names.append(n)
        parts.append(column_scores(g))
    if not parts:
        return {}
    flat = all_sum_(torch.cat(parts), group)
    return dict(zip(names, flat.split([t.numel() for t in parts]), strict=True))
