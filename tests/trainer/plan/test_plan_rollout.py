"""A reinforcement job's rollout in the plan (trainer.plan.rollout): its sampling time in every mode's
step and its KV cache, growing with the completions it samples; none for a supervised job."""

from __future__ import annotations

from pathlib import Path

from tests.trainer.plan.test_plan import LLAMA3_8B, LLAMA_100M, _model_dir
from trainer.plan.gpus import Machine
from trainer.plan.rollout import RolloutQuery, generation_seconds, kv_cache_bytes
from trainer.plan.shapes import model_shape
from trainer.resolve import plan_query, plan_spec
from trainer.spec import JobSpec

GRADER = {
    "type": "string_check",
    "name": "g",
    "input": "{{sample.output_text}}",
    "reference": "x",
    "operation": "eq",
}


def _rl(model: str | Path, **method: object) -> JobSpec:
    return JobSpec(
        model=str(model),
        training_file="train.jsonl",  # type: ignore[arg-type]
        method={"type": "reinforcement", "grader": GRADER, **method},  # type: ignore[arg-type]
        hyperparameters={"batch_size": 8, "max_seq_length": 2048},  # type: ignore[arg-type]
    )


def test_kv_cache_of_llama3_8b(tmp_path: Path) -> None:
    shape = model_shape(str(_model_dir(tmp_path, "l8b", LLAMA3_8B)), lora=None)
    # 32 layers x 8 KV heads x 128 dims x K and V x 2 bytes: 128 KiB per token
    assert kv_cache_bytes(shape, rows=1, tokens=1, dtype_bytes=2) == 131072
    assert kv_cache_bytes(shape, rows=64, tokens=2048, dtype_bytes=2) == 64 * 2048 * 131072


def test_decoding_is_bandwidth_bound_at_small_batches(tmp_path: Path) -> None:
    shape = model_shape(str(_model_dir(tmp_path, "l8b", LLAMA3_8B)), lora=None)
    h100 = Machine.for_gpu("h100")
    one = generation_seconds(shape, h100, rows=1, prompt_tokens=1, completion_tokens=100, dtype_bytes=2)
    # 100 steps, each at least the bf16 weights read once at the GPU's memory bandwidth
    assert one >= 100 * shape.params * 2 / (h100.gpu_memory_gbps * 1e9)
    eight = generation_seconds(shape, h100, rows=8, prompt_tokens=1, completion_tokens=100, dtype_bytes=2)
    assert eight < 2 * one  # eight rows share each step's weight read


def test_the_plan_counts_the_rollout(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, "l8b", LLAMA3_8B)
    h200 = Machine.for_gpu("h200")
    q = plan_query(_rl(d, max_completion_tokens=512))
    assert q.rollout == RolloutQuery(samples_per_prompt=8, completion_tokens=512)
    small = plan_spec(_rl(d, max_completion_tokens=512), h200, num_examples=1000)
    more = plan_spec(_rl(d, max_completion_tokens=512, compute_multiplier=2), h200, num_examples=1000)
    sft = plan_spec(
        JobSpec(
            model=str(d), training_file="t.jsonl", hyperparameters={"batch_size": 8, "max_seq_length": 2048}
        ),
        h200,
        num_examples=1000,
    )  # type: ignore[arg-type]
    assert sft.generation_seconds == 0 and "rollout_kv_cache" not in sft.device
    assert small.generation_seconds > 0 and more.generation_seconds > small.generation_seconds
    for plan in (small, more):
        for estimate in plan.modes.values():
            assert estimate.generation_seconds == plan.generation_seconds
            assert estimate.step_seconds > estimate.generation_seconds
    # 8 prompts x 8 (16) completions x 2048 tokens of bf16 cache: 16 (32) GiB, under the activations' peak
    shape = model_shape(str(d), lora=None)
    assert small.rollout_cache_bytes >= kv_cache_bytes(shape, rows=64, tokens=2048, dtype_bytes=2)
    assert more.rollout_cache_bytes > small.rollout_cache_bytes
    assert "sampling ~" in more.summary()


def test_a_rollout_cache_over_the_activations_peak_adds_to_the_device(tmp_path: Path) -> None:
    """32 prompts x 8 completions are sampled at once, but trained one prompt's rows at a time with
    checkpointing: the cache's excess over the activations' peak is on the device."""
    d = _model_dir(tmp_path, "l100m", LLAMA_100M)
    spec = JobSpec(
        model=str(d),
        training_file="train.jsonl",  # type: ignore[arg-type]
        method={"type": "reinforcement", "grader": GRADER, "max_completion_tokens": 512},  # type: ignore[arg-type]
        hyperparameters={  # type: ignore[arg-type]
            "batch_size": 32,
            "max_seq_length": 1024,
            "micro_batch_size": 1,
            "gradient_checkpointing": True,
        },
    )
    plan = plan_spec(spec, Machine.for_gpu("h100"), num_examples=1000)
    assert plan.device["rollout_kv_cache"] > 0
    assert plan.device["rollout_kv_cache"] + plan.device["activations"] == plan.rollout_cache_bytes
