"""Which saved engine state a rank loads: checks of ``ZenFlowEngine.load_state_dict``'s argument, kept
apart from the engine so its facade stays small."""

from __future__ import annotations

from typing import Any

#: The layout version of ``ZenFlowEngine.state_dict()``.
STATE_VERSION = 1


def states_to_load(
    sd: dict[str, Any] | list[dict[str, Any]], mode: str, rank: int, world: int, *, row_sharded: bool = False
) -> tuple[list[dict[str, Any]], bool]:
    """``(states, recut)``: the states given (one, or every rank's of the saving group in rank order)
    after checking their version, mode and shard; ``recut`` when they come from a group of another size
    (the mode re-cuts its host shards), else ``states[rank if a list else 0]`` is this rank's own.
    ``row_sharded`` (:mod:`offload.fsdp`): the state is the rank's row blocks, loadable only by the same
    rank of a group of the same size."""
    states = sd if isinstance(sd, list) else [sd]
    if not states:
        raise ValueError("no engine state to load")
    for st in states:
        if st.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported engine state version {st.get('version')!r}")
        if st.get("mode") != mode:
            raise ValueError(f"engine state is for mode {st.get('mode')!r}, this engine runs {mode!r}")
    shards = [st.get("shard", {"rank": 0, "world_size": 1}) for st in states]
    if bool(shards[0].get("row_sharded", False)) != row_sharded:
        raise ValueError(
            "engine state of row-sharded (FSDP2) parameters cannot be loaded into whole ones or the reverse"
        )
    if isinstance(sd, list):
        saved = len(states)
        in_order = [x["rank"] for x in shards] == list(range(saved))
        if not in_order or {x["world_size"] for x in shards} != {saved}:
            raise ValueError(f"expected the states of every rank of one group in rank order, got {shards}")
        if saved != world and row_sharded:
            raise ValueError(
                f"row-sharded engine states of {saved} rank(s) cannot be re-cut for {world}: resume on {saved}"
            )
        return states, saved != world
    if (shards[0]["rank"], shards[0]["world_size"]) != (rank, world):
        raise ValueError(
            f"engine state of rank {shards[0]['rank']} of {shards[0]['world_size']} cannot be loaded by "
            f"rank {rank} of {world}: pass every rank's state as a list to re-cut the shards"
        )
    return states, False
