"""Micro-batches, packing and activation checkpointing (trainer.run.step, trainer.data.packing, trainer.runtime):
the same update however a step is cut, packed rows isolated per example, the same gradients with
checkpointing, and the hyperparameters' validation and resolution."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from contract.hyperparameters import ResolvedHyperparameters, RuntimeChoices
from tests.trainer.run.test_loop import Recorder, arithmetic_file, make_spec
from trainer.data.batching import collate, loss_sum, micro_batches
from trainer.data.dataset import IGNORE_INDEX, Example
from trainer.data.packing import pack_rows, use_packing_attention
from trainer.model.catalog import load_model
from trainer.resolve import resolve_hyperparameters
from trainer.run.loop import run_training
from trainer.run.setup import apply_runtime
from trainer.spec import JobSpec

pytestmark = pytest.mark.usefixtures("torch_single_thread")
CPU = torch.device("cpu")


def _examples(n: int, seed: int = 0, vocab: int = 200) -> list[Example]:
    """Examples of varied lengths whose first part (the 'prompt') is not learned."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(5, 40)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        prompt = rng.randint(1, length - 2)
        out.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(a[k].double().pow(2).sum()) for k in a)
    return (num / den) ** 0.5


@pytest.mark.parametrize(
    "engine",
    [{"mode": "device"}, {"mode": "zenflow", "update_interval": 2, "full_warm_up_rounds": 0}],
    ids=["device", "zenflow"],
)
def test_micro_batches_give_the_same_update(tmp_path: Path, engine: dict[str, Any]) -> None:
    """1 x 8, 4 x 2 and packed rows (3 + 1) make the same optimizer steps: same weights (relative
    1e-5), same step events; zenflow's windows count optimizer steps, not micro-batches."""
    data = arithmetic_file(tmp_path / "sums.jsonl", n=32)
    # Rows of 20 tokens hold two of these examples (7-8 tokens): packed, a step is 3 + 1 rows.
    base = {
        "n_epochs": 2,
        "batch_size": 8,
        "max_seq_length": 20,
        "learning_rate": 1e-2,
        "checkpoint_every": 100,
    }
    runs = {}
    for name, extra in {
        "whole": {},
        "micro": {"micro_batch_size": 2},
        "packed": {"micro_batch_size": 3, "packing": True},
    }.items():
        rec = Recorder()
        spec = make_spec(tmp_path / name, data, None, hyperparameters={**base, **extra}, engine=engine)
        result = run_training(spec, on_event=rec)
        started = rec.of("run_started")[0].hyperparameters
        assert started["micro_batch_size"] == extra.get("micro_batch_size", 8)
        weights = load_file(str(Path(result.final_model_dir or "") / "model.safetensors"))
        runs[name] = (weights, rec.of("step"), result)
    whole, steps, result = runs["whole"]
    for name in ("micro", "packed"):
        weights, other, res = runs[name]
        assert _rel(whole, weights) < 1e-5, name
        assert [e.step for e in other] == [e.step for e in steps] == list(range(1, 9))
        assert [e.tokens for e in other] == [
            e.tokens for e in steps
        ] and res.trained_tokens == result.trained_tokens
        assert [e.loss for e in other] == pytest.approx([e.loss for e in steps], rel=1e-5)
        assert [e.engine.applied_cpu_update for e in other] == [e.engine.applied_cpu_update for e in steps]
    if engine["mode"] == "zenflow":
        # Windows of 2 optimizer steps; window v's CPU update lands at the end of window v + 1.
        assert [e.engine.applied_cpu_update for e in steps] == [False, False, False, True] + [False, True] * 2


def _segments_logits(
    model: Any, examples: list[Example], rows: list[list[int]]
) -> tuple[list[torch.Tensor], Any]:
    """Each example's logits out of one packed forward, in example order, and the packed batch."""
    batch = next(
        iter(micro_batches(examples, len(rows), pad_id=0, device=CPU, packing=True, max_seq_length=64))
    )
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    out: dict[int, torch.Tensor] = {}
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = len(examples[i].input_ids)
            out[i] = logits[r, at : at + n]
            at += n
    return [out[i] for i in range(len(examples))], batch


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_loss_equals_unpacked_per_example(attention: str) -> None:
    """Packed rows (several examples per row, positions restarting, no cross-attention) give every
    example the logits and loss it has alone; the control shows a plain causal mask over the same rows
    would not (so this test sees a leak)."""
    model = load_model("tiny-llama", dtype=torch.float32, seed=0).eval()
    model.set_attn_implementation(attention)
    examples = _examples(9)
    rows = pack_rows([len(e.input_ids) for e in examples], 64)
    assert len(rows) < len(examples) and any(len(r) >= 3 for r in rows)
    packed, batch = _segments_logits(model, examples, rows)
    with torch.no_grad():
        for e, got in zip(examples, packed, strict=True):
            alone = model(input_ids=torch.tensor([e.input_ids]), use_cache=False).logits[0]
            torch.testing.assert_close(got, alone, atol=2e-5, rtol=1e-5)
        total, count = loss_sum(model, batch)
        singles = [loss_sum(model, collate([e], 0, CPU)) for e in examples]
    assert int(count) == sum(int(c) for _, c in singles) == batch.num_learned
    assert float(total) == pytest.approx(sum(float(s) for s, _ in singles), rel=1e-5)
    # Control: the same rows under one causal mask per row (an explicit 2D mask turns packing detection
    # off) mix examples, and the logits after the first example of a row change.
    with torch.no_grad():
        mixed = model(
            input_ids=batch.input_ids,
            attention_mask=torch.ones_like(batch.input_ids),
            position_ids=batch.position_ids,
            use_cache=False,
        ).logits
    second = rows[0][1]
    start = len(examples[rows[0][0]].input_ids)
    assert not torch.allclose(
        mixed[0, start : start + len(examples[second].input_ids)], packed[second], atol=1e-3
    )


