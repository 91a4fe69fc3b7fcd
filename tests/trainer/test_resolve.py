"""trainer.resolve: a job's request decided once, every value concrete with its source; decided again
only when the run's machine, data or checkpoint say so."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from contract.engine import EngineKnobs
from trainer.model.catalog import TINY_LLAMA_ZENFLOW
from trainer.plan.gpus import GiB, Machine
from trainer.resolve import Counts, Pins, for_run, reason_to_decide_again, resolve, resolve_hyperparameters
from trainer.spec import JobSpec

CPU = Machine.for_cpu(host_memory_bytes=16 * GiB, cores=4)
H100 = Machine.for_gpu("h100", host_memory_bytes=64 * GiB)


def _spec(**fields: Any) -> JobSpec:
    return JobSpec(model="tiny-llama", training_file="t.jsonl", **fields)


def test_hyperparameters_auto_rules() -> None:
    r, sources = resolve_hyperparameters(_spec(), 64)  # tiny-llama: base lr 3e-3, positions 1024
    assert (r.n_epochs, r.batch_size, r.steps_per_epoch, r.total_steps) == (3, 4, 16, 48)
    assert r.learning_rate == 3e-3 and r.warmup_steps == 2 and r.max_seq_length == 1024
    assert r.eval_every is None and r.checkpoint_every == 10
    assert (
        sources["hyperparameters.n_epochs"] == "data" and sources["hyperparameters.learning_rate"] == "model"
    )
    assert sources["hyperparameters.max_seq_length"] == "model"
    small = resolve_hyperparameters(_spec(validation_file="v.jsonl"), 10)[0]
    assert small.n_epochs == 10 and small.eval_every is not None
    big = resolve_hyperparameters(JobSpec(model="small-llama", training_file="t.jsonl"), 20_000)[0]
    assert big.n_epochs == 1 and big.batch_size == 32 and big.max_seq_length == 2048


def test_explicit_hyperparameters_and_schedule() -> None:
    hp = {
        "n_epochs": 2,
        "batch_size": 100,
        "learning_rate": 1e-3,
        "learning_rate_multiplier": 2.0,
        "warmup": 4,
        "max_steps": 10,
        "eval_every": 0,
        "checkpoint_every": 3,
        "lr_scheduler": "linear",
        "min_lr_ratio": 0.0,
    }
    r, sources = resolve_hyperparameters(_spec(hyperparameters=hp), 30)
    assert r.batch_size == 30 and r.total_steps == 2 and r.learning_rate == pytest.approx(2e-3)
    assert r.eval_every is None and r.warmup_steps == 2
    assert {sources[f"hyperparameters.{k}"] for k in ("n_epochs", "batch_size", "warmup_steps")} == {
        "request"
    }
    hp = {"warmup": 0.5, "n_epochs": 3, "learning_rate": 1.0, "min_lr_ratio": 0.0, "batch_size": 1}
    r = resolve_hyperparameters(_spec(hyperparameters=hp), 8)[0]
    lrs = [r.lr_at(s) for s in range(r.total_steps)]
    assert r.warmup_steps == 12 and lrs[0] == pytest.approx(1 / 12) and lrs[11] == pytest.approx(1.0)
    assert lrs[-1] < 0.05 and all(a >= b for a, b in itertools.pairwise(lrs[11:]))
    with pytest.raises(ValueError, match="more than a job can run"):
        resolve_hyperparameters(_spec(hyperparameters={"n_epochs": 2**30, "batch_size": 1}), 8)


def test_model_engine_defaults_fill_only_the_gaps(tmp_path: Path) -> None:
    plain = EngineKnobs()
    job = resolve(_spec(), CPU, Counts(40), at="create", reason="t")[0].job
    assert {k: getattr(job.engine, k) for k in TINY_LLAMA_ZENFLOW} == TINY_LLAMA_ZENFLOW
    assert job.sources["engine.topk_ratio"] == "model" and job.sources["engine.eps"] == "default"
    given = resolve(_spec(engine={"topk_ratio": 0.5}), CPU, Counts(40), at="create", reason="t")[0].job
    assert given.engine.topk_ratio == 0.5 and given.sources["engine.topk_ratio"] == "request"
    assert given.engine.update_interval == 1 and given.engine.full_warm_up_rounds == 16
    # update_interval 4 does not fit the default select_interval 1: that default is left out, not refused
    window = resolve(_spec(engine={"update_interval": 4}), CPU, Counts(40), at="create", reason="t")[0].job
    assert window.engine.update_interval == 4 and window.engine.select_interval == plain.select_interval
    assert window.engine.topk_ratio == 0.25 and window.sources["engine.select_interval"] == "default"
    # a local checkpoint and small-llama (no measured settings) get the contract's defaults
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    small = resolve(JobSpec(model="small-llama", training_file="t"), CPU, Counts(40), at="create", reason="t")
    assert small[0].job.engine.topk_ratio == plain.topk_ratio


def test_every_value_concrete_with_its_source() -> None:
    resolution, plan = resolve(
        _spec(engine={"mode": "auto"}), H100, Counts(40), at="create", reason="created"
    )
    job = resolution.job
    assert plan is not None and plan.fits and job.engine.mode == plan.settings.mode
    assert job.sources["engine.mode"] == "plan" and job.sources["hyperparameters.micro_batch_size"] == "plan"
    flat = job.flat()
    assert "auto" not in flat.values()
    engine_paths = {k for k in flat if k.startswith("engine.")}
    assert engine_paths <= set(job.sources) and engine_paths == {
        f"engine.{k}" for k in type(job.engine).model_fields
    }
    assert resolution.machine == H100.model_dump(mode="json") and job.dtype == "bfloat16"
    explicit = resolve(_spec(engine={"mode": "offload"}), H100, Counts(40), at="create", reason="t")[0].job
    assert explicit.engine.mode == "offload" and explicit.sources["engine.mode"] == "request"


def test_without_a_plan_the_choices_take_their_defaults() -> None:
    job = resolve(_spec(), None, Counts(40), at="run", reason="t")[0].job
    assert (job.engine.mode, job.engine.accumulate_on, job.engine.shard_params) == ("zenflow", "host", False)
    assert job.sources["engine.mode"] == "default" and job.hyperparameters.micro_batch_size == 4


def test_method_one_rank_and_dpo() -> None:
    job = resolve(_spec(method={"type": "dpo"}), CPU, Counts(40), at="create", reason="t")[0].job
    assert job.method.type == "dpo" and job.method.beta == 0.1 and job.sources["method.beta"] == "default"
    assert job.hyperparameters.packing is False
    one = resolve(_spec(engine={"shard_params": True}), CPU, Counts(40), at="create", reason="t")[0].job
    assert one.engine.shard_params is False  # one rank never shards


def test_a_run_decides_again_only_when_it_must() -> None:
    spec = _spec(engine={"mode": "auto"})
    first, _ = resolve(spec, H100, Counts(40, 4000), at="create", reason="created")
    assert reason_to_decide_again(first, H100, Counts(40), None) is None
    assert for_run(spec, first, H100, Counts(40), None) == (first, None, False)
    assert "planned for h100" in (reason_to_decide_again(first, CPU, None, None) or "")
    assert "counts 39 examples" in (reason_to_decide_again(first, H100, Counts(39), None) or "")
    other = "offload" if first.job.engine.mode != "offload" else "device"
    pins = Pins(other)  # type: ignore[arg-type]
    assert f"ran in {other} mode" in (reason_to_decide_again(first, H100, None, pins) or "")
    again, _, new = for_run(spec, first, H100, Counts(40), pins)
    assert new and again.at == "run" and again.job.engine.mode == other
    assert (
        again.job.sources["engine.mode"] == "resume"
        and again.job.changes(first.job)["engine.mode"]["to"] == other
    )


_KEYWORD_GRADER = {
    "type": "string_check",
    "name": "k",
    "input": "{{sample.output_text}}",
    "reference": "{{item.keyword}}",
    "operation": "ilike",
}


def _rl(lora: bool = False, max_seq_length: int = 1024, **method: Any) -> JobSpec:
    hp: dict[str, Any] = {"max_seq_length": max_seq_length}
    extra: dict[str, Any] = {"lora": {"r": 4}} if lora else {}
    return _spec(
        method={"type": "reinforcement", "grader": _KEYWORD_GRADER, **method}, hyperparameters=hp, **extra
    )


def test_reinforcement_auto_values_and_their_sources() -> None:
    from trainer.resolve import AUTO_RL, SAMPLES_PER_UNIT_COMPUTE, resolve_method

    m, sources = resolve_method(_rl())
    assert m.type == "reinforcement" and m.samples_per_prompt == SAMPLES_PER_UNIT_COMPUTE == 8
    assert (m.compute_multiplier, m.eval_samples, m.max_completion_tokens) == (1.0, 4, 256)
    assert (m.temperature, m.kl_beta, m.clip_epsilon) == (1.0, 0.0, 0.2)
    assert {f"method.{k}" for k in AUTO_RL} | {"method.samples_per_prompt"} == set(sources)
    assert set(sources.values()) == {"default"}
    m, sources = resolve_method(_rl(compute_multiplier=2.5, eval_samples=2, temperature=0.7))
    assert (m.samples_per_prompt, m.eval_samples, m.temperature) == (20, 2, 0.7)
    assert sources["method.samples_per_prompt"] == sources["method.compute_multiplier"] == "request"
    assert sources["method.max_completion_tokens"] == "default"
    job = resolve(_rl(compute_multiplier=0.5), CPU, Counts(40), at="create", reason="t")[0].job
    assert job.method.type == "reinforcement" and job.method.samples_per_prompt == 4
    assert job.sources["method.samples_per_prompt"] == "request"


@pytest.mark.parametrize(("multiplier", "n"), [(0.01, 2), (0.2, 2), (0.4, 3), (1, 8), (7.9, 63), (8, 64)])
def test_reinforcement_samples_per_prompt_are_clamped_to_2_to_64(multiplier: float, n: int) -> None:
    from trainer.resolve import resolve_method

    m, _ = resolve_method(_rl(compute_multiplier=multiplier))
    assert m.type == "reinforcement" and m.samples_per_prompt == n


def test_reinforcement_completion_tokens_are_capped_at_half_the_sequence() -> None:
    from trainer.resolve import resolve_method

    for given, seq, want in [
        ("auto", 128, 64),
        ("auto", 1024, 256),
        (100, 128, 64),
        (24, 128, 24),
        (3, 5, 2),
    ]:
        m, sources = resolve_method(_rl(max_seq_length=seq, max_completion_tokens=given))
        assert m.type == "reinforcement" and m.max_completion_tokens == want, (given, seq)
        assert sources["method.max_completion_tokens"] == ("default" if given == "auto" else "request")


def test_reinforcement_kl_needs_lora() -> None:
    from trainer.resolve import resolve_method

    with pytest.raises(ValueError, match=r"^method\.kl_beta: .*LoRA"):
        resolve_method(_rl(kl_beta=0.05))
    m, sources = resolve_method(_rl(lora=True, kl_beta=0.05))
    assert m.type == "reinforcement" and m.kl_beta == 0.05 and sources["method.kl_beta"] == "request"
    assert resolve_method(_rl(kl_beta=0))[0].type == "reinforcement"  # 0 is KL-free: no LoRA needed
