"""The plan counts what writing a checkpoint adds to the host: about the largest tensor (streamed),
the whole model's weights for a LoRA export; `zenflow plan` shows it in its host lines."""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaConfig

from contract.lora import LoraSpec
from trainer.plan.candidates import checkpoint_bytes
from trainer.plan.cli import format_plan
from trainer.plan.gpus import GiB, Machine
from trainer.plan.shapes import model_shape
from trainer.resolve import plan_spec
from trainer.spec import JobSpec

from .test_plan import LLAMA3_8B


def test_checkpoint_peak_is_the_largest_tensor_and_is_in_the_host_total(tmp_path: Path) -> None:
    LlamaConfig(**LLAMA3_8B).save_pretrained(tmp_path)
    spec = JobSpec(model=str(tmp_path), training_file="train.jsonl", hyperparameters={"max_seq_length": 1024})  # type: ignore[arg-type]
    plan = plan_spec(spec, Machine.for_gpu("h200", host_memory_bytes=512 * GiB), num_examples=1000)
    embed = LLAMA3_8B["vocab_size"] * LLAMA3_8B["hidden_size"] * 4  # type: ignore[operator]
    # the embedding in fp32 (2 GB); not the 16 B/param state, nor zenflow's device optimizer state
    # (streamed too, offload.zenflow.selective_adamw.state_dict(copy=False))
    assert plan.host["checkpoint"] == embed
    assert plan.host["checkpoint"] < 0.1 * (
        plan.host["engine_state"] + plan.host.get("engine_accumulators", 0)
    )
    assert plan.host_bytes == sum(plan.host.values())
    assert any(line.split()[:1] == ["checkpoint"] for line in format_plan(plan).splitlines())


def test_lora_checkpoint_counts_a_copy_of_the_weights(tmp_path: Path) -> None:
    LlamaConfig(**LLAMA3_8B).save_pretrained(tmp_path)
    full = model_shape(str(tmp_path), None)
    lora = model_shape(str(tmp_path), LoraSpec(r=8))
    assert checkpoint_bytes(full, 2) == LLAMA3_8B["vocab_size"] * LLAMA3_8B["hidden_size"] * 4  # type: ignore[operator]
    assert checkpoint_bytes(lora, 2) >= lora.params * 2