def test_packing_rows_and_attention() -> None:
    rows = pack_rows([30, 20, 50, 10, 64, 5], 64)
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum([30, 20, 50, 10, 64, 5][i] for i in r) <= 64 for r in rows) and len(rows) == 3
    model = load_model("tiny-llama", dtype=torch.float32, seed=0)
    assert use_packing_attention(model, CPU, torch.float32) == "sdpa"


@pytest.mark.parametrize("lora", [None, {"r": 4, "dropout": 0.1}], ids=["full", "lora-dropout"])
def test_gradient_checkpointing_gives_the_same_gradients(lora: dict[str, Any] | None) -> None:
    from trainer.model.lora import apply_lora

    batch = collate(_examples(4, seed=2), 0, CPU)
    grads, calls = [], []
    for checkpointing in (False, True):
        model = load_model("tiny-llama", dtype=torch.float32, seed=0)
        apply_runtime(
            model,
            RuntimeChoices(micro_batch_size=4, gradient_checkpointing=checkpointing, packing=False),
            CPU,
            torch.float32,
        )
        # Inside the checkpointed layer (transformers checkpoints forward, hooks on the layer stay outside).
        forwards: list[int] = []
        model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_, seen=forwards: seen.append(1))
        if lora is not None:
            spec = JobSpec.model_validate(
                {"model": "tiny-llama", "training_file": "x.jsonl", "hyperparameters": {"lora": lora}}
            )
            model = apply_lora(model, spec, seed=0)
        model.train()
        torch.manual_seed(5)  # the same dropout masks (checkpoints replay the RNG state)
        ls, count = loss_sum(model, batch)
        (ls / count).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad})  # type: ignore[union-attr]
        calls.append(len(forwards))
    assert calls == [1, 2]  # checkpointing really recomputed the layer in backward
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-6, rtol=1e-5)


# --- hyperparameters --------------------------------------------------------------------------------


def _spec(**hp: Any) -> JobSpec:
    return JobSpec.model_validate({"model": "tiny-llama", "training_file": "x.jsonl", "hyperparameters": hp})


def test_micro_batch_size_validation() -> None:
    with pytest.raises(ValidationError) as ei:
        _spec(batch_size=4, micro_batch_size=8)
    err = ei.value.errors()[0]
    assert err["loc"] == ("hyperparameters", "micro_batch_size") and "at most batch_size (4)" in err["msg"]
    for bad in (0, -1, True, "many", 2**31):
        with pytest.raises(ValidationError) as ei:
            _spec(micro_batch_size=bad)
        assert ei.value.errors()[0]["loc"][:2] == ("hyperparameters", "micro_batch_size"), bad
    for field in ("gradient_checkpointing", "packing"):
        with pytest.raises(ValidationError) as ei:
            _spec(**{field: "sometimes"})
        assert ei.value.errors()[0]["loc"][:2] == ("hyperparameters", field)


def _resolved(n: int, planned: RuntimeChoices | None = None, **hp: Any) -> ResolvedHyperparameters:
    spec = JobSpec(model="tiny-llama", training_file="t.jsonl", hyperparameters=hp)
    return resolve_hyperparameters(spec, n, planned)[0]


def test_runtime_resolution() -> None:
    r = _resolved(1000)
    assert (r.micro_batch_size, r.gradient_checkpointing, r.packing) == (r.batch_size, False, False)
    # A batch size lowered to the examples (or auto) clamps the micro-batch with it.
    assert _resolved(5, batch_size=16, micro_batch_size=16).micro_batch_size == 5
    plan = RuntimeChoices(micro_batch_size=64, gradient_checkpointing=True, packing=True)
    r = _resolved(100, plan, batch_size=8, packing=False)
    assert (r.micro_batch_size, r.gradient_checkpointing, r.packing) == (
        8,
        True,
        False,
    )  # explicit wins, clamped
    assert "micro_batch_size" not in r.training_signature()


def test_checkpoint_without_runtime_fields_resumes() -> None:
    """A checkpoint recorded before these fields ran one forward/backward per step; it still matches."""
    r = _resolved(40, batch_size=4)
    old = r.model_dump(exclude={"micro_batch_size", "gradient_checkpointing", "packing"})
    back = ResolvedHyperparameters(**old)
    assert (back.micro_batch_size, back.gradient_checkpointing, back.packing) == (4, False, False)
    assert back.training_signature() == r.training_signature()
    other = _resolved(40, batch_size=4, micro_batch_size=2, packing=True)
    assert other.training_signature() == back.training_signature()
