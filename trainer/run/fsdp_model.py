"""A job's weights sharded over its ranks with PyTorch FSDP2 (the resolution's ``engine.shard_params``):
the model wrapped, and its whole weights gathered back for the exported model.

Every rank builds the same model (same seed or folder), then :func:`shard_model` applies ``fully_shard``
to each decoder block (the classes transformers names in ``_no_split_modules``) and then to the root, on a
1-D device mesh of the job's ranks: each rank keeps a block of every weight's rows, FSDP all-gathers a
block's weights around its forward and backward (prefetching the next) and reduce-scatters its gradient.
The engine (:mod:`offload.fsdp`) then trains each rank's rows. FSDP averages the gradients over the ranks,
as the replicated engine does, so the loss normalisation of :mod:`trainer.run.step` stays as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from trainer.events import LogEvent
from trainer.run.distributed import all_gather_object

if TYPE_CHECKING:
    import torch

    from offload.engine import ZenFlowEngine
    from offload.memory import EngineMemory
    from trainer.run.distributed import DistContext


def _blocks(model: Any) -> Iterator[Any]:
    """The model's decoder blocks: modules of the classes some submodule lists in ``_no_split_modules``
    (transformers' unit of device placement), outermost first, none inside another."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    found: list[Any] = []
    for m in model.modules():
        if type(m).__name__ in names and not any(m is b or _contains(b, m) for b in found):
            found.append(m)
    return iter(found)


def _contains(outer: Any, inner: Any) -> bool:
    return any(m is inner for m in outer.modules())


def shard_model(model: Any, dist: DistContext, device: torch.device) -> int:
    """``fully_shard`` each decoder block, then the root (the embeddings, the final norm, the head), on
    a mesh of the job's ranks; the number of blocks sharded on their own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.world_size,))
    blocks = list(_blocks(model))
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(_root(model), mesh=mesh)
    return len(blocks)


def _root(model: Any) -> Any:
    """The module FSDP2's root is: the transformers model, inside LoRA's wrapper (peft's ``generate``
    calls the wrapped model's ``generate``, whose forwards never pass the wrapper's own forward, where the
    root's hooks would gather its weights; a training forward passes both)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def rank_param_bytes(model: Any) -> int:
    """Bytes of the parameters this rank holds between steps (its rows of sharded ones, padding not counted)."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0
    with torch.no_grad():
        for p in model.parameters():
            t = p.to_local() if isinstance(p, DTensor) else p
            total += t.numel() * t.element_size()
    return total


def gather_full_state(model: Any, engine: ZenFlowEngine, *, keep: bool) -> dict[str, torch.Tensor]:
    """The model's whole state dict on CPU with the engine's newest values (zenflow's pending CPU result
    merged in), one weight at a time: each sharded weight is all-gathered from every rank's rows, so every
    rank must call this, in step; only where ``keep`` (the writing rank) are the whole weights kept."""
    import torch
    from torch.distributed.tensor import DTensor

    newest = engine.consolidated_state_dict()  # this rank's rows, by parameter name
    name_of = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, v in model.state_dict(keep_vars=True).items():
            if isinstance(v, DTensor):
                full = _with_rows(v, newest.get(name_of.get(id(v), key))).full_tensor()
                if keep:
                    out[key] = full.to("cpu", copy=True)
                del full
            elif keep:
                out[key] = v.detach().to("cpu", copy=True)
    return out


class FullWeights:
    """A sharded full fine-tune's exported weights made one at a time (never the whole model in one
    process): each whole weight is all-gathered from every rank's rows (the engine's newest values) when
    the writing rank asks for it (:meth:`fetch`), every other rank taking part in the same gathers in
    the same order (:meth:`drain`). ``names`` is that order (the writer's: largest element first, as
    :func:`offload.state_io.write_safetensors` lays them out) and ``refs`` their global dtypes and shapes."""

    def __init__(self, model: Any, engine: ZenFlowEngine, tie_word_embeddings: bool) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        from trainer.run.checkpoint import export_names

        self._vars: dict[str, Any] = dict(model.state_dict(keep_vars=True))
        local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in self._vars.items()}
        with torch.no_grad():
            chosen = export_names({k: t.detach() for k, t in local.items()}, tie_word_embeddings)
        self.names = sorted(chosen, key=lambda n: -self._vars[n].element_size())
        self.refs = {
            n: torch.empty(self._vars[n].shape, dtype=self._vars[n].dtype, device="meta") for n in self.names
        }
        self._newest = engine.consolidated_state_dict()  # this rank's rows, by parameter name
        self._name_of = {id(p): n for n, p in model.named_parameters()}
        self._next = 0

    def fetch(self, key: str) -> torch.Tensor:
        """Weight ``key``, whole, on CPU (collective: asked for in :attr:`names`' order only)."""
        import torch
        from torch.distributed.tensor import DTensor

        if self._next >= len(self.names) or self.names[self._next] != key:
            raise RuntimeError(f"sharded export: weight {key!r} asked for out of the gathering order")
        self._next += 1
        v = self._vars[key]
        with torch.no_grad():
            if not isinstance(v, DTensor):
                plain: torch.Tensor = v.detach().to("cpu", copy=True)
                return plain
            rows = self._newest.get(self._name_of.get(id(v), key))
            whole: torch.Tensor = _with_rows(v, rows).full_tensor().to("cpu")
            return whole

    def drain(self) -> None:
        """Take part in every gather not made yet (the ranks that do not write; the writer after a failure)."""
        while self._next < len(self.names):
            self.fetch(self.names[self._next])


def rank_memory(dist: DistContext, model: Any, mem: EngineMemory, device: Any) -> LogEvent:
    """Each rank's memory at the start of a multi-rank run (a collective: every rank calls it; rank 0's
    event is the one reported): its parameter bytes (its rows when sharded), the engine's host and
    device bytes, and the device's allocated bytes on CUDA."""
    import torch

    mine = {
        "rank": dist.rank,
        "param_bytes": rank_param_bytes(model),
        "host_bytes": mem.host_bytes,
        "device_state_bytes": mem.device_state_bytes,
        "device_buffer_bytes": mem.device_buffer_bytes,
        "device_allocated_bytes": torch.cuda.memory_allocated(device) if device.type == "cuda" else None,
    }
    ranks = all_gather_object(dist, mine)
    text = "; ".join(
        f"rank {r['rank']}: {r['param_bytes']} parameter bytes, {r['host_bytes']} host bytes, "
        f"{r['device_state_bytes'] + r['device_buffer_bytes']} device engine bytes"
        for r in ranks
    )
    return LogEvent(f"Memory per rank: {text}", data={"ranks": ranks})


def reshard(model: Any) -> None:
    """Put every FSDP2 module's weights back to their row shards. A forward without a backward (DPO's
    reference pass) leaves the root's weights gathered (FSDP2 keeps the root unsharded after forward,
    expecting the backward), so its parameters are plain tensors until then; the engine must be built
    over the sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _with_rows(v: Any, rows: torch.Tensor | None) -> Any:
    """The sharded parameter ``v`` (a DTensor) with this rank's ``rows`` as its local part: the engine's
    newest values (its consolidated state) in place of the module's, else ``v`` itself."""
    from torch.distributed.tensor import DTensor

    if rows is None:
        return v
    return DTensor.from_local(
        rows.to(v.device), v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride()
    )
