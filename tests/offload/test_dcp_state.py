"""offload.dcp_state: row-sharded engine states saved by 4 gloo ranks through torch.distributed.checkpoint
load on 2 ranks as exactly the rows offload.row_recut cuts (and on one process as the whole state), and a
loading rank materialises only its own rows, where the row_recut path builds the whole state."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from offload.dcp_state import join_rows, load_rows, piece_rows, save_rows, split_rows
from offload.row_recut import cut_rows, to_whole
from tests.dist_ranks import run_ranks
from tests.offload.test_row_recut import _equal

# 8 parameters of equal size: the largest is 1/8 of the state, so a rank's half plus one parameter
# stays below the whole state that the re-cut builds
SHAPES = [(9, 4)] * 7 + [(3, 12)]


def _whole(mode: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    params = {f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(SHAPES)}
    sd: dict[str, Any] = {"mode": mode, "device_params": params}
    if mode == "device":
        sd["masters"] = {n: p * 5 for n, p in params.items()}
        sd["optimizer"] = {
            "state": {
                i: {"step": torch.tensor(3.0), "exp_avg": p * 2, "exp_avg_sq": p * 3}
                for i, p in enumerate(params.values())
            },
            "param_groups": [{"lr": 0.1, "params": list(range(len(SHAPES)))}],
        }
    else:
        flat = torch.cat([t.reshape(-1) for t in params.values()])
        sd["host"] = [
            {"master": flat, "exp_avg": flat * 2, "exp_avg_sq": flat * 3, "acc": flat * 4, "acc_index": 1,
             "steps": [3] * len(SHAPES), "numels": [t.numel() for t in params.values()],
             "shard": [0, flat.numel()]}
        ]  # fmt: skip
    return sd


def _shapes(mode: str) -> list[list[tuple[int, ...]]]:
    return [list(SHAPES)] if mode == "offload" else []


def _rank(rank: int, world: int, root: str, mode: str, save: bool) -> None:
    group = dist.group.WORLD
    assert group is not None
    if save:
        mine = cut_rows(_whole(mode), rank, world, _shapes(mode))
        pieces, skeleton = split_rows(mine)
        save_rows(Path(root) / "engine-dcp", piece_rows(pieces, _shapes(mode)), skeleton, group)
    else:
        pieces, skeleton = load_rows(Path(root) / "engine-dcp", rank, world, group)
        torch.save(
            {"state": join_rows(skeleton, pieces), "bytes": sum(t.nbytes for t in pieces.values())},
            Path(root) / f"loaded-{rank}.pt",
        )


def _bytes(sd: Any) -> int:
    if isinstance(sd, torch.Tensor):
        return sd.nbytes if sd.dim() > 0 else 0
    if isinstance(sd, dict):
        return sum(_bytes(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(_bytes(v) for v in sd)
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["device", "offload"])
def test_four_ranks_saved_load_as_two_ranks_rows_and_as_one_whole(mode: str, tmp_path: Path) -> None:
    root = str(tmp_path)
    run_ranks(_rank, 4, root, mode, True)
    names = sorted(os.listdir(tmp_path / "engine-dcp"))
    assert names == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    run_ranks(_rank, 2, root, mode, False)
    whole = _whole(mode)
    every = _bytes(whole)
    largest = every // len(SHAPES)
    for r in range(2):
        got = torch.load(tmp_path / f"loaded-{r}.pt", weights_only=False)
        want = cut_rows(whole, r, 2, _shapes(mode))
        assert _equal(got["state"], want)
        own = _bytes(want)
        # what this rank's load materialised: its own rows, about half the state
        assert got["bytes"] <= 1.2 * own + largest
        # the row_recut path builds every parameter's whole state first: over the same bound
        saved = [cut_rows(whole, s, 4, _shapes(mode)) for s in range(4)]
        assert _bytes(to_whole(saved, True, _shapes(mode))) > 1.2 * own + largest
    # one process (no group): the whole state
    pieces, skeleton = load_rows(tmp_path / "engine-dcp", 0, 1, None)
    assert _equal(join_rows(skeleton, pieces), whole)
