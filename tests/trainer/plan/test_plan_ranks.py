"""The plan of a job on N ranks (``resources.gpus``) is one rank's: 1/N of the CPU optimizer state,
1/N of each step's examples, a full replica on its device; CPU ranks share one host."""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaConfig

from tests.trainer.plan.test_plan import LLAMA3_8B
from trainer.plan.candidates import rank_machine
from trainer.plan.gpus import GiB, Machine
from trainer.resolve import plan_spec
from trainer.spec import JobSpec


def _spec(model: str | Path, gpus: int = 1, **kw: object) -> JobSpec:
    return JobSpec(model=str(model), training_file="train.jsonl", resources={"gpus": gpus}, **kw)  # type: ignore[arg-type]


def test_ranks_shard_the_host_state_and_split_the_batch(tmp_path: Path) -> None:
    d = tmp_path / "llama-3-8b"
    LlamaConfig(**LLAMA3_8B).save_pretrained(d)  # config.json only
    h100 = Machine.for_gpu("h100", host_memory_bytes=64 * GiB)  # one GPU's share of its host
    hp = {"batch_size": 8, "max_seq_length": 2048}
    one = plan_spec(_spec(d, hyperparameters=hp, engine={"mode": "zenflow"}), h100, num_examples=1000)
    four = plan_spec(_spec(d, 4, hyperparameters=hp, engine={"mode": "zenflow"}), h100, num_examples=1000)
    assert not one.fits and one.problems[0].loc == ("resources", "gpus")  # 96 GB of state alone
    assert "set resources.gpus 4 (planned: fits" in one.problems[0].message
    assert four.fits and four.problems == []
    assert four.host["engine_state"] == -(-one.host["engine_state"] // 4)
    assert four.host["engine_accumulators"] == -(-one.host["engine_accumulators"] // 4)
    assert four.host["process"] == one.host["process"] and four.host["data"] == one.host["data"]
    assert four.device["weights"] == one.device["weights"]  # every rank holds the whole model
    assert four.batch_size == 8 and four.settings.micro_batch_size <= 2  # 2 examples per rank and step
    assert any(r.startswith("resources.gpus 4: per rank 2 of the 8 examples") for r in four.reasons)


def test_cpu_ranks_share_the_host() -> None:
    cpu = Machine.for_cpu(host_memory_bytes=16 * GiB, cores=8)
    half = rank_machine(cpu, 2)
    assert (half.host_memory_bytes, half.cores) == (8 * GiB, 4)
    assert half.cpu_adam_gbps == cpu.cpu_adam_gbps / 2 and half.gpu_flops == cpu.gpu_flops / 2
    gpu = Machine.for_gpu("h100", host_memory_bytes=64 * GiB)
    assert rank_machine(gpu, 4) == gpu and rank_machine(cpu, 1) == cpu
    plan = plan_spec(_spec("tiny-llama", 2, hyperparameters={"batch_size": 4}), cpu, num_examples=64)
    assert plan.fits and plan.host_capacity_bytes == 6 * GiB and plan.host_reserve_bytes == 2 * GiB
