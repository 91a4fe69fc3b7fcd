"""Graders in OpenAI's shapes (``openai.types.graders``): what a reinforcement job and the grader endpoints
accept, a discriminated union on ``type``.

These records check each grader's shape and bounds only; what needs the grading code (a formula's
syntax, a template's variables, a Python grader's source, the models a team may name) is
``trainer.graders.validate``'s. Templates name the dataset row as ``{{item.<field>}}`` and the model's
output as ``{{sample.output_text}}`` or ``{{sample.output_json.<path>}}``.

:data:`Grader` is what OpenAI's fine-tuning job takes (string_check, text_similarity, python,
score_model, multi); :data:`AnyGrader` adds label_model, which OpenAI allows inside a multi grader and
the grader endpoints accept at the top too. A multi grader may hold another up to :data:`MAX_MULTI_DEPTH`
levels (OpenAI allows none; the bound keeps a grader's cost known).
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_NAME_CHARS = 256
#: A template (a string_check's input and reference, a model grader's message text).
MAX_TEMPLATE_CHARS = 64 * 1024
MAX_PYTHON_SOURCE_CHARS = 256 * 1024
MAX_IMAGE_TAG_CHARS = 128
MAX_FORMULA_CHARS = 4096
MAX_MESSAGES = 32
MAX_LABELS = 64
#: Graders in one multi grader, and multi graders inside each other (the outer one is level 1).
MAX_MULTI_GRADERS = 32
MAX_MULTI_DEPTH = 3
#: A model grader's reply, in tokens (``sampling_params.max_completions_tokens``).
MAX_JUDGE_TOKENS = 4096

GraderType = Literal["string_check", "text_similarity", "python", "score_model", "label_model", "multi"]
GRADER_TYPES: frozenset[str] = frozenset(get_args(GraderType))

StringOperation = Literal["eq", "ne", "like", "ilike"]
EvaluationMetric = Literal[
    "cosine",
    "fuzzy_match",
    "bleu",
    "gleu",
    "meteor",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
]
Role = Literal["user", "assistant", "system", "developer"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

#: The content parts a model grader's message may hold: text only (the judges here read no images or audio).
TEXT_PART_TYPES = frozenset({"input_text", "output_text"})


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _bounded(v: str, limit: int, what: str = "text") -> str:
    if len(v) > limit:
        raise ValueError(f"{what} is {len(v)} characters, over the limit of {limit}")
    return v


class _Grader(_Record):
    name: str
    """The grader's name, shown in its result's ``metadata.name``."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return _bounded(v, MAX_NAME_CHARS, "the name")


class StringCheckGrader(_Grader):
    """Compares ``input`` with ``reference`` (both templates): ``eq``, ``ne``, ``like`` (reference is a
    substring of input) or ``ilike`` (the same, ignoring case); reward 1 or 0."""

    type: Literal["string_check"] = "string_check"
    input: str
    reference: str
    operation: StringOperation

    @field_validator("input", "reference")
    @classmethod
    def _template(cls, v: str) -> str:
        return _bounded(v, MAX_TEMPLATE_CHARS, "the template")


class TextSimilarityGrader(_Grader):
    """``input`` against ``reference`` (both templates) by ``evaluation_metric``: a reward in [0, 1]."""

    type: Literal["text_similarity"] = "text_similarity"
    input: str
    reference: str
    evaluation_metric: EvaluationMetric

    @field_validator("input", "reference")
    @classmethod
    def _template(cls, v: str) -> str:
        return _bounded(v, MAX_TEMPLATE_CHARS, "the template")


class PythonGrader(_Grader):
    """``source`` defines ``grade(sample, item) -> float``, run in the sandbox (``trainer.graders.sandbox``)."""

    type: Literal["python"] = "python"
    source: str
    image_tag: str | None = None
    """OpenAI's runtime image; accepted and ignored (one sandbox here)."""

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty: it defines grade(sample, item) -> float")
        return _bounded(v, MAX_PYTHON_SOURCE_CHARS, "the source")

    @field_validator("image_tag")
    @classmethod
    def _image_tag(cls, v: str | None) -> str | None:
        return v if v is None else _bounded(v, MAX_IMAGE_TAG_CHARS, "the image tag")


