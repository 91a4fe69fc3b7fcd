"""Issue 26 part 1, the job library's side of DPO: the preference format (line and field errors, the
method's data kind, masks on the outputs only), the loss (log 2 while the policy is the reference),
both references (LoRA's disabled adapter: one model in memory; full fine-tuning's table, computed before
training and read back on resume), and 2 gloo ranks equal to one process."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.run.test_loop import Recorder
from trainer.data.dataset import DataOptions, DatasetValidationError, validate_file
from trainer.data.example import IGNORE_INDEX, PreferencePair
from trainer.data.preference import check_preference_record
from trainer.events import EvalEvent, LogEvent, RunStarted, StepEvent
from trainer.method.dpo import REFERENCE_FILE, DpoObjective
from trainer.resolve import Counts, resolve
from trainer.run.loop import run_training
from trainer.spec import JobSpec

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def pair(i: int, chosen: str = "yes indeed", rejected: str = "no way") -> dict[str, Any]:
    return {
        "input": {"messages": [{"role": "user", "content": f"Question {i}: agree?"}]},
        "preferred_output": [{"role": "assistant", "content": chosen}],
        "non_preferred_output": [{"role": "assistant", "content": rejected}],
    }


def write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def dpo_spec(out: Path, data: Path, valid: Path | None = None, **hp: Any) -> JobSpec:
    engine = hp.pop("engine", None) or {"mode": "device"}
    resources = hp.pop("resources", None) or {}
    return JobSpec.model_validate(
        {
            "model": "tiny-llama",
            "training_file": str(data),
            "validation_file": str(valid) if valid else None,
            "method": {"type": "dpo", "beta": "auto"},
            "hyperparameters": {
                "n_epochs": 4,
                "batch_size": 8,
                "micro_batch_size": 4,
                "learning_rate": 1e-3,
                "max_seq_length": 64,
                "seed": 5,
                **hp,
            },
            "engine": engine,
            "dtype": "float32",
            "output_dir": str(out),
            "resources": resources,
        }
    )


# --- the format --------------------------------------------------------------------------------------


def test_preference_record_problems_name_the_pairs_fields() -> None:
    assert check_preference_record(pair(0)) == []
    assert check_preference_record({"preferred_output": []}) == [
        ("input", "missing (expected an object with 'messages')")
    ]
    bad = {**pair(0), "input": {"messages": [{"role": "bot", "content": "x"}]}}
    assert (
        "input.messages[0].role",
        "unknown role 'bot' (expected system, developer, user, assistant, tool)",
    ) in (check_preference_record(bad))
    bad = {**pair(0), "non_preferred_output": [{"role": "assistant", "content": 3}]}
    assert [f for f, _ in check_preference_record(bad)] == ["non_preferred_output[0].content"]
    bad = {**pair(0), "preferred_output": [{"role": "user", "content": "x"}]}
    assert [f for f, _ in check_preference_record(bad)] == ["preferred_output[0].role"]
    same = pair(0, chosen="a", rejected="a")
    assert [f for f, _ in check_preference_record(same)] == ["non_preferred_output"]


def test_file_errors_by_line_and_the_methods_data_kind(tmp_path: Path) -> None:
    path = write(tmp_path / "p.jsonl", [pair(0), '{"input": {"messages": []}}', pair(2)])
    with pytest.raises(DatasetValidationError) as e:
        validate_file(path)
    assert [(x["line"], x["field"]) for x in e.value.errors] == [
        (2, "input.messages"),
        (2, "preferred_output"),
        (2, "non_preferred_output"),
    ]
    good = write(tmp_path / "g.jsonl", [pair(0), pair(1)])
    assert validate_file(good).format == "preference"  # an upload's check takes any one format
    with pytest.raises(DatasetValidationError) as e:
        validate_file(good, options=DataOptions(method="supervised"))
    assert e.value.errors[0]["line"] == 1 and "supervised" in e.value.errors[0]["message"]
    chat = write(
        tmp_path / "c.jsonl",
        [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
    )
    with pytest.raises(DatasetValidationError) as e:
        validate_file(chat, options=DataOptions(method="dpo"))
    assert e.value.errors[0]["line"] == 1 and "DPO" in e.value.errors[0]["message"]


def test_only_the_outputs_are_learned(tmp_path: Path) -> None:
    from trainer.model.catalog import load_tokenizer

    tok = load_tokenizer("tiny-llama")
    rec = pair(0)
    rec["input"]["messages"] += [
        {"role": "assistant", "content": "context"},
        {"role": "user", "content": "so?"},
    ]
    path = write(tmp_path / "p.jsonl", [rec])
    rep = validate_file(
        path, tokenizer=tok, max_seq_length=128, options=DataOptions(method="dpo"), keep_examples=True
    )
    (ex,) = rep.examples
    assert isinstance(ex, PreferencePair)
    learned = [tok.decode([t for t in s.labels if t != IGNORE_INDEX]) for s in (ex, ex.rejected)]
    assert learned[0].startswith("yes indeed") and learned[1].startswith("no way")
    assert "context" not in "".join(learned)
    assert rep.num_tokens == len(ex.input_ids) + len(ex.rejected.input_ids)
    # cut at a length inside the outputs, both sequences are truncated together
    short = min(len(ex.input_ids), len(ex.rejected.input_ids)) - 1
    rep = validate_file(
        path, tokenizer=tok, max_seq_length=short, options=DataOptions(method="dpo"), keep_examples=True
    )
    (cut,) = rep.examples
    assert isinstance(cut, PreferencePair) and rep.num_truncated == 1
    assert max(len(cut.input_ids), len(cut.rejected.input_ids)) == short


def test_the_loss_is_log_2_when_the_policy_is_the_reference() -> None:
    obj = DpoObjective(0.1, None)
    logps = torch.tensor([-3.0, -5.0, -4.0, -2.0])  # chosen of 2 pairs, then rejected
    total, sums = obj.terms(logps, logps.clone())
    assert float(total) == pytest.approx(2 * math.log(2), abs=1e-7) and sums.tolist() == [0, 0, 0, 0]
    total, sums = obj.terms(logps + torch.tensor([1.0, 1.0, 0.0, 0.0]), logps)  # chosen up 1 nat each
    assert sums.tolist() == pytest.approx([0.2, 0.0, 0.2, 2.0])
    assert float(total) == pytest.approx(-2 * math.log(1 / (1 + math.exp(-0.1))), rel=1e-6)


def test_dpo_refuses_packing_and_resolves_beta() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        dpo_spec(Path("/tmp/x"), Path("/tmp/x"), packing=True)
    assert e.value.errors()[0]["loc"] == ("hyperparameters", "packing")
    job = resolve(dpo_spec(Path("/tmp/x"), Path("/tmp/x")), None, Counts(16), at="run", reason="t")[0].job
    assert job.method.type == "dpo" and job.method.beta == 0.1 and job.hyperparameters.packing is False


# --- runs --------------------------------------------------------------------------------------------


def _steps(rec: Recorder) -> list[StepEvent]:
    return [e for e in rec.events if isinstance(e, StepEvent)]


@pytest.mark.slow
def test_full_fine_tuning_dpo_learns_the_preference_and_reuses_its_reference(tmp_path: Path) -> None:
    data = write(tmp_path / "pairs.jsonl", [pair(i) for i in range(16)])
    out = tmp_path / "out"
    rec = Recorder()
    run_training(dpo_spec(out, data, data, engine={"mode": "zenflow"}), on_event=rec)
    steps = _steps(rec)
    assert abs(steps[0].loss - math.log(2)) < 1e-4
    assert steps[-1].preference is not None and steps[-1].preference.accuracy > 0.9
    evals = [e for e in rec.events if isinstance(e, EvalEvent)]
    assert evals[-1].preference is not None and evals[-1].preference.accuracy > 0.9
    assert (out / REFERENCE_FILE).is_file()
    assert any(
        "computed in a pass before training" in e.message for e in rec.events if isinstance(e, LogEvent)
    )
    again = Recorder()  # a fresh run in the same directory (resume=False keeps the reference: same data)
    run_training(
        dpo_spec(out, data, data, engine={"mode": "zenflow"}, max_steps=1), on_event=again, resume=False
    )
    assert any("read back" in e.message for e in again.events if isinstance(e, LogEvent))
    assert abs(_steps(again)[0].loss - math.log(2)) < 1e-4


@pytest.mark.slow
def test_lora_dpo_keeps_one_model_in_memory(tmp_path: Path) -> None:
    from transformers import PreTrainedModel

    data = write(tmp_path / "pairs.jsonl", [pair(i) for i in range(16)])
    models: list[int] = []

    def live_models() -> set[int]:
        gc.collect()
        # whole causal LMs (their inner LlamaModel is a PreTrainedModel too)
        lms = (o for o in gc.get_objects() if isinstance(o, PreTrainedModel) and hasattr(o, "lm_head"))
        return {id(o) for o in lms}

    before = live_models()  # another test's, not yet collected

    def on_event(ev: Any) -> None:
        rec(ev)
        if isinstance(ev, RunStarted):
            models.append(len(live_models() - before))

    rec = Recorder()
    spec = dpo_spec(tmp_path / "out", data, learning_rate=1e-2, lora={"r": 8}, engine={"mode": "offload"})
    run_training(spec, on_event=on_event)
    assert models == [1]  # the policy only: the reference is it with the adapter disabled
    assert not (tmp_path / "out" / REFERENCE_FILE).exists()
    steps = _steps(rec)
    assert abs(steps[0].loss - math.log(2)) < 1e-4
    assert steps[-1].preference is not None and steps[-1].preference.accuracy > 0.9


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tests.dist_ranks import pinned_numerics
    from tests.trainer.dist_ranks import Job, train_on_ranks

    data = write(tmp_path / "pairs.jsonl", [pair(i, "yes" if i % 2 else "sure", "no") for i in range(8)])
    hp: dict[str, Any] = {"n_epochs": 1, "batch_size": 4, "micro_batch_size": 1}
    one = dpo_spec(tmp_path / "one", data, **hp)
    two = dpo_spec(tmp_path / "two", data, resources={"gpus": 2}, **hp)
    with pinned_numerics():
        rec = Recorder()
        run_training(one, on_event=rec)
    (outcomes,) = train_on_ranks([Job(two)])
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    losses = [[loss for t, _, loss, _ in o.events if t == "step"] for o in outcomes]
    single = [e.loss for e in _steps(rec)]
    assert losses[0] == losses[1] and losses[0] == pytest.approx(single, abs=1e-5)
    a, b = (load_file(str(p / "final" / "model.safetensors")) for p in (tmp_path / "one", tmp_path / "two"))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def test_the_plan_counts_two_rows_a_pair_and_the_reference() -> None:
    from trainer.plan.gpus import Machine
    from trainer.resolve import plan_spec

    machine = Machine.for_gpu("h100")

    def plan(**hp: Any) -> Any:
        spec = JobSpec.model_validate(
            {
                "model": "small-llama",
                "training_file": "x.jsonl",
                "hyperparameters": {"batch_size": 8, "micro_batch_size": 8, **hp},
                "engine": {"mode": "device"},
            }
        )
        return plan_spec(spec, machine, num_examples=1000)

    sft, full, lora = plan(), plan(dpo={}), plan(dpo={}, lora={"r": 8})
    assert full.activations["saved"] == pytest.approx(2 * sft.activations["saved"], rel=0.01)  # both rows
    assert full.host["dpo_reference"] == 8 * 1000 and "dpo_reference" not in lora.host
    assert "dpo_reference" not in sft.host
    lora_sft = plan(lora={"r": 8})
    assert lora.step_seconds > 2 * lora_sft.step_seconds  # two rows a pair, plus the reference forward


def test_dpo_trains_without_dropout() -> None:
    """A dropout mask differing between the policy's and the reference's forward would be noise in every
    reward: a DPO job's model, attention dropout and LoRA dropout included, is deterministic in train mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.method.dpo import disable_dropout

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.5,
    )
    model = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=4, lora_dropout=0.5, target_modules=["q_proj", "v_proj"])
    )
    model.train()
    ids = torch.randint(0, 64, (2, 12))

    def logits() -> torch.Tensor:
        return model(input_ids=ids).logits

    assert not torch.equal(logits(), logits())  # the dropouts are on: the check can fail
    disable_dropout(model)
    assert torch.equal(logits(), logits())


