"""Grader templates: ``{{item.<path>}}`` (the dataset row), ``{{sample.output_text}}`` and
``{{sample.output_json.<path>}}`` (the model's output), rendered at grade time.

A path is dot-separated keys, a number indexing a list (``{{item.choices.0}}``). A value that is not a
string is written as JSON. What cannot be rendered is a :class:`TemplateError` carrying OpenAI's flag:
``invalid_variable_error`` (an unknown namespace, a missing field) or ``sample_parse_error`` (the template
reads ``sample.output_json`` and the sample is not JSON).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from contract.graders import (
    AnyGrader,
    LabelModelGrader,
    MessageContent,
    MultiGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextPart,
    TextSimilarityGrader,
)
from trainer.graders.result import GraderErrors, GradeResult, Sample

#: ``{{ namespace.path }}``: whatever lies between the braces, spaces trimmed.
_VARIABLE = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*$")
NAMESPACES = ("item", "sample")
SAMPLE_FIELDS = ("output_text", "output_json")

Flag = Literal["invalid_variable_error", "sample_parse_error"]


class TemplateError(Exception):
    """A template that cannot be rendered for this sample and item; ``flag`` is OpenAI's error flag."""

    def __init__(self, message: str, flag: Flag = "invalid_variable_error") -> None:
        super().__init__(message)
        self.flag: Flag = flag


@dataclass(frozen=True)
class Variable:
    """A ``{{...}}`` reference: its namespace and the keys after it."""

    namespace: str
    keys: tuple[str, ...]

    @property
    def text(self) -> str:
        return ".".join((self.namespace, *self.keys))


def variables(template: str) -> Iterator[Variable]:
    """The template's references, in order; :class:`TemplateError` for one that is not a dotted path."""
    for match in _VARIABLE.finditer(template):
        yield _variable(match.group(1).strip())


def _variable(text: str) -> Variable:
    if not _PATH.match(text):
        raise TemplateError(
            f"{{{{{text}}}}} is not a variable: write {{{{item.<field>}}}} or {{{{sample.output_text}}}}"
        )
    namespace, *keys = text.split(".")
    return Variable(namespace, tuple(keys))


def template_errors(template: str) -> list[str]:
    """What is wrong with a template before any sample: bad syntax, an unknown namespace or sample field."""
    errors: list[str] = []
    if template.count("{{") != template.count("}}"):
        errors.append("unbalanced {{ and }}")
    try:
        for var in variables(template):
            errors.extend(_namespace_errors(var))
    except TemplateError as err:
        errors.append(str(err))
    return errors


def _namespace_errors(var: Variable) -> list[str]:
    if var.namespace not in NAMESPACES:
        return [f"{{{{{var.text}}}}}: unknown namespace {var.namespace!r}; templates read item and sample"]
    if not var.keys:
        return [f"{{{{{var.text}}}}}: name a field, e.g. {{{{{var.namespace}.{_example(var.namespace)}}}}}"]
    if var.namespace == "sample" and var.keys[0] not in SAMPLE_FIELDS:
        return [f"{{{{{var.text}}}}}: the sample has output_text and output_json, not {var.keys[0]!r}"]
    return []


def _example(namespace: str) -> str:
    return "output_text" if namespace == "sample" else "<field>"


def render(template: str, sample: Sample, item: Mapping[str, Any]) -> str:
    """The template with each reference replaced by its value (:class:`TemplateError` when one has none)."""
    return _VARIABLE.sub(lambda m: _text(_value(_variable(m.group(1).strip()), sample, item)), template)


def _value(var: Variable, sample: Sample, item: Mapping[str, Any]) -> Any:
    errors = _namespace_errors(var)
    if errors:
        raise TemplateError(errors[0])
    if var.namespace == "item":
        return _lookup(item, var.keys, var)
    if var.keys[0] == "output_json" and sample.output_json is None:
        raise TemplateError(f"{{{{{var.text}}}}}: the sample is not JSON", "sample_parse_error")
    return _lookup(sample.namespace(), var.keys, var)


def _lookup(root: Any, keys: tuple[str, ...], var: Variable) -> Any:
    value = root
    for key in keys:
        value = _step(value, key)
        if value is _MISSING:
            raise TemplateError(f"{{{{{var.text}}}}}: no {key!r} there")
    return value


_MISSING = object()


def _step(value: Any, key: str) -> Any:
    if isinstance(value, Mapping):
        return value.get(key, _MISSING)
    if isinstance(value, list) and key.isdigit() and int(key) < len(value):
        return value[int(key)]
    return _MISSING


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def grader_templates(grader: AnyGrader, path: str = "grader") -> Iterator[tuple[str, str]]:
    """Each template of ``grader`` with its param path (``grader.reference``, ``grader.input[0].content``,
    ``grader.graders.exact.reference``), a multi grader's graders' included."""
    if isinstance(grader, StringCheckGrader | TextSimilarityGrader):
        yield f"{path}.input", grader.input
        yield f"{path}.reference", grader.reference
    elif isinstance(grader, ScoreModelGrader | LabelModelGrader):
        for i, message in enumerate(grader.input):
            yield from _content_templates(message.content, f"{path}.input[{i}].content")
    elif isinstance(grader, MultiGrader):
        for key, sub in grader.graders.items():
            yield from grader_templates(sub, f"{path}.graders.{key}")


def _content_templates(content: MessageContent, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(content, str):
        yield path, content
    elif isinstance(content, TextPart):
        yield f"{path}.text", content.text
    else:
        for j, part in enumerate(content):
            yield from _content_templates(part, f"{path}[{j}]")


def item_fields(grader: AnyGrader, path: str = "grader") -> dict[str, str]:
    """Each top-level item field the grader's templates read, with the first param path reading it
    (``{"answer": "grader.reference"}``): a job's data must have them all. A Python grader's reads are
    not known before it runs."""
    fields: dict[str, str] = {}
    for where, template in grader_templates(grader, path):
        try:
            refs = list(variables(template))
        except TemplateError:
            continue
        for var in refs:
            if var.namespace == "item" and var.keys:
                fields.setdefault(var.keys[0], where)
    return fields


def template_failure(name: str, type_: str, err: TemplateError) -> GradeResult:
    """Reward 0 with the template's flag, its message in ``scores["error"]``."""
    sample_parse = err.flag == "sample_parse_error"
    flags = GraderErrors(sample_parse_error=sample_parse, invalid_variable_error=not sample_parse)
    return GradeResult(0.0, name, type_, flags, scores={"error": str(err)})