class TextPart(_Record):
    """A text content part (the SDK's ``input_text`` or ``output_text``); may hold templates."""

    type: Literal["input_text", "output_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None
    """The SDK's prompt-cache mark; accepted and ignored."""

    @field_validator("text")
    @classmethod
    def _text(cls, v: str) -> str:
        return _bounded(v, MAX_TEMPLATE_CHARS, "the text")


MessageContent = str | TextPart | list[str | TextPart]


def _check_part(part: Any) -> None:
    if isinstance(part, str):
        return
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    if kind in ("input_image", "input_audio"):
        raise ValueError(f"{kind} content is not supported: the models that grade here read text only")
    if kind not in TEXT_PART_TYPES:
        raise ValueError(f"must be a string, or parts of type input_text or output_text, not {kind!r}")


class GraderMessage(_Record):
    """A message of a model grader's prompt: a role and its content (templates allowed)."""

    role: Role
    content: MessageContent
    type: Literal["message"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        for part in v if isinstance(v, list) else [v]:
            _check_part(part)
        return v

    @field_validator("content")
    @classmethod
    def _content_size(cls, v: MessageContent) -> MessageContent:
        _bounded(message_text(v), MAX_TEMPLATE_CHARS, "the content")
        return v


def message_text(content: MessageContent) -> str:
    """The content's text: its parts joined by newlines."""
    parts = content if isinstance(content, list) else [content]
    return "\n".join(p if isinstance(p, str) else p.text for p in parts)


class SamplingParams(_Record):
    """How the grading model samples (the SDK's ``sampling_params``); unset: the model's defaults."""

    max_completions_tokens: int | None = Field(None, ge=1, le=MAX_JUDGE_TOKENS)
    reasoning_effort: ReasoningEffort | None = None
    """Accepted for the SDK's sake; the models served here do not reason in effort levels."""
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)


def _messages(v: list[GraderMessage]) -> list[GraderMessage]:
    if not v:
        raise ValueError("must hold at least one message")
    if len(v) > MAX_MESSAGES:
        raise ValueError(f"holds {len(v)} messages, over the limit of {MAX_MESSAGES}")
    return v


class _ModelGrader(_Grader):
    model: str
    """A model the team may use: a base model served here, or one of its ``ft:`` models."""
    input: list[GraderMessage]
    sampling_params: SamplingParams | None = None

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must name a model")
        return _bounded(v, MAX_NAME_CHARS, "the model name")

    @field_validator("input")
    @classmethod
    def _input(cls, v: list[GraderMessage]) -> list[GraderMessage]:
        return _messages(v)


class ScoreModelGrader(_ModelGrader):
    """A model scores the sample: its reply's number, checked against ``range`` (default [0, 1])."""

    type: Literal["score_model"] = "score_model"
    range: tuple[float, float] = (0.0, 1.0)

    @field_validator("range", mode="before")
    @classmethod
    def _range_default(cls, v: Any) -> Any:
        return (0.0, 1.0) if v is None else v

    @field_validator("range")
    @classmethod
    def _range(cls, v: tuple[float, float]) -> tuple[float, float]:
        low, high = v
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"must be two finite numbers [low, high] with low < high, not {list(v)}")
        return v


