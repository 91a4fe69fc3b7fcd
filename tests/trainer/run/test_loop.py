"""The training loop on the real ZenFlow engine (CPU): full job, exact resume, cancel, LoRA, errors."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from trainer.data.dataset import DatasetValidationError
from trainer.events import Event
from trainer.run.checkpoint import FINAL_DIR, latest_checkpoint, list_checkpoints
from trainer.run.loop import ResumeMismatchError, TrainResult, run_training
from trainer.samples import TRAIN_FILE, VALID_FILE
from trainer.spec import JobSpec

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def make_spec(out: Path, train: Path = TRAIN_FILE, valid: Path | None = VALID_FILE, **kw: Any) -> JobSpec:
    hp = {
        "n_epochs": 1,
        "batch_size": 16,
        "max_seq_length": 128,
        "eval_every": 4,
        "checkpoint_every": 4,
        "seed": 3,
        **kw.pop("hyperparameters", {}),
    }
    return JobSpec.model_validate(
        {
            "model": kw.pop("model", "tiny-llama"),
            "training_file": str(train),
            "validation_file": str(valid) if valid else None,
            "hyperparameters": hp,
            "output_dir": str(out),
            "device": "cpu",
            **kw,
        }
    )


def arithmetic_file(path: Path, n: int = 24, seed: int = 0) -> Path:
    """A small prompt/completion file (single-digit sums)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n")
    return path


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, ev: Event) -> None:
        self.events.append(ev)

    def of(self, type_: str) -> list[Any]:
        return [e for e in self.events if e.type == type_]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobSpec, TrainResult, Recorder]:
    out = tmp_path_factory.mktemp("full")
    # zenflow named: the default engine mode, auto, runs tiny-llama on a CPU in device mode (tests/trainer/plan/test_plan.py)
    spec = make_spec(out, engine={"mode": "zenflow"})
    rec = Recorder()
    return spec, run_training(spec, on_event=rec), rec


