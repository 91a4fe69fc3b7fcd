"""Admission (worker.capacity.fit.admit) of a job on several GPUs against a multi-GPU box's workers: each
rank planned on one GPU's share of the host, its weights sharded when replicas do not fit; the job is
resolved for the worker it fits."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.plan.test_plan import LLAMA3_8B, _model_dir, _spec
from trainer.plan.gpus import GiB
from trainer.resolve import Counts
from worker.capacity.fit import Admitted, Refusal, admit
from worker.capacity.measure import WorkerCapacity

H100_BOX = WorkerCapacity(
    device_type="cuda",
    gpu_name="NVIDIA H100 80GB HBM3",
    gpu_memory_bytes=80 * GiB,
    gpus_on_host=8,
    host_memory_bytes=2048 * GiB,
    cores=128,
    cpu_adam_gbps=160.0,
    pcie_gbps=52.0,
)


@pytest.mark.slow
def test_a_4_gpu_job_is_admitted_sharded_and_refused_replicated(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, "llama-3-8b", LLAMA3_8B)
    hp = {"batch_size": 16, "max_seq_length": 2048}
    workers = [("worker gpu0-3@box", H100_BOX)]
    # device AdamW's 16 B a parameter (120 GiB for 8B) does not fit one H100; a quarter of it does
    sharded = _spec(d, hyperparameters=hp, resources={"gpus": 4}, engine={"mode": "device"})
    admitted = admit(sharded, workers, Counts(1000), reason="created")
    assert isinstance(admitted, Admitted) and admitted.worker == "worker gpu0-3@box"
    assert admitted.resolution.job.engine.shard_params is True
    assert admitted.resolution.job.sources["engine.shard_params"] == "plan"
    replicated = _spec(
        d, hyperparameters=hp, resources={"gpus": 4}, engine={"mode": "device", "shard_params": False}
    )
    refused = admit(replicated, workers, Counts(1000), reason="created")
    assert isinstance(refused, Refusal) and refused.loc == ("hyperparameters", "lora")
    assert refused.message.startswith("The job does not fit worker gpu0-3@box (NVIDIA H100 80GB HBM3")
    assert "its share of a host with 8 GPUs" in refused.message
    assert "set engine.shard_params auto (planned: fits" in refused.message