class LabelModelGrader(_ModelGrader):
    """A model labels the sample: reward 1 when its label is one of ``passing_labels``, else 0."""

    type: Literal["label_model"] = "label_model"
    labels: list[str]
    passing_labels: list[str]

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must hold at least one label")
        if len(v) > MAX_LABELS:
            raise ValueError(f"holds {len(v)} labels, over the limit of {MAX_LABELS}")
        if any(not label.strip() for label in v):
            raise ValueError("a label must not be empty")
        if len(set(v)) != len(v):
            raise ValueError("labels must be distinct")
        for label in v:
            _bounded(label, MAX_NAME_CHARS, "a label")
        return v

    @field_validator("passing_labels")
    @classmethod
    def _passing(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if not v:
            raise ValueError("must hold at least one label")
        labels = info.data.get("labels")
        extra = [p for p in v if labels is not None and p not in labels]
        if extra:
            raise ValueError(f"{extra} are not among labels {labels}")
        return v


def _is_single_grader(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("type"), str)


class MultiGrader(_Grader):
    """Named graders combined by ``calculate_output``, a formula over their names (``trainer.graders.multi``:
    numbers, + - * / **, min, max, abs, floor, ceil, exp, sqrt, log)."""

    type: Literal["multi"] = "multi"
    graders: dict[str, AnyGrader]
    """The graders by the names the formula uses (a single grader, as the SDK's type reads, is keyed by its name)."""
    calculate_output: str

    @field_validator("graders", mode="before")
    @classmethod
    def _keyed(cls, v: Any) -> Any:
        if _is_single_grader(v):
            return {v.get("name"): v}
        return v

    @field_validator("graders")
    @classmethod
    def _graders(cls, v: dict[str, AnyGrader]) -> dict[str, AnyGrader]:
        if not v:
            raise ValueError("must hold at least one grader")
        if len(v) > MAX_MULTI_GRADERS:
            raise ValueError(f"holds {len(v)} graders, over the limit of {MAX_MULTI_GRADERS}")
        for key in v:
            if not key.isidentifier() or keyword.iskeyword(key):
                raise ValueError(
                    f"{key!r} is not a name calculate_output can use: letters, digits and underscores, "
                    "not starting with a digit"
                )
        depth = 1 + max(multi_depth(g) for g in v.values())
        if depth > MAX_MULTI_DEPTH:
            raise ValueError(f"multi graders nest {depth} deep, over the limit of {MAX_MULTI_DEPTH}")
        return v

    @field_validator("calculate_output")
    @classmethod
    def _formula(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty: a formula over the graders' names")
        return _bounded(v, MAX_FORMULA_CHARS, "the formula")


def multi_depth(grader: AnyGrader) -> int:
    """How many multi graders deep ``grader`` goes (0 for a grader that is not one)."""
    if not isinstance(grader, MultiGrader):
        return 0
    return 1 + max(multi_depth(g) for g in grader.graders.values())


#: Every grader type; what a multi grader holds and the grader endpoints take.
AnyGrader = Annotated[
    StringCheckGrader
    | TextSimilarityGrader
    | PythonGrader
    | ScoreModelGrader
    | LabelModelGrader
    | MultiGrader,
    Field(discriminator="type"),
]
#: A fine-tuning job's grader, as OpenAI's ``ReinforcementMethod.grader`` takes it.
Grader = Annotated[
    StringCheckGrader | TextSimilarityGrader | PythonGrader | ScoreModelGrader | MultiGrader,
    Field(discriminator="type"),
]
ModelGrader = ScoreModelGrader | LabelModelGrader

MultiGrader.model_rebuild()


def field_path(loc: Sequence[int | str]) -> tuple[int | str, ...]:
    """A pydantic error's ``loc`` without the union's tags: ``("grader", "multi", "graders", "a",
    "string_check", "name")`` -> ``("grader", "graders", "a", "name")``. A tag comes first (a grader
    validated on its own), after a ``grader`` field, or after a key of ``graders``."""
    out: list[int | str] = []
    expect_tag, after_graders = True, False
    for part in loc:
        if expect_tag and part in GRADER_TYPES:
            expect_tag = False
            continue
        if after_graders:
            out.append(part)
            expect_tag, after_graders = True, False
            continue
        expect_tag, after_graders = part == "grader", part == "graders"
        out.append(part)
    return tuple(out)
