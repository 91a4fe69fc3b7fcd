"""The model graders: score_model (a model's number, within ``range``) and label_model (a model's label,
reward 1 when it is a passing one), judged through a :class:`Judge` (the serving layer, in the API).

The grader's messages are rendered, then one instruction is added as a last system message saying how to
reply (OpenAI forces a structured reply instead; the models served here take plain chat). A reply is
read robustly: a JSON object with ``result`` or ``score`` (``label``), else the first number (the first
label named). A reply that says neither is ``model_grader_parse_error``; a judge that fails,
``model_grader_server_error`` with its details; a refusal, ``model_grader_refusal_error``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from contract.graders import LabelModelGrader, ModelGrader, ScoreModelGrader, message_text
from trainer.graders.result import GraderErrors, GradeResult, Sample
from trainer.graders.template import TemplateError, render, template_failure

#: A reply's number: an optional sign, digits with an optional fraction or exponent.
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_JSON_OBJECT = re.compile(r"\{.*?\}", re.DOTALL)


@dataclass(frozen=True)
class JudgeReply:
    text: str
    model: str
    #: OpenAI's usage: prompt_tokens, completion_tokens, total_tokens.
    token_usage: dict[str, int] = field(default_factory=dict)
    #: The model's refusal, when it refused.
    refusal: str | None = None


class JudgeError(Exception):
    """The judge could not answer (the model failed to load, timed out, was overloaded)."""


class Judge(Protocol):
    def chat(self, model: str, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> JudgeReply: ...


def reply_of(completion: Any, model: str) -> JudgeReply:
    """The judge's reply in an OpenAI chat completion object (JudgeError when it has no message)."""
    try:
        message = completion["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise JudgeError("the judge's answer has no message") from None
    usage = completion.get("usage") or {}
    counts = {k: int(usage[k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens") if k in usage}
    return JudgeReply(
        text=str(message.get("content") or ""),
        model=str(completion.get("model") or model),
        token_usage=counts,
        refusal=message.get("refusal"),
    )


def messages(grader: ModelGrader, sample: Sample, item: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The grader's messages rendered as chat messages (developer is sent as system), and the reply's form."""
    out = [
        {
            "role": "system" if m.role == "developer" else m.role,
            "content": render(message_text(m.content), sample, item),
        }
        for m in grader.input
    ]
    return [*out, {"role": "system", "content": _reply_form(grader)}]


def _reply_form(grader: ModelGrader) -> str:
    if isinstance(grader, ScoreModelGrader):
        low, high = grader.range
        return f'Reply with a JSON object {{"result": <a number from {low:g} to {high:g}>}} and nothing else.'
    return f'Reply with a JSON object {{"result": "<one of {json.dumps(grader.labels)}>"}} and nothing else.'


def sampling(grader: ModelGrader) -> dict[str, Any]:
    """The chat request's sampling fields (OpenAI's names) from ``sampling_params``; temperature 0 by default."""
    params = grader.sampling_params
    given = params.model_dump(exclude_none=True, exclude={"reasoning_effort"}) if params else {}
    tokens = given.pop("max_completions_tokens", 64)
    return {"temperature": 0.0, **given, "max_tokens": tokens}


def _json_field(text: str, keys: tuple[str, ...]) -> Any:
    for candidate in [text.strip(), *_JSON_OBJECT.findall(text)]:
        try:
            parsed = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            for key in keys:
                if key in parsed:
                    return parsed[key]
    return None


def parse_score(text: str) -> float | None:
    """The reply's score: ``result`` or ``score`` of a JSON object, else the first number; None if none."""
    value = _json_field(text, ("result", "score"))
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value
    match = _NUMBER.search(text)
    return float(match.group()) if match else None


def parse_label(text: str, labels: list[str]) -> str | None:
    """The reply's label: ``result`` or ``label`` of a JSON object, else the whole reply, else the first
    label named as a word (case ignored); None when it names none."""
    value = _json_field(text, ("result", "label"))
    candidates = [value] if isinstance(value, str) else []
    candidates.append(text.strip().strip("\"'. "))
    for candidate in candidates:
        for label in labels:
            if candidate.casefold() == label.casefold():
                return label
    found = [
        (m.start(), label) for label in labels if (m := re.search(rf"\b{re.escape(label)}\b", text, re.I))
    ]
    return min(found)[1] if found else None


def _usage(reply: JudgeReply) -> dict[str, dict[str, int]]:
    return {reply.model: dict(reply.token_usage)} if reply.token_usage else {}


def _ask(
    grader: ModelGrader, sample: Sample, item: Mapping[str, Any], judge: Judge
) -> JudgeReply | GradeResult:
    """The judge's reply, or the failed result that stands for it."""
    try:
        prompt = messages(grader, sample, item)
    except TemplateError as err:
        return template_failure(grader.name, grader.type, err)
    try:
        return judge.chat(grader.model, prompt, sampling(grader))
    except JudgeError as err:
        flags = GraderErrors(
            model_grader_server_error=True, model_grader_server_error_details=str(err)[:2000]
        )
        return GradeResult(0.0, grader.name, grader.type, flags)


def _judged(
    grader: ModelGrader, reply: JudgeReply, reward: float, errors: GraderErrors, scores: dict[str, Any]
) -> GradeResult:
    total = reply.token_usage.get("total_tokens")
    return GradeResult(
        reward,
        grader.name,
        grader.type,
        errors,
        scores={"reply": reply.text[:2000], **scores},
        token_usage=total,
        sampled_model_name=reply.model,
        usage_per_model=_usage(reply),
    )


def _answer(
    grader: ModelGrader, sample: Sample, item: Mapping[str, Any], judge: Judge
) -> JudgeReply | GradeResult:
    """The judge's reply to parse, or the grade already decided: its failure, or its refusal (reward 0)."""
    reply = _ask(grader, sample, item, judge)
    if isinstance(reply, GradeResult) or reply.refusal is None:
        return reply
    return _judged(
        grader, reply, 0.0, GraderErrors(model_grader_refusal_error=True), {"refusal": reply.refusal}
    )


def grade_score_model(
    grader: ScoreModelGrader, sample: Sample, item: Mapping[str, Any], judge: Judge
) -> GradeResult:
    reply = _answer(grader, sample, item, judge)
    if isinstance(reply, GradeResult):
        return reply
    score = parse_score(reply.text)
    if score is None:
        return _judged(grader, reply, 0.0, GraderErrors(model_grader_parse_error=True), {})
    low, high = grader.range
    reward = min(high, max(low, score))
    return _judged(grader, reply, reward, GraderErrors(), {"score": score, "clamped": reward != score})


def grade_label_model(
    grader: LabelModelGrader, sample: Sample, item: Mapping[str, Any], judge: Judge
) -> GradeResult:
    reply = _answer(grader, sample, item, judge)
    if isinstance(reply, GradeResult):
        return reply
    label = parse_label(reply.text, grader.labels)
    if label is None:
        return _judged(grader, reply, 0.0, GraderErrors(model_grader_parse_error=True), {})
    reward = 1.0 if label in grader.passing_labels else 0.0
    return _judged(grader, reply, reward, GraderErrors(), {"label": label})