def test_full_job_loads_with_from_pretrained_and_generates(
    finished: tuple[JobSpec, TrainResult, Recorder],
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec, result, _ = finished
    assert not result.cancelled and result.steps == result.total_steps == 8
    final = Path(result.final_model_dir or "")
    assert final == Path(spec.output_dir or "") / FINAL_DIR and not (final / "training_state.pt").exists()
    model = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(final), local_files_only=True)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of Peru?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1] and isinstance(tok.decode(out[0, ids.shape[1] :]), str)
    # The exported weights are the last checkpoint's, which is a complete resumable checkpoint.
    last = latest_checkpoint(final.parent)
    assert last is not None and last.step == 8 and (last.path / "training_state.pt").is_file()
    a, b = load_file(str(final / "model.safetensors")), load_file(str(last.path / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loaded = dict(model.named_parameters())
    assert all(torch.equal(loaded[k], a[k]) for k in a)


def test_full_job_events(finished: tuple[JobSpec, TrainResult, Recorder]) -> None:
    _, result, rec = finished
    types = [e.type for e in rec.events]
    assert (
        types[0] == "log" and types.index("run_started") < types.index("step") and types[-1] == "run_finished"
    )
    steps = rec.of("step")
    assert [e.step for e in steps] == list(range(1, 9))
    assert all(
        e.tokens > 0 and e.tokens_per_second > 0 and 0 <= e.stall_fraction <= 1 and e.lr > 0 for e in steps
    )
    assert steps[-1].loss < steps[0].loss and steps[0].engine.mode == "zenflow"
    assert [e.step for e in rec.of("eval")] == [4, 8] and result.valid_loss == rec.of("eval")[-1].valid_loss
    assert [e.step for e in rec.of("checkpoint")] == [4, 8]
    assert rec.of("checkpoint")[0].metrics["train_loss"] == steps[3].loss
    started = rec.of("run_started")[0]
    assert (
        started.hyperparameters["total_steps"] == 8
        and started.mode == "zenflow"
        and started.dtype == "float32"
    )
    assert result.trained_tokens == sum(e.tokens for e in steps)


def test_finished_run_is_not_rerun(finished: tuple[JobSpec, TrainResult, Recorder]) -> None:
    spec, result, _ = finished
    rec = Recorder()
    again = run_training(spec, on_event=rec)
    assert again == result and not rec.of("step")


def test_local_model_directory_as_base(
    finished: tuple[JobSpec, TrainResult, Recorder], tmp_path: Path
) -> None:
    """A local Hugging Face directory (here the previous job's output) is a base model too."""
    _, result, first = finished
    spec = make_spec(
        tmp_path / "out",
        valid=None,
        model=result.final_model_dir,
        hyperparameters={"max_steps": 2, "learning_rate": 1e-3},
        engine={"mode": "device"},
    )
    rec = Recorder()
    again = run_training(spec, on_event=rec)
    assert again.steps == 2 and rec.of("run_started")[0].hyperparameters["learning_rate"] == 1e-3
    # Same first batch as the fresh run, lower loss: it starts from the fine-tuned weights.
    assert rec.of("step")[0].loss < first.of("step")[0].loss
    assert (Path(again.final_model_dir or "") / "tokenizer.json").is_file()


def _weights(result: TrainResult) -> dict[str, torch.Tensor]:
    return load_file(str(Path(result.final_model_dir or "") / "model.safetensors"))


@pytest.mark.parametrize(
    "engine, lora, runtime",
    [
        ({"mode": "device"}, None, {}),
        ({"mode": "zenflow", "update_interval": 4}, None, {}),
        ({"mode": "device"}, {"r": 4, "dropout": 0.1}, {}),
        (
            {"mode": "zenflow", "update_interval": 2, "full_warm_up_rounds": 0},
            {"r": 4, "dropout": 0.1},
            {"micro_batch_size": 1, "packing": True, "gradient_checkpointing": True, "max_seq_length": 16},
        ),
    ],
    ids=[
        "device",
        "zenflow",
        "lora-dropout",
        "micro-packed-checkpointed",
    ],  # the last: 2 rows of 2 examples per step
)
def test_resume_gives_identical_weights(
    tmp_path: Path, engine: dict[str, Any], lora: dict[str, Any] | None, runtime: dict[str, Any]
) -> None:
    data = arithmetic_file(tmp_path / "sums.jsonl")
    hp = {
        "n_epochs": 2,
        "batch_size": 4,
        "checkpoint_every": 3,
        "max_seq_length": 32,
        "learning_rate": 1e-2,
        **runtime,
    }
    extra = {"engine": engine, "lora": lora}
    full = run_training(make_spec(tmp_path / "a", data, None, hyperparameters=hp, **extra))
    assert full.steps == 12

    # Interrupt 1: cancel after step 5 (mid-window; checkpoints at 3 and the cancel point 5).
    out = tmp_path / "b"
    seen = Recorder()
    cut = run_training(
        make_spec(out, data, None, hyperparameters=hp, **extra),
        on_event=seen,
        should_cancel=lambda: len(seen.of("step")) >= 5,
    )
    assert cut.cancelled and cut.steps == 5 and latest_checkpoint(out).step == 5  # type: ignore[union-attr]

    # Interrupt 2: a crash (an exception) at step 8: nothing saved past the checkpoint at 6.
    def crash(e: Event) -> None:
        if e.type == "step" and e.step == 8:  # type: ignore[attr-defined]
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_training(make_spec(out, data, None, hyperparameters=hp, **extra), on_event=crash)
    assert latest_checkpoint(out).step == 6  # type: ignore[union-attr]
    rec = Recorder()
    resumed = run_training(make_spec(out, data, None, hyperparameters=hp, **extra), on_event=rec)
    assert rec.of("run_started")[0].start_step == 6 and [e.step for e in rec.of("step")] == list(range(7, 13))
    a, b = _weights(full), _weights(resumed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert resumed.trained_tokens == full.trained_tokens and resumed.train_loss == full.train_loss


def test_cancel_stops_within_one_step(tmp_path: Path) -> None:
    data = arithmetic_file(tmp_path / "sums.jsonl", n=64)
    rec = Recorder()
    flag = {"cancel": False}

    def on_event(e: Event) -> None:
        rec(e)
        if e.type == "step" and e.step == 3:  # type: ignore[attr-defined]
            flag["cancel"] = True  # e.g. the user pressed cancel during step 3

    spec = make_spec(tmp_path / "out", data, None, hyperparameters={"batch_size": 2, "max_seq_length": 32})
    result = run_training(spec, on_event=on_event, should_cancel=lambda: flag["cancel"])
    assert result.cancelled and result.steps == 3 and result.final_model_dir is None
    assert [e.step for e in rec.of("step")] == [1, 2, 3] and rec.of("run_finished")[0].cancelled
    assert latest_checkpoint(tmp_path / "out").step == 3  # type: ignore[union-attr]
    assert not (tmp_path / "out" / FINAL_DIR).exists()


def test_lora_exports_merged_model_and_adapter(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.model.catalog import load_model

    rec = Recorder()
    spec = make_spec(
        tmp_path / "out",
        valid=None,
        lora={"r": 4, "alpha": 8},
        hyperparameters={"max_steps": 4, "learning_rate": 5e-2},
    )
    result = run_training(spec, on_event=rec)
    started = rec.of("run_started")[0]
    assert 0 < started.trainable_parameters < started.num_parameters / 5
    final = Path(result.final_model_dir or "")
    merged = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True)
    base = load_model("tiny-llama", dtype=torch.float32, seed=3)
    reference = PeftModel.from_pretrained(base, str(final / "adapter")).merge_and_unload()
    ref = reference.state_dict()
    got = merged.state_dict()
    assert got.keys() == ref.keys()
    assert all(torch.allclose(got[k], ref[k], atol=1e-6) for k in ref)
    changed = [
        k
        for k in ref
        if not torch.equal(ref[k], load_model("tiny-llama", dtype=torch.float32, seed=3).state_dict()[k])
    ]
    assert changed and all("proj" in k for k in changed)  # only adapted linear layers moved


def test_bad_data_raises_with_error_event(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    rec = Recorder()
    with pytest.raises(DatasetValidationError) as ei:
        run_training(make_spec(tmp_path / "out", bad, None), on_event=rec)
    assert ei.value.errors[0]["line"] == 1
    err = rec.of("error")[0]
    assert err.error_type == "DatasetValidationError" and err.errors[0]["field"] == "messages"


def test_resume_refuses_other_hyperparameters(tmp_path: Path) -> None:
    data = arithmetic_file(tmp_path / "sums.jsonl")
    hp = {"batch_size": 4, "max_seq_length": 32, "checkpoint_every": 2}
    run_training(
        make_spec(tmp_path / "out", data, None, hyperparameters=hp),
        should_cancel=lambda: bool(_ckpts(tmp_path)),
    )
    with pytest.raises(ResumeMismatchError, match="different hyperparameters"):
        run_training(make_spec(tmp_path / "out", data, None, hyperparameters={**hp, "batch_size": 3}))
    # Not resuming starts afresh (earlier checkpoints removed).
    fresh = run_training(
        make_spec(tmp_path / "out", data, None, hyperparameters={**hp, "batch_size": 3}), resume=False
    )
    assert fresh.steps == 8 and not fresh.cancelled


def _ckpts(tmp_path: Path) -> list[Any]:
    return list_checkpoints(tmp_path / "out")
