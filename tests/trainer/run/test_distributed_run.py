"""One job as 2 data-parallel gloo ranks on the CPU (trainer.run.distributed, run_training(dist=...)):
the same weights as one process taking the whole batch, per-rank step events, checkpoints complete only
with every rank's engine shard, exact 2->2 resume and re-cut 2->1 / 1->2 resumes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.dist_ranks import Job, RankOutcome, train_on_ranks
from tests.trainer.run.test_loop import Recorder, arithmetic_file, make_spec
from trainer.data.batching import rank_part
from trainer.run.checkpoint import (
    FINAL_DIR,
    MANIFEST,
    TRAINING_STATE,
    engine_shard_name,
    is_complete,
    latest_checkpoint,
    load_training_state,
)
from trainer.run.distributed import DistContext, all_sum, any_rank, init_from_env
from trainer.run.loop import TrainResult, run_training
from trainer.spec import JobSpec

pytestmark = pytest.mark.usefixtures("torch_single_thread")

MODES: dict[str, dict[str, Any]] = {
    "zenflow": {"mode": "zenflow", "update_interval": 2, "full_warm_up_rounds": 0},
    "offload": {"mode": "offload"},
    "device": {"mode": "device"},
}
#: 40 examples, 4 a step (2 per rank): 10 steps; checkpoints at 3, 6, 9, 10; validation at 5 and 10.
HP = {
    "n_epochs": 1,
    "batch_size": 4,
    "checkpoint_every": 3,
    "eval_every": 5,
    "max_seq_length": 32,
    "learning_rate": 1e-2,
}
STEPS = 10


def spec(out: Path, data: Path, valid: Path, mode: str, gpus: int = 2, **hp: Any) -> JobSpec:
    return make_spec(
        out,
        data,
        valid,
        hyperparameters={**HP, **hp},
        engine=MODES[mode],
        dtype="float32",
        resources={"gpus": gpus},
    )


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / FINAL_DIR / "model.safetensors"))


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        err = float((a[k].double() - b[k].double()).norm())
        assert err <= rel * max(float(a[k].double().norm()), 1e-12), (k, err)


def ok(outcomes: list[RankOutcome]) -> TrainResult:
    """Every rank finished without error with the same result; that result."""
    for o in outcomes:
        assert o.error is None, o.error
    assert outcomes[0].result == outcomes[1].result
    assert outcomes[0].result is not None
    return TrainResult(**outcomes[0].result)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("dist")
    arithmetic_file(root / "ragged.jsonl", n=21, seed=2)  # 6 steps of 4; the last one's 1 example on rank 1
    return (
        root,
        arithmetic_file(root / "sums.jsonl", n=40),
        arithmetic_file(root / "valid.jsonl", n=7, seed=1),
    )


@pytest.fixture(scope="module")
def two_ranks(files: tuple[Path, Path, Path]) -> dict[str, list[RankOutcome]]:
    """One start-up of 2 ranks for: a full run per mode, a run rank 1 alone cancels after 4 steps, and a
    batch too small for the ranks."""
    root, data, valid = files
    jobs = {f"full-{m}": Job(spec(root / f"full-{m}", data, valid, m)) for m in MODES}
    jobs["cut"] = Job(spec(root / "cut", data, valid, "zenflow"), cancel_after=4, cancel_ranks=(1,))
    jobs["tiny-batch"] = Job(spec(root / "tiny-batch", data, valid, "device", batch_size=1))
    jobs["ragged"] = Job(spec(root / "ragged", root / "ragged.jsonl", valid, "offload"))
    return dict(zip(jobs, train_on_ranks(list(jobs.values()), timeout=400), strict=True))


@pytest.fixture(scope="module")
def one_process(files: tuple[Path, Path, Path]) -> dict[str, TrainResult]:
    root, data, valid = files
    runs = {m: run_training(spec(root / f"single-{m}", data, valid, m, gpus=1)) for m in MODES}
    runs["ragged"] = run_training(
        spec(root / "single-ragged", root / "ragged.jsonl", valid, "offload", gpus=1)
    )
    seen = Recorder()
    runs["cut"] = run_training(
        spec(root / "single-cut", data, valid, "zenflow", gpus=1),
        on_event=seen,
        should_cancel=lambda: len(seen.of("step")) >= 4,
    )
    return runs


@pytest.fixture(scope="module")
def resumed(
    files: tuple[Path, Path, Path],
    two_ranks: dict[str, list[RankOutcome]],
    one_process: dict[str, TrainResult],
) -> dict[str, Any]:
    """2->2 and 1->2 (2 ranks), and 2->1 (this process), each from a run cancelled at step 4; and a
    finished 2-rank run asked again."""
    root, data, valid = files
    ok(two_ranks["cut"])
    shutil.copytree(root / "cut", root / "cut-to-1")
    assert one_process["cut"].cancelled
    b = train_on_ranks(
        [
            Job(spec(root / "cut", data, valid, "zenflow")),
            Job(spec(root / "single-cut", data, valid, "zenflow")),
            Job(spec(root / "full-device", data, valid, "device")),
        ],
        timeout=300,
    )
    rec = Recorder()
    to_one = run_training(spec(root / "cut-to-1", data, valid, "zenflow", gpus=1), on_event=rec)
    return {"2-2": b[0], "1-2": b[1], "again": b[2], "2-1": to_one, "2-1-events": rec}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_two_ranks_equal_one_process_with_the_whole_batch(
    mode: str,
    files: tuple[Path, Path, Path],
    two_ranks: dict[str, list[RankOutcome]],
    one_process: dict[str, TrainResult],
) -> None:
    root = files[0]
    two, one = ok(two_ranks[f"full-{mode}"]), one_process[mode]
    assert two.steps == one.steps == STEPS and not two.cancelled
    assert two.trained_tokens == one.trained_tokens
    assert two.train_loss == pytest.approx(one.train_loss, rel=1e-5)
    assert two.valid_loss == pytest.approx(one.valid_loss, rel=1e-5)
    assert_close(weights(root / f"full-{mode}"), weights(root / f"single-{mode}"))
    # The weights moved since step 6 (the comparison is not between two copies of the same state).
    mid = load_file(str(root / f"full-{mode}" / "checkpoint-000006" / "model.safetensors"))
    assert any(not torch.equal(mid[k], v) for k, v in weights(root / f"full-{mode}").items())


@pytest.mark.slow
def test_a_rank_without_examples_in_a_step_adds_nothing(
    files: tuple[Path, Path, Path],
    two_ranks: dict[str, list[RankOutcome]],
    one_process: dict[str, TrainResult],
) -> None:
    two = ok(two_ranks["ragged"])
    assert two.steps == one_process["ragged"].steps == 6
    assert two.trained_tokens == one_process["ragged"].trained_tokens
    assert_close(weights(files[0] / "ragged"), weights(files[0] / "single-ragged"))


@pytest.mark.slow
def test_events_step_per_rank_the_rest_from_rank_0(two_ranks: dict[str, list[RankOutcome]]) -> None:
    r0, r1 = two_ranks["full-zenflow"]
    assert {t for t, *_ in r1.events} == {"step"}  # rank 1: its step events only
    types0 = [t for t, *_ in r0.events]
    assert types0[-1] == "run_finished" and "run_started" in types0 and types0.count("eval") == 2
    assert types0.count("checkpoint") == 4
    steps0 = [(s, loss) for t, s, loss, _ in r0.events if t == "step"]
    steps1 = [(s, loss) for t, s, loss, _ in r1.events if t == "step"]
    assert steps0 == steps1 and [s for s, _ in steps0] == list(
        range(1, STEPS + 1)
    )  # global loss, same on both
    assert {rk for t, _, _, rk in r0.events if t == "step"} == {0}
    assert {rk for t, _, _, rk in r1.events if t == "step"} == {1}


@pytest.mark.slow
def test_one_host_all_reduce_per_step_and_the_loss_only_at_boundaries(
    two_ranks: dict[str, list[RankOutcome]],
) -> None:
    """Counts, cancel vote and the previous loss ride one all-reduce per step; the loss alone is reduced
    only where it is due (checkpoints at 3, 6, 9, validation at 5, the end at 10) and the validation
    sums twice: 5 + 2. A step's event still comes before that step's eval and checkpoint events."""
    for r in two_ranks["full-device"]:
        assert r.reductions == {"step": STEPS, "loop": 5 + 2}
    events = [
        (t, s) for t, s, *_ in two_ranks["full-device"][0].events if t in ("step", "eval", "checkpoint")
    ]
    for t, s in events:
        if t != "step":
            assert events.index(("step", s)) < events.index((t, s))


@pytest.mark.slow
def test_checkpoint_is_complete_only_with_every_shard(
    files: tuple[Path, Path, Path], two_ranks: dict[str, list[RankOutcome]], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    out = files[0] / "full-zenflow"
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.step == STEPS
    shards = [engine_shard_name(r, 2) for r in range(2)]
    assert all((ckpt.path / s).is_file() for s in shards) and set(shards) <= set(ckpt.manifest["files"])
    state = load_training_state(ckpt.path)
    assert state["world_size"] == 2 and "engine" not in state
    assert not list(out.glob("*.tmp-*"))  # the staged shard files were all moved in
    copy = tmp_path / "out" / ckpt.path.name
    shutil.copytree(ckpt.path, copy)
    assert is_complete(copy)
    (copy / shards[1]).unlink()
    assert not is_complete(copy) and latest_checkpoint(tmp_path / "out") is None
    final = out / FINAL_DIR
    assert not (final / TRAINING_STATE).exists() and not list(final.glob("engine-rank*"))
    assert (final / MANIFEST).is_file()
    model = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True)
    w = weights(out)
    loaded = dict(model.named_parameters())
    assert all(torch.equal(loaded[k], w[k]) for k in w)


@pytest.mark.slow
def test_cancel_on_any_rank_stops_all_at_the_same_step(two_ranks: dict[str, list[RankOutcome]]) -> None:
    cut = ok(two_ranks["cut"])  # only rank 1 was asked to cancel
    assert cut.cancelled and cut.steps == 4 and cut.final_model_dir is None
    assert [s for t, s, *_ in two_ranks["cut"][0].events if t == "step"] == [1, 2, 3, 4]


@pytest.mark.slow
def test_resume_two_to_two_is_bit_exact(files: tuple[Path, Path, Path], resumed: dict[str, Any]) -> None:
    root = files[0]
    res = ok(resumed["2-2"])
    assert res.steps == STEPS and [s for t, s, *_ in resumed["2-2"][1].events if t == "step"] == list(
        range(5, 11)
    )
    a, b = weights(root / "cut"), weights(root / "full-zenflow")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [
        k for k in a if not torch.equal(a[k], b[k])
    ]


@pytest.mark.slow
def test_resume_two_to_one_and_one_to_two(
    files: tuple[Path, Path, Path], resumed: dict[str, Any], one_process: dict[str, TrainResult]
) -> None:
    root = files[0]
    to_one: TrainResult = resumed["2-1"]
    assert to_one.steps == STEPS and not to_one.cancelled
    assert any("re-cut" in getattr(e, "message", "") for e in resumed["2-1-events"].of("log"))
    assert_close(weights(root / "cut-to-1"), weights(root / "full-zenflow"))
    to_two = ok(resumed["1-2"])
    assert to_two.steps == STEPS
    assert_close(weights(root / "single-cut"), weights(root / "single-zenflow"))


@pytest.mark.slow
def test_finished_run_is_not_rerun(two_ranks: dict[str, list[RankOutcome]], resumed: dict[str, Any]) -> None:
    again = resumed["again"]
    assert ok(again) == ok(two_ranks["full-device"])
    assert not [t for o in again for t, *_ in o.events if t == "step"]


@pytest.mark.slow
def test_batch_smaller_than_the_ranks_is_refused(two_ranks: dict[str, list[RankOutcome]]) -> None:
    for o in two_ranks["tiny-batch"]:
        assert o.error is not None and "hyperparameters.batch_size" in o.error.splitlines()[0]


def test_group_size_must_match_the_spec(tmp_path: Path) -> None:
    fake = DistContext(rank=0, world_size=2, local_rank=0, backend="gloo", group=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"resources.gpus"):
        run_training(make_spec(tmp_path / "o"), dist=fake)


def test_rank_parts_cover_the_batch_contiguously() -> None:
    items = list(range(7))
    parts = [rank_part(items, r, 3) for r in range(3)]
    assert parts == [[0, 1], [2, 3], [4, 5, 6]] and [x for p in parts for x in p] == items
    assert [rank_part([1], r, 2) for r in range(2)] == [[], [1]]
    with pytest.raises(ValueError):
        rank_part(items, 3, 3)


def test_collectives_without_a_group_are_local() -> None:
    assert all_sum(None, [1, 2.5]) == [1.0, 2.5] and any_rank(None, True) and not any_rank(None, False)


@pytest.mark.parametrize(
    "env, problem",
    [
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "RANK is not set"),
        (
            {"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"},
            r"RANK=2 must be in \[0, 1\]",
        ),
        ({"WORLD_SIZE": "two", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "WORLD_SIZE='two'"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "1"}, "MASTER_ADDR"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "MASTER_PORT=99999"),
    ],
)
def test_init_from_env_refuses_bad_variables(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], problem: str
) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=problem):
        init_from_env(device="cpu")


@pytest.mark.parametrize("world", [None, "1", ""])
def test_init_from_env_single_process(monkeypatch: pytest.MonkeyPatch, world: str | None) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert init_from_env(device="cpu") is None
