"""What grading produces: the sample a grader sees, and its reward with OpenAI's error flags.

A grader reads two namespaces (OpenAI's): ``sample`` (the model's output: ``output_text``, and
``output_json`` when that text parses as JSON) and ``item`` (the dataset row's fields). It returns a
reward and, beside it, the flags OpenAI reports in ``metadata.errors``: a grader that fails gives reward 0
with the matching flag set, never an exception to its caller (a training step or an API route).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Sample:
    """The ``sample`` namespace: what the model wrote."""

    output_text: str
    #: The text parsed as JSON, when it is JSON (else None).
    output_json: Any = None

    @classmethod
    def of_text(cls, text: str) -> Sample:
        """``text`` with its JSON parse when it parses."""
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        return cls(text, parsed)

    def namespace(self) -> dict[str, Any]:
        return {"output_text": self.output_text, "output_json": self.output_json}


@dataclass(frozen=True)
class GraderErrors:
    """OpenAI's ``metadata.errors`` of a grader run (``openai.types.fine_tuning.alpha.GraderRunResponse``)."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False

    def any(self) -> bool:
        """Whether some flag is set."""
        return any(v is True for v in asdict(self).values())

    def merged(self, other: GraderErrors) -> GraderErrors:
        """Each flag set in either (a multi grader's errors are its graders'); the first details kept."""
        mine, theirs = asdict(self), asdict(other)
        return GraderErrors(**{k: (mine[k] if mine[k] not in (None, False) else theirs[k]) for k in mine})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GradeResult:
    """One grader's verdict on one sample (OpenAI's run response: ``reward``, ``sub_rewards``,
    ``metadata``)."""

    reward: float
    name: str
    type: str
    errors: GraderErrors = field(default_factory=GraderErrors)
    #: A multi grader's graders' rewards by name (empty for the others).
    sub_rewards: dict[str, float] = field(default_factory=dict)
    #: What the grader computed on the way (a model grader's score and its reasoning, a metric's value).
    scores: dict[str, Any] = field(default_factory=dict)
    #: Wall-clock seconds the grading took.
    execution_time: float = 0.0
    #: A model grader's tokens (prompt + completion), and the model it sampled.
    token_usage: int | None = None
    sampled_model_name: str | None = None
    #: The tokens each grading model used (OpenAI's ``model_grader_token_usage_per_model``): model ->
    #: prompt_tokens, completion_tokens, total_tokens.
    usage_per_model: dict[str, dict[str, int]] = field(default_factory=dict)

    def timed(self, seconds: float) -> GradeResult:
        return replace(self, execution_time=seconds)


def failed(name: str, type_: str, errors: GraderErrors) -> GradeResult:
    """Reward 0 with ``errors`` (a grader that could not grade)."""
    return GradeResult(0.0, name, type_, errors)


def merged_usage(results: list[GradeResult]) -> dict[str, dict[str, int]]:
    """The results' token usage per model, summed."""
    out: dict[str, dict[str, int]] = {}
    for result in results:
        for model, usage in result.usage_per_model.items():
            mine = out.setdefault(model, {})
            for key, count in usage.items():
                mine[key] = mine.get(key, 0) + count
    return out