@pytest.mark.slow
def test_two_sharded_ranks_equal_one_process(tmp_path: Path) -> None:
    """FSDP2 weights (``engine.shard_params``): the reference table and validation run every pair on every
    rank, and a rank short of pairs in the ragged last step runs filler passes through the DPO loss (zero
    weight); the losses, validation and final weights are one process's within 1e-5."""
    from safetensors.torch import load_file

    from tests.dist_ranks import pinned_numerics
    from tests.trainer.dist_ranks import Job, train_on_ranks

    # 7 pairs, 4 a step: the last step's 3 pairs split 2 / 1; 5 validation pairs split unevenly too
    data = write(tmp_path / "pairs.jsonl", [pair(i, "yes" if i % 2 else "sure", "no") for i in range(7)])
    valid = write(tmp_path / "valid.jsonl", [pair(i + 50, "yes", "no") for i in range(5)])
    hp: dict[str, Any] = {"n_epochs": 1, "batch_size": 4, "micro_batch_size": 1, "eval_every": 1}
    one = dpo_spec(tmp_path / "one", data, valid, **hp)
    engine = {"mode": "device", "shard_params": True}
    two = dpo_spec(tmp_path / "two", data, valid, resources={"gpus": 2}, engine=engine, **hp)
    with pinned_numerics():
        rec = Recorder()
        res = run_training(one, on_event=rec)
    (outcomes,) = train_on_ranks([Job(two)])
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    assert outcomes[0].result is not None and outcomes[0].result["steps"] == 2
    losses = [[loss for t, _, loss, _ in o.events if t == "step"] for o in outcomes]
    single = [e.loss for e in _steps(rec)]
    assert len(single) == 2 and losses[0] == losses[1] and losses[0] == pytest.approx(single, abs=1e-5)
    # rank 0 reports every rank's memory: its parameter rows (about half the model each) and engine bytes
    (ranks,) = [d["ranks"] for m, d in outcomes[0].logs if m.startswith("Memory per rank") and d]
    assert [r["rank"] for r in ranks] == [0, 1] and not any(
        m.startswith("Memory per") for m, _ in outcomes[1].logs
    )
    whole = sum(
        p.numel() * 4 for p in load_file(str(tmp_path / "one" / "final" / "model.safetensors")).values()
    )
    assert all(0 < r["param_bytes"] < whole and r["device_state_bytes"] > 0 for r in ranks)
    assert sum(t == "eval" for t, *_ in outcomes[0].events) == 2 and res.valid_loss is not None
    assert outcomes[0].result["valid_loss"] == pytest.approx(res.valid_loss, abs=1e-5)
    a, b = (load_file(str(p / "final" / "model.safetensors")) for p in (tmp_path / "one", tmp_path / "two"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
