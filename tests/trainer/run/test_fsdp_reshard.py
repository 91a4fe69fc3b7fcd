"""A sharded (FSDP2) checkpoint resumed on another number of ranks (``offload.dcp_state``: each rank reads its
rows from the checkpoint's DCP folder; ``offload.row_recut`` for 1 process -> N): 4 sharded ranks
-> 2 sharded -> 1 process, and 1 process -> 2 sharded, each chain equal to an uninterrupted run within
1e-5 in every mode (zenflow's column selections global, its column moments and stash rows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.dist_ranks import Job, train_on_ranks
from tests.trainer.run.test_distributed_run import STEPS, assert_close, ok, weights
from tests.trainer.run.test_fsdp_run import spec
from tests.trainer.run.test_loop import arithmetic_file
from trainer.run.checkpoint import latest_checkpoint, load_rank_state
from trainer.run.loop import TrainResult, run_training

RECUT = ("device", "offload", "zenflow")
pytestmark = [pytest.mark.usefixtures("torch_single_thread"), pytest.mark.slow]


def _cancel_after(n: int) -> object:
    polls = [0]

    def cancel() -> bool:
        polls[0] += 1
        return polls[0] > n

    return cancel


@pytest.fixture(scope="module")
def chains(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("reshard")
    data = arithmetic_file(root / "sums.jsonl", n=40)
    valid = arithmetic_file(root / "valid.jsonl", n=7, seed=1)
    out: dict[str, object] = {"root": root, "data": data, "valid": valid}
    for m in RECUT:
        out[f"single-{m}"] = run_training(spec(root / f"single-{m}", data, valid, m, gpus=1))
        cut = run_training(spec(root / f"one-{m}", data, valid, m, gpus=1), should_cancel=_cancel_after(4))  # type: ignore[arg-type]
        assert cut.cancelled and cut.last_checkpoint is not None
    four = train_on_ranks(
        [Job(spec(root / f"four-{m}", data, valid, m, gpus=4), cancel_after=4) for m in RECUT],
        world=4,
        timeout=500,
    )
    out["four"] = dict(zip(RECUT, four, strict=True))
    for m in RECUT:  # the 4-rank checkpoint: each rank its rows
        ck = latest_checkpoint(root / f"four-{m}")
        assert ck is not None
        out[f"four-step-{m}"] = ck.step
        shards = [load_rank_state(ck.path, r, 4)["engine"] for r in range(4)]
        out[f"four-shard-{m}"] = [s["shard"] for s in shards]
        # the rows are in DCP's folder, one file per rank: the shard files keep no engine state to load
        out[f"four-rows-{m}"] = [s["mode_state"] for s in shards]
        out[f"four-dcp-{m}"] = sorted(p.name for p in (ck.path / "engine-dcp").iterdir())
    jobs = [Job(spec(root / f"four-{m}", data, valid, m, gpus=2), cancel_after=3) for m in RECUT]
    jobs += [Job(spec(root / f"one-{m}", data, valid, m, gpus=2)) for m in RECUT]
    two = train_on_ranks(jobs, world=2, timeout=500)
    out["two"] = dict(zip([f"four-{m}" for m in RECUT] + [f"one-{m}" for m in RECUT], two, strict=True))
    for m in RECUT:  # the 2-rank leg's checkpoint finished on one process
        ck = latest_checkpoint(root / f"four-{m}")
        assert ck is not None
        out[f"two-step-{m}"] = ck.step
        out[f"last-{m}"] = run_training(spec(root / f"four-{m}", data, valid, m, gpus=1))
    return out


@pytest.mark.parametrize("mode", RECUT)
def test_four_sharded_then_two_sharded_then_one_equals_uninterrupted(
    mode: str, chains: dict[str, object]
) -> None:
    root = chains["root"]
    assert isinstance(root, Path)
    first = ok(chains["four"][mode])  # type: ignore[index]
    assert first.cancelled
    assert chains[f"four-shard-{mode}"] == [
        {"rank": r, "world_size": 4, "row_sharded": True} for r in range(4)
    ]
    assert chains[f"four-rows-{mode}"] == [None] * 4
    assert chains[f"four-dcp-{mode}"] == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    second = ok(chains["two"][f"four-{mode}"])  # type: ignore[index]
    assert second.cancelled
    # each leg resumed from the previous one's checkpoint and moved on
    assert 0 < chains[f"four-step-{mode}"] < chains[f"two-step-{mode}"] < STEPS  # type: ignore[operator]
    last = chains[f"last-{mode}"]
    single = chains[f"single-{mode}"]
    assert isinstance(last, TrainResult) and isinstance(single, TrainResult)
    assert last.steps == single.steps == STEPS and not last.cancelled
    assert last.train_loss == pytest.approx(single.train_loss, rel=1e-5)
    assert last.valid_loss == pytest.approx(single.valid_loss, rel=1e-5)
    assert_close(weights(root / f"four-{mode}"), weights(root / f"single-{mode}"))


@pytest.mark.parametrize("mode", RECUT)
def test_one_process_then_two_sharded_equals_uninterrupted(mode: str, chains: dict[str, object]) -> None:
    root = chains["root"]
    assert isinstance(root, Path)
    res = ok(chains["two"][f"one-{mode}"])  # type: ignore[index]
    single = chains[f"single-{mode}"]
    assert isinstance(single, TrainResult)
    assert res.steps == STEPS and not res.cancelled
    assert res.train_loss == pytest.approx(single.train_loss, rel=1e-5)
    assert_close(weights(root / f"one-{mode}"), weights(root / f"single-{mode}"))
    # finished sharded: its last checkpoint holds the DCP folder, the exported model does not
    last = latest_checkpoint(root / f"one-{mode}")
    assert last is not None and (last.path / "engine-dcp" / ".metadata").is_file()
    assert not (root / f"one-{mode}" / "final" / "engine-dcp").exists()
