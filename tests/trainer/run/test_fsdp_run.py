"""A job's weights sharded over 2 gloo ranks with FSDP2 (``engine.shard_params: true``): the same final
weights as one process taking the whole batch in every mode, every rank's engine state its own rows, a
ragged last step (a rank with fewer examples runs zero-loss passes) and the sharded checkpoint resumed
on as many ranks (bit-exact) and on one (tests/trainer/run/test_fsdp_reshard.py: other counts)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.dist_ranks import Job, RankOutcome, train_on_ranks
from tests.trainer.run.test_distributed_run import HP, MODES, STEPS, assert_close, ok, weights
from tests.trainer.run.test_loop import arithmetic_file, make_spec
from trainer.run.checkpoint import FINAL_DIR, latest_checkpoint, load_rank_state
from trainer.run.loop import TrainResult, run_training
from trainer.spec import JobSpec

LORA = {"r": 4}
pytestmark = [pytest.mark.usefixtures("torch_single_thread"), pytest.mark.slow]


def spec(
    out: Path, data: Path, valid: Path, mode: str, gpus: int = 2, shard: bool = True, **kw: Any
) -> JobSpec:
    return make_spec(
        out,
        data,
        valid,
        hyperparameters=HP,
        engine={**MODES[mode], "shard_params": shard},
        dtype="float32",
        resources={"gpus": gpus},
        **kw,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    root = tmp_path_factory.mktemp("fsdp")
    return (
        root,
        arithmetic_file(root / "sums.jsonl", n=40),
        arithmetic_file(root / "valid.jsonl", n=7, seed=1),
        arithmetic_file(root / "ragged.jsonl", n=21, seed=2),  # the last step's 1 example on rank 0 only
    )


@pytest.fixture(scope="module")
def sharded(files: tuple[Path, Path, Path, Path]) -> dict[str, list[RankOutcome]]:
    root, data, valid, ragged = files
    jobs = {m: Job(spec(root / f"sharded-{m}", data, valid, m)) for m in MODES}
    jobs["ragged"] = Job(spec(root / "sharded-ragged", ragged, valid, "offload"))
    jobs["lora"] = Job(spec(root / "sharded-lora", data, valid, "device", lora=LORA))
    jobs["cut"] = Job(spec(root / "sharded-cut", data, valid, "zenflow"), cancel_after=4)
    return dict(zip(jobs, train_on_ranks(list(jobs.values()), timeout=500), strict=True))


@pytest.mark.parametrize("mode", list(MODES))
def test_two_sharded_ranks_equal_one_process(
    mode: str, files: tuple[Path, Path, Path, Path], sharded: dict[str, list[RankOutcome]]
) -> None:
    root, data, valid, _ = files
    two = ok(sharded[mode])
    one: TrainResult = run_training(spec(root / f"single-{mode}", data, valid, mode, gpus=1))
    assert two.steps == one.steps == STEPS and not two.cancelled
    assert two.train_loss == pytest.approx(one.train_loss, rel=1e-5)
    assert two.valid_loss == pytest.approx(one.valid_loss, rel=1e-5)
    assert_close(weights(root / f"sharded-{mode}"), weights(root / f"single-{mode}"))
    # the exported folder (written one gathered weight at a time) loads with from_pretrained and gives
    # the logits of the model one process trained
    from transformers import AutoModelForCausalLM

    ids = torch.arange(3, 19).view(2, 8)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(root / f"sharded-{mode}" / FINAL_DIR))(
            input_ids=ids
        ).logits
        want = AutoModelForCausalLM.from_pretrained(str(root / f"single-{mode}" / FINAL_DIR))(
            input_ids=ids
        ).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    ckpt = latest_checkpoint(root / f"sharded-{mode}")
    assert ckpt is not None
    for r in range(2):  # each rank saved its own rows' engine state
        shard = load_rank_state(ckpt.path, r, 2)["engine"]["shard"]
        assert shard == {"rank": r, "world_size": 2, "row_sharded": True}


def test_ragged_last_step_equals_one_process(
    files: tuple[Path, Path, Path, Path], sharded: dict[str, list[RankOutcome]]
) -> None:
    root, _, valid, ragged = files
    two = ok(sharded["ragged"])
    one = run_training(spec(root / "single-ragged", ragged, valid, "offload", gpus=1))
    assert two.steps == one.steps
    assert_close(weights(root / "sharded-ragged"), weights(root / "single-ragged"))


def test_lora_sharded_equals_lora_in_one_process(
    files: tuple[Path, Path, Path, Path], sharded: dict[str, list[RankOutcome]]
) -> None:
    root, data, valid, _ = files
    two = ok(sharded["lora"])
    # device mode, what LoRA's auto picks (zenflow on the r=4 adapters differs from one process by ~3e-5
    # relative, replicated or sharded alike: its top-1 of 4 columns amplifies rounding)
    one = run_training(spec(root / "single-lora", data, valid, "device", gpus=1, lora=LORA))
    assert two.train_loss == pytest.approx(one.train_loss, rel=1e-5)
    assert_close(weights(root / "sharded-lora"), weights(root / "single-lora"))  # the merged model
    adapter = root / "sharded-lora" / FINAL_DIR / "adapter" / "adapter_model.safetensors"
    single_adapter = root / "single-lora" / FINAL_DIR / "adapter" / "adapter_model.safetensors"
    a, b = load_file(str(adapter)), load_file(str(single_adapter))
    assert a.keys() == b.keys() and a
    assert_close(a, b)


def test_sharded_resume_on_as_many_ranks_is_exact_and_on_one_close(
    files: tuple[Path, Path, Path, Path], sharded: dict[str, list[RankOutcome]]
) -> None:
    root, data, valid, _ = files
    cut = ok(sharded["cut"])
    assert cut.cancelled and cut.last_checkpoint is not None
    shutil.copytree(root / "sharded-cut", root / "sharded-cut-to-1")
    # each rank's engine state is its own rows: one process re-cuts them (offload.row_recut)
    one = run_training(spec(root / "sharded-cut-to-1", data, valid, "zenflow", gpus=1))
    assert one.steps == STEPS and not one.cancelled
    assert_close(weights(root / "sharded-cut-to-1"), weights(root / "sharded-zenflow"))
    (again,) = train_on_ranks([Job(spec(root / "sharded-cut", data, valid, "zenflow"))], timeout=400)
    res = ok(again)
    assert res.steps == STEPS and not res.cancelled
    a, b = weights(root / "sharded-cut"), weights(root / "sharded-zenflow")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [
        k for k in a if not torch.equal(a[k], b[k])
    ]


def test_shard_params_resolution(tmp_path: Path) -> None:
    """The run takes ``auto`` from the plan's choice: an 8B in device mode on 4 H100s does not fit
    replicated (sharded); on 2 H200s with the mode left to the plan, its fastest fit (zenflow) keeps the
    weights whole (not sharded)."""
    from tests.trainer.plan.test_plan import LLAMA3_8B, _model_dir, _spec
    from trainer.plan.gpus import Machine
    from trainer.resolve import Counts, plan_spec, resolve

    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    hp = {"batch_size": 16, "max_seq_length": 2048}
    big = plan_spec(
        _spec(d, hyperparameters=hp, resources={"gpus": 4}, engine={"mode": "device"}),
        Machine.for_gpu("h100"),
    )
    fits = plan_spec(_spec(d, hyperparameters=hp, resources={"gpus": 2}), Machine.for_gpu("h200"))
    assert big.settings.shard_params is True and fits.settings.shard_params is False

    def shard(setting: object, gpus: int, machine: Machine | None, mode: str = "device") -> bool:
        spec = _spec(
            d,
            hyperparameters=hp,
            resources={"gpus": gpus},
            engine={"mode": mode, "shard_params": setting},
        )
        return resolve(spec, machine, Counts(1000), at="create", reason="t")[0].job.engine.shard_params

    assert shard("auto", 4, Machine.for_gpu("h100")) is True
    assert shard("auto", 2, Machine.for_gpu("h200"), mode="auto") is False
    assert shard("auto", 2, Machine.for_gpu("h200")) is True  # device mode replicated: 16 B/param, no room
    assert shard("auto", 8, None) is False  # no plan: replicated
    assert shard(True, 1, Machine.for_gpu("h100")) is False  # one rank: nothing to shard with
    assert shard(True, 2, Machine.for_gpu("h200")) is True
    assert shard(False, 4, Machine.for_gpu("h100")) is False


def test_shard_params_auto_is_a_job_setting_not_an_engine_one() -> None:
    from trainer.resolve import Counts, engine_knobs, resolve

    spec = JobSpec.model_validate(
        {"model": "tiny-llama", "training_file": "x.jsonl", "engine": {"shard_params": "auto"}}
    )
    assert resolve(spec, None, Counts(10), at="run", reason="t")[0].job.engine.shard_params is False
    # an explicit "auto" does not make the model's own engine defaults look like conflicts
    plain = JobSpec.model_validate({"model": "tiny-llama", "training_file": "x.jsonl"})
    assert engine_knobs(spec)[0] == engine_knobs(plain)[0]
