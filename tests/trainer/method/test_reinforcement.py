"""GRPO's loss and validation (trainer.method.reinforcement): at ratio 1 the clipped objective's gradient
is the plain policy gradient over the completions' tokens (checked against one computed by hand), the
prompt carries none, a group of equal rewards none either; the KL penalty (LoRA) is 0 while the adapter
is the base; an evaluation reports the mean reward as ``-valid_loss`` and repeats on the same weights;
the run's grading (MethodSetup.grading: sandbox limits and judge) reaches the rollout's and the evaluation's
graders."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from contract.method import ResolvedReinforcement
from trainer.data.example import RolloutPrompt
from trainer.events import EvalEvent
from trainer.graders.grading import Grading
from trainer.graders.sandbox import SandboxLimits
from trainer.method import reinforcement
from trainer.method.base import Batching, MethodSetup
from trainer.method.reinforcement import ReinforcementTraining, RolloutBatch, rows_of
from trainer.method.rewards import Graded, grade_all, group_advantages
from trainer.method.rollout import Rollout
from trainer.samples import KEYWORD_GRADER, MODELS_DIR, SAMPLES_DIR

pytestmark = pytest.mark.usefixtures("torch_single_thread")

CPU = torch.device("cpu")


def method(**kw: Any) -> ReinforcementTraining:
    args: dict[str, Any] = {
        "grader": KEYWORD_GRADER,
        "compute_multiplier": 1.0,
        "samples_per_prompt": 3,
        "eval_samples": 2,
        "max_completion_tokens": 6,
        "temperature": 1.0,
        "kl_beta": 0.0,
        **kw,
    }
    return ReinforcementTraining(ResolvedReinforcement.model_validate(args))


def batching(micro_batch_size: int = 2, seed: int = 0) -> Batching:
    hp: Any = SimpleNamespace(seed=seed, micro_batch_size=micro_batch_size)
    return Batching(hp, pad_id=0, device=CPU)


def tiny_llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    return model.to(torch.float64)  # type: ignore[arg-type]  # transformers' wrapped Module.to


# 2 prompts, 3 completions each (lengths differ: padding too), prompt-major
PROMPTS = [RolloutPrompt([1, 5, 9, 3], [-100] * 4), RolloutPrompt([1, 7, 3], [-100] * 3)]
COMPLETIONS = [[11, 12, 2], [13, 2], [14, 15, 16, 17], [20, 2], [21, 22, 23], [24]]


def rollout_batches(
    m: ReinforcementTraining, advantages: list[float], per_batch: int = 4
) -> list[RolloutBatch]:
    rows = rows_of(PROMPTS, Rollout(COMPLETIONS, [False] * 6, 0.0), 3)
    return list(m._batches(rows, advantages, per_batch, batching()))


def grads(model: Any, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        g if g is not None else torch.zeros_like(p)
        for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params, strict=True)
    ]


def hand_policy_gradient_loss(model: Any, advantages: list[float]) -> torch.Tensor:
    """``-sum_i A_i sum_t lp_it`` over each completion's tokens, one row at a time, no padding."""
    total = torch.zeros((), dtype=torch.float64)
    for k, c in enumerate(COMPLETIONS):
        p = PROMPTS[k // 3].input_ids
        ids = torch.tensor([[*p, *c]])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        lp = sum(logp[len(p) - 1 + j, t] for j, t in enumerate(c))
        total = total - advantages[k] * lp
    return total


def test_the_loss_gradient_is_the_policy_gradient_over_completion_tokens() -> None:
    model = tiny_llama()
    m = method()
    adv = [0.9, -0.4, -0.5, 1.3, 0.2, -1.5]
    batches = rollout_batches(m, adv)
    assert [len(b.advantages) for b in batches] == [4, 2]
    assert sum(b.num_learned for b in batches) == sum(len(c) for c in COMPLETIONS)
    loss = sum((m.loss(model, b) for b in batches), torch.zeros((), dtype=torch.float64))
    # at ratio 1 the loss's value is -sum(A) over the completions' tokens
    assert float(loss.detach()) == pytest.approx(
        -sum(a * len(c) for a, c in zip(adv, COMPLETIONS, strict=True))
    )
    ours, hand = grads(model, loss), grads(model, hand_policy_gradient_loss(model, adv))
    assert any(float(h.abs().max()) > 1e-6 for h in hand)
    for a, b in zip(ours, hand, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)  # the loss's log-probs are float32


def test_the_prompt_carries_no_loss() -> None:
    """The loss's gradient on the logits: zero at every position that predicts a prompt token (or
    padding), nonzero at each that predicts a completion token."""
    m = method()
    (batch,) = rollout_batches(m, [1.0, -1.0, 0.5, -0.5, 2.0, -2.0], per_batch=6)
    ids = batch.batch.input_ids
    logits = torch.randn(*ids.shape, 64, dtype=torch.float64, requires_grad=True)

    def fake(**kw: Any) -> Any:
        return SimpleNamespace(logits=logits)

    m.loss(fake, batch).backward()
    assert logits.grad is not None
    touched = logits.grad.abs().sum(-1) > 0  # [row, position]
    for k, c in enumerate(COMPLETIONS):
        p = len(PROMPTS[k // 3].input_ids)
        expected = [p - 1 <= t < p - 1 + len(c) for t in range(ids.shape[1])]
        assert touched[k].tolist() == expected, k


def test_a_group_of_equal_rewards_adds_no_gradient() -> None:
    model = tiny_llama()
    m = method()
    adv = group_advantages([1.0, 1.0, 1.0, 1.0, 0.0, 0.0], 3)  # prompt 0's group all alike
    assert adv[:3] == [0.0, 0.0, 0.0] and adv[3] > 0
    (both,) = rollout_batches(m, adv, per_batch=6)
    only_second = [0.0, 0.0, 0.0, *adv[3:]]
    (second,) = rollout_batches(m, only_second, per_batch=6)
    for a, b in zip(grads(model, m.loss(model, both)), grads(model, m.loss(model, second)), strict=True):
        torch.testing.assert_close(a, b)
    (alike,) = rollout_batches(m, [0.0] * 6, per_batch=6)
    assert all(float(g.abs().max()) == 0.0 for g in grads(model, m.loss(model, alike)))


def test_the_kl_penalty_is_zero_until_the_adapter_moves() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    plain, kl = method(), method(kl_beta=0.5)
    adv = [0.9, -0.4, -0.5, 1.3, 0.2, -1.5]
    (batch,) = rollout_batches(plain, adv, per_batch=6)
    # step 0: the adapter's B is zero, the policy is the base: no penalty, nor gradient from it
    assert float(kl.loss(model, batch).detach()) == pytest.approx(
        float(plain.loss(model, batch).detach()), abs=1e-12
    )
    for a, b in zip(grads(model, kl.loss(model, batch)), grads(model, plain.loss(model, batch)), strict=True):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    penalty = float(kl.loss(model, batch).detach() - plain.loss(model, batch).detach())
    # by hand: beta * sum over completion tokens of exp(d) - d - 1, d = lp_base - lp_policy
    lp = _completion_logps(model)
    with model.disable_adapter():
        ref = _completion_logps(model)
    d = ref - lp
    assert penalty > 1e-6
    assert penalty == pytest.approx(0.5 * float((torch.exp(d) - d - 1).sum()), rel=1e-4)


def _completion_logps(model: Any) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for k, c in enumerate(COMPLETIONS):
            p = PROMPTS[k // 3].input_ids
            logp = torch.log_softmax(model(input_ids=torch.tensor([[*p, *c]])).logits[0].double(), -1)
            out += [logp[len(p) - 1 + j, t] for j, t in enumerate(c)]
    return torch.stack(out)


@pytest.fixture(scope="module")
def keyword_task() -> tuple[Any, Any, list[Any]]:
    """docs-llama, its tokenizer and the keyword task's validation prompts."""
    from trainer.data.dataset import DataOptions, validate_file
    from trainer.model.catalog import load_model, load_tokenizer

    name = str(MODELS_DIR / "docs-llama")
    tok = load_tokenizer(name)
    model = load_model(name, dtype=torch.float32, seed=0, tokenizer=tok)
    rep = validate_file(
        SAMPLES_DIR / "keyword_rl_valid.jsonl",
        tokenizer=tok,
        max_seq_length=128,
        options=DataOptions(method="reinforcement"),
        keep_examples=True,
    )
    return model, tok, list(rep.examples)


def prepared(
    m: ReinforcementTraining, model: Any, tok: Any, b: Batching, tmp: Path, **kw: Any
) -> ReinforcementTraining:
    setup = MethodSetup(
        model=model,
        train=[],
        valid=[],
        out=tmp,
        batching=b,
        model_name="docs-llama",
        lora=False,
        dist=None,
        sharded=False,
        emit=lambda e: None,
        tokenizer=tok,
        **kw,
    )
    m.prepare(setup)
    return m


def test_evaluate_reports_the_mean_reward_and_repeats(
    keyword_task: tuple[Any, Any, list[Any]], tmp_path: Path
) -> None:
    model, tok, valid = keyword_task
    b = batching(micro_batch_size=3)
    m = prepared(method(eval_samples=4, max_completion_tokens=12), model, tok, b, tmp_path)
    first = m.evaluate(model, valid, b, None, False, step=0)
    assert isinstance(first, EvalEvent) and first.reward is not None and first.step == 0
    r = first.reward
    assert r.samples == 4 * len(valid) and 0.0 <= r.reward_min <= r.reward_mean <= r.reward_max <= 1.0
    assert first.valid_loss == -r.reward_mean
    assert 0 < r.completion_tokens_mean <= 12 and r.rollout_tokens_per_second > 0
    assert len(r.examples) == 3 and all(e.prompt and e.reward in (0.0, 1.0) for e in r.examples)
    again = m.evaluate(model, valid, b, None, False, step=5)
    assert again.reward is not None and again.step == 5
    assert again.reward.reward_mean == r.reward_mean and again.valid_loss == first.valid_loss
    assert [e.completion for e in again.reward.examples] == [e.completion for e in r.examples]
    assert m.step_metrics(None).samples == 0  # validation does not count as the step's rollout


def test_a_step_of_alike_rewards_learns_nothing(
    keyword_task: tuple[Any, Any, list[Any]], tmp_path: Path
) -> None:
    """The whole path (rollout, grading, advantages, loss) with a keyword every completion contains ('',
    reward 1 for all): every group alike, zero gradient; the step's metrics count its completions."""
    model, tok, valid = keyword_task
    b = batching(micro_batch_size=2)
    m = prepared(method(samples_per_prompt=4, max_completion_tokens=8), model, tok, b, tmp_path)
    prompts = [RolloutPrompt(p.input_ids, p.labels, item={**p.item, "keyword": ""}) for p in valid[:3]]
    batches = list(m.micro_batches(list(prompts), [0, 1, 2], b))
    assert [len(x.advantages) for x in batches] == [8, 4]
    assert all(float(x.advantages.abs().max()) == 0.0 for x in batches)
    loss = sum((m.loss(model, x) for x in batches), torch.zeros(()))
    loss.backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in model.parameters())
    model.zero_grad(set_to_none=True)
    metrics = m.step_metrics(None)
    assert metrics.samples == 12 and metrics.reward_mean == 1.0 and metrics.grader_errors == 0
    assert m.step_metrics(None).samples == 0  # the next step starts from nothing


def test_the_runs_grading_reaches_the_grader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MethodSetup.grading (the sandbox limits and the judge) is what a step's rollout and an evaluation
    grade with (the sampling stubbed: the completions are given)."""
    limits = SandboxLimits(wall_seconds=1.5, memory_bytes=128 * 2**20)
    judge = SimpleNamespace(chat=None)
    tok: Any = SimpleNamespace(decode=lambda ids, skip_special_tokens: "a prompt", eos_token_id=None)
    m = prepared(method(), tiny_llama(), tok, batching(), tmp_path, grading=Grading(limits, judge))

    def given(prompts: list[RolloutPrompt], n: int, b: Batching, seed: int) -> tuple[Rollout, list[str]]:
        k = len(prompts) * n
        return Rollout(COMPLETIONS[:k], [False] * k, 0.0), ["a text"] * k

    seen: list[Grading | None] = []

    def grading(grader: Any, texts: Any, items: Any, grading: Grading | None = None) -> Graded:
        seen.append(grading)
        return grade_all(grader, texts, items, grading)

    monkeypatch.setattr(m, "_rollout", given)
    monkeypatch.setattr(reinforcement, "grade_all", grading)
    list(m.micro_batches(list(PROMPTS), [0, 1], batching()))
    m.evaluate(m.model, list(PROMPTS), batching(), None, False, step=0)
    assert len(seen) == 2 and all(g is not None and g.limits is limits and g.judge is judge for g in seen)


def test_model_graders_without_a_judge_are_refused_before_a_step(tmp_path: Path) -> None:
    """A run whose grader asks a model and has no judge (a library run, no serving process) would train
    on rewards of 0 with server-error flags: it stops at prepare, naming the grader's model."""
    judge = {
        "type": "score_model",
        "name": "judge",
        "model": "tiny-llama",
        "input": [{"role": "user", "content": "Rate {{sample.output_text}}"}],
    }
    grader = {"type": "multi", "name": "m", "graders": {"judge": judge}, "calculate_output": "judge"}
    tok: Any = SimpleNamespace(decode=lambda ids, skip_special_tokens: "a prompt", eos_token_id=None)
    with pytest.raises(ValueError, match=r"^method\.grader\.graders\.judge\.model: model graders need"):
        prepared(method(grader=grader), tiny_llama(), tok, batching(), tmp_path)
    m = prepared(
        method(grader=grader), tiny_llama(), tok, batching(), tmp_path, grading=Grading(judge=object())
    )  # type: ignore[arg-type]
    assert m.grading.judge is not None


def test_the_same_prompts_at_a_later_step_sample_afresh(
    keyword_task: tuple[Any, Any, list[Any]], tmp_path: Path
) -> None:
    """A rollout's seed is the run's seed, the step and the prompts' indices: the same step samples the
    same completions (a resume reproduces them), a later epoch's step with the same prompts others."""
    model, tok, valid = keyword_task
    b = batching(micro_batch_size=2)
    m = prepared(method(samples_per_prompt=4, max_completion_tokens=8), model, tok, b, tmp_path)

    def rows(step: int) -> list[list[int]]:
        batches = m.micro_batches(list(valid[:2]), [0, 1], b, step=step)
        return [r for x in batches for r in x.batch.input_ids.tolist()]

    first = rows(0)
    assert rows(0) == first and rows(3) != first
    assert reinforcement.train_seed(0, 0, [0, 1]) != reinforcement.train_seed(0, 0, [1, 0])
