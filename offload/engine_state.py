"""Which saved engine state a rank loads: checks of ``ZenFlowEngine.load_state_dict``'s argument, kept
apart from the engine so its facade stays small."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offload.fsdp import RowShards
    from offload.mode_base import Mode

#: The layout version of ``ZenFlowEngine.state_dict()``.
STATE_VERSION = 1


def states_to_load(
    sd: dict[str, Any] | list[dict[str, Any]], mode: str, rank: int, world: int, *, row_sharded: bool = False
) -> tuple[list[dict[str, Any]], bool]:
    """``(states, recut)``: the states given (one, or every rank's of the saving group in rank order)
    after checking their version, mode and shard; ``recut`` when they come from a group of another size
    (the mode re-cuts its host shards), else ``states[rank if a list else 0]`` is this rank's own.
    ``row_sharded`` (:mod:`offload.fsdp`): this engine trains row blocks; ``recut`` too when the saved
    states' row sharding differs from it (:func:`recut_mode_state` then converts them)."""
    states = sd if isinstance(sd, list) else [sd]
    if not states:
        raise ValueError("no engine state to load")
    for st in states:
        if st.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported engine state version {st.get('version')!r}")
        if st.get("mode") != mode:
            raise ValueError(f"engine state is for mode {st.get('mode')!r}, this engine runs {mode!r}")
    shards = [st.get("shard", {"rank": 0, "world_size": 1}) for st in states]
    saved_rows = bool(shards[0].get("row_sharded", False))
    if isinstance(sd, list):
        saved = len(states)
        in_order = [x["rank"] for x in shards] == list(range(saved))
        if not in_order or {x["world_size"] for x in shards} != {saved}:
            raise ValueError(f"expected the states of every rank of one group in rank order, got {shards}")
        if {bool(x.get("row_sharded", False)) for x in shards} != {saved_rows}:
            raise ValueError("the ranks' engine states are not all row-sharded (FSDP2) or all whole")
        return states, saved != world or saved_rows != row_sharded
    if saved_rows != row_sharded:
        raise ValueError(
            "engine state of row-sharded (FSDP2) parameters cannot be loaded into whole ones or the reverse "
            "from one rank's state: pass every rank's state as a list to re-cut the rows"
        )
    if (shards[0]["rank"], shards[0]["world_size"]) != (rank, world):
        raise ValueError(
            f"engine state of rank {shards[0]['rank']} of {shards[0]['world_size']} cannot be loaded by "
            f"rank {rank} of {world}: pass every rank's state as a list to re-cut the shards"
        )
    return states, False


def recut_mode_state(
    states: list[dict[str, Any]], rank: int, world: int, mode: Mode, rows: RowShards | None
) -> dict[str, Any]:
    """The mode state to load (as the one shard of ``Mode.load_shards``) when row-sharded state meets
    another group (:mod:`offload.row_recut`): the whole parameters' state, cut to this rank's rows when the
    loading engine is row-sharded (``rows``)."""
    from offload.row_recut import cut_rows, to_whole

    shapes = host_shapes(mode, rows)
    saved_rows = bool(states[0].get("shard", {}).get("row_sharded", False))
    whole = to_whole([st["mode_state"] for st in states], saved_rows, shapes)
    return cut_rows(whole, rank, world, shapes) if rows is not None else whole


def host_shapes(mode: Mode, rows: RowShards | None) -> list[list[tuple[int, ...]]]:
    """Per host store of ``mode`` (offload's and zenflow's, by dtype), its parameters' whole shapes in order."""

    def whole(n: str, p: Any) -> tuple[int, ...]:
        return rows.shapes[n] if rows is not None else tuple(p.shape)

    layout = getattr(mode, "layout", None)  # zenflow: the split weights, store by store in index order
    if layout is not None:
        return [[whole(s.name, s.param) for s in layout.splits if s.store is st] for st in layout.stores]
    return [[whole(n, p) for n, p in g] for _, g in getattr(mode, "groups", [])]
