"""Sharded weights in the plan (issue 23): one rank's row shards of the weights, gradients and optimizer
state, FSDP's gather and reduce-scatter buffers and traffic, ``engine.shard_params: auto`` chosen by the
plan, ``zenflow plan --gpus``, and the fixes offered in the order of what the user loses least."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from pydantic import ValidationError

from contract.engine import EngineRequest
from tests.trainer.plan.test_plan import LLAMA3_8B, _model_dir, _spec
from trainer.plan.gpus import KNOWN_GPUS, GiB, Machine
from trainer.plan.planner import plan_job
from trainer.plan.shapes import model_shape
from trainer.plan.shards import blocks, row_shard, traffic_bytes
from trainer.resolve import plan_query, plan_spec

#: The issue's must-show: Llama-3-70B's shape as a config.json beside this spec (no weights).
EXAMPLE_70B = Path(__file__).resolve().parents[3] / "docs" / "examples" / "llama-3-70b-full.yaml"
HP = {"batch_size": 16, "max_seq_length": 2048}


def test_a_rank_holds_row_shards_and_two_gathered_blocks(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    h200 = Machine.for_gpu("h200")
    engine = {"mode": "zenflow", "shard_params": False}
    whole = plan_spec(_spec(d, hyperparameters=HP, resources={"gpus": 4}, engine=engine), h200)
    cut = plan_spec(
        _spec(d, hyperparameters=HP, resources={"gpus": 4}, engine={**engine, "shard_params": True}), h200
    )
    shape = model_shape(str(d))
    assert not whole.settings.shard_params and cut.settings.shard_params
    # dim 0 rounded up to the ranks, per weight: the vocab's 128256 rows are 32064 a rank
    padded = sum(row_shard(w, 4).numel for w in shape.weights)
    assert padded >= shape.params // 4 and row_shard(shape.weights[0], 4).shape == (32064, 4096)
    assert cut.device["weights"] == 2 * padded and cut.device["gradients"] == 2 * padded
    assert whole.device["weights"] == 2 * shape.params and "gather_buffers" not in whole.device
    # the two largest blocks unsharded (the root: embeddings and LM head; then a decoder layer)
    sizes = sorted(blocks(shape.weights).values(), reverse=True)
    assert len(sizes) == 33 and cut.device["gather_buffers"] == 2 * (sizes[0] + sizes[1])
    assert cut.device["reduce_scatter_buffer"] == 2 * sizes[0]
    # the device optimizer state (zenflow's selected columns) is a quarter, give or take the column indices
    assert cut.device["optimizer_state"] == pytest.approx(whole.device["optimizer_state"] / 4, rel=0.02)
    # the CPU state was a quarter already; sharded it is the rows' quarter (the same up to padding)
    assert cut.host["engine_state"] == pytest.approx(whole.host["engine_state"], rel=0.01)
    assert cut.host_bytes_all_ranks == 4 * cut.host_bytes and cut.ranks == 4
    # the traffic: two all-gathers of the weights and a reduce-scatter of the gradients per micro-batch
    z = cut.modes["zenflow"]
    micro = -(-(HP["batch_size"] // 4) // z.settings.micro_batch_size)
    sent = traffic_bytes(shape, 2, 4, micro)
    assert sent == pytest.approx(micro * 0.75 * 3 * 2 * 4 * padded)  # 3 passes of the padded model, bf16
    assert z.interconnect_seconds == pytest.approx(sent / (KNOWN_GPUS["h200"].interconnect_gbps * 1e9))
    assert whole.modes["zenflow"].interconnect_seconds == 0.0
    assert cut.device_bytes < whole.device_bytes


def test_sharded_landing_buffers_are_the_plans_choice(tmp_path: Path) -> None:
    """Replicated ranks need zenflow's landing buffers (views of the gathered replica); a sharded rank's are
    a copy of its own rows the plan may leave out, so it counts them only when it keeps them."""
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    h200 = Machine.for_gpu("h200")
    engine = {"mode": "zenflow", "shard_params": True}
    query = plan_query(_spec(d, hyperparameters=HP, resources={"gpus": 4}, engine=engine))
    kept, left = plan_job(query, h200), plan_job(query._replace(landing_buffers=False), h200)
    # the rank's rows of the split (2-D) weights, bf16: all but the norms
    assert kept.settings.landing_buffers and kept.device["landing_buffers"] == pytest.approx(
        kept.device["weights"], rel=1e-3
    )
    assert "landing_buffers" not in left.device or left.device["landing_buffers"] == 0
    assert left.device_bytes == kept.device_bytes - kept.device["landing_buffers"]
    replicated = plan_job(query._replace(shard_params=False, landing_buffers=False), h200)
    # kept whatever is asked: the gathered replica of the split weights
    assert replicated.device["landing_buffers"] == pytest.approx(replicated.device["weights"], rel=1e-3)


def test_shard_params_auto_keeps_replicas_that_fit(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    h200 = Machine.for_gpu("h200")
    plan = plan_spec(_spec(d, hyperparameters=HP, resources={"gpus": 2}), h200)
    assert plan.fits and not plan.settings.shard_params and not plan.fits_only_sharded
    assert any(
        r.startswith("engine.shard_params auto -> false: replicated weights fit") for r in plan.reasons
    )
    one = plan_spec(_spec(d, hyperparameters=HP), h200)  # one rank: nothing to shard across
    assert not one.settings.shard_params and not any("shard_params" in r for r in one.reasons)


def test_shard_params_auto_shards_what_does_not_fit_replicated(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    h100 = Machine.for_gpu("h100")
    device = {"mode": "device"}  # 16 B of device optimizer state per parameter: 120 GiB of an 8B
    auto = plan_spec(_spec(d, hyperparameters=HP, resources={"gpus": 4}, engine=device), h100)
    assert auto.fits and auto.settings.shard_params and auto.fits_only_sharded
    assert any(
        r.startswith("engine.shard_params auto -> true: replicated weights do not fit") for r in auto.reasons
    )
    # told not to shard: the fixes are planned, sharding among them (after LoRA, in the order of what it costs)
    off = plan_spec(
        _spec(d, hyperparameters=HP, resources={"gpus": 4}, engine={**device, "shard_params": False}), h100
    )
    assert not off.fits and not off.settings.shard_params
    message = off.problems[0].message
    assert off.problems[0].loc == ("hyperparameters", "lora")
    assert "set engine.shard_params auto (planned: fits" in message
    assert message.index("use LoRA") < message.index("set engine.shard_params auto")


def test_shard_params_is_a_job_setting() -> None:
    assert EngineRequest().shard_params == "auto"
    assert EngineRequest(shard_params=True).shard_params is True
    with pytest.raises(ValidationError) as e:
        EngineRequest(shard_params="maybe")  # type: ignore[arg-type]
    assert "shard_params" in str(e.value)


def _cli(*argv: str) -> tuple[int, str]:
    from api.cli.main import main

    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["plan", *argv])
    return rc, out.getvalue()


def test_cli_gpus_share_the_given_host(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: {d}\ntraining_file: train.jsonl\nhyperparameters: {{max_seq_length: 2048}}\n")
    rc, out = _cli(
        str(spec), "--gpu", "h200", "--gpus", "4", "--host-memory", "1TiB", "--cores", "64", "--json"
    )
    doc = json.loads(out)
    assert rc == 0 and doc["ranks"] == 4 and doc["machine"]["host_memory_bytes"] == 256 * GiB
    assert doc["machine"]["cores"] == 16 and doc["machine"]["sources"]["host_memory"].startswith(
        "given (the box's"
    )
    assert doc["host_bytes_all_ranks"] == 4 * doc["host_bytes"]
    assert _cli(str(spec), "--gpu", "h200", "--gpus", "0")[0] == 2  # resources.gpus' bounds


@pytest.mark.slow
def test_llama3_70b_full_fine_tune_fits_8_h200_only_sharded() -> None:
    """The issue's must-show, and the advice for the same job on one GPU of the box: more of them, sharded."""
    rc, out = _cli(str(EXAMPLE_70B), "--gpu", "h200", "--gpus", "8", "--host-memory", "2TiB", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["fits"] and doc["settings"]["shard_params"] and doc["fits_only_sharded"]
    assert doc["params"] == 70_553_706_496 and doc["ranks"] == 8
    assert doc["device_bytes"] <= doc["device_capacity_bytes"] <= 0.9 * KNOWN_GPUS["h200"].memory_bytes
    assert doc["host_bytes"] <= doc["host_capacity_bytes"] and doc["host_bytes_all_ranks"] <= 2 * 1024 * GiB
    assert doc["device"]["gather_buffers"] > 0 and doc["device"]["weights"] < 18 * GiB  # 131.4 GiB / 8
    assert all(doc["modes"][m]["step_seconds"] > 0 for m in ("device", "offload", "zenflow"))
    assert doc["modes"]["zenflow"]["interconnect_seconds"] > 0
    # on one GPU of a typical H200 box (a GPU is planned with its share of the host, 256 GiB; more GPUs
    # bring theirs): the least that fits is 4 of them, sharded, in offload mode
    rc, out = _cli(str(EXAMPLE_70B), "--gpu", "h200", "--gpus", "1", "--json")
    one = json.loads(out)
    assert rc == 3 and not one["fits"] and one["problems"][0]["loc"] == ["resources", "gpus"]
    assert "set resources.gpus 4 (planned: fits in offload mode" in one["problems"][0]["message"]


@pytest.mark.slow
def test_llama3_70b_lora_on_8_h100_counts_the_export_copy_once(tmp_path: Path) -> None:
    """Issue 39's must-show: rank 0 alone merges the LoRA export into a CPU copy of the weights, so the
    box's host holds it once, not once a rank (it was 135.7 GiB a rank, 1.1 TiB in all: more than a
    1 TiB box, which refused the job)."""
    spec = tmp_path / "lora.yaml"
    spec.write_text(
        f"model: {EXAMPLE_70B.with_name('llama-3-70b')}\ntraining_file: train.jsonl\n"
        "hyperparameters: {batch_size: 16, max_seq_length: 4096, lora: {r: 16}}\nresources: {gpus: 8}\n"
    )
    rc, out = _cli(str(spec), "--gpu", "h100", "--gpus", "8", "--host-memory", "1TiB", "--json")
    doc = json.loads(out)
    copy = doc["params"] * 2  # bf16 weights, merged
    assert doc["host"]["checkpoint"] < copy / 8 + 4 * GiB, doc["host"]
    assert doc["host_bytes_all_ranks"] < copy + 8 * 40 * GiB  # one copy on the box, not eight
    assert rc == 0 and doc["fits"], doc["problems"]
