"""A create request's method and hyperparameters from wherever it gives them: the hyperparameters at the
top level (our extra) or in OpenAI's ``method`` (``method.<type>.hyperparameters``: DPO's ``beta``, a
reinforcement job's ``compute_multiplier``, ``eval_interval``, ``eval_samples`` and ``reasoning_effort``
among them, and its ``grader`` beside them). The job's request (contract.job.JobRequest) keeps the method
apart: ``{"type": "dpo", "beta": ...}``, ``{"type": "reinforcement", "grader": ..., ...}``; the job object
shows it back in OpenAI's shape (api.jobs.views.job_method)."""

from __future__ import annotations

from typing import Any

from api.core.errors import APIError
from api.schemas import HyperparametersIn, JobCreate

METHODS = ("supervised", "dpo", "reinforcement")
#: The hyperparameters each method keeps as its own settings (contract.method), apart from the shared ones.
OWN_SETTINGS = {
    "supervised": (),
    "dpo": ("beta",),
    "reinforcement": (
        "compute_multiplier",
        "eval_samples",
        "reasoning_effort",
        "max_completion_tokens",
        "temperature",
        "kl_beta",
    ),
}


def _one_method(body: JobCreate) -> str:
    """The method's type; a 400 when another method's settings are given beside it."""
    method = body.method
    kind = method.type if method is not None else "supervised"
    for other in METHODS:
        if other != kind and method is not None and getattr(method, other) is not None:
            raise APIError(
                400,
                f"method.{other} is given with method.type {kind!r}: give method.{kind} instead",
                param=f"method.{other}",
                code="invalid_value",
            )
    if kind == "reinforcement" and (method is None or method.reinforcement is None):
        raise APIError(
            400,
            "method.reinforcement is missing: a reinforcement job needs its grader, e.g. "
            "method={'type': 'reinforcement', 'reinforcement': {'grader': {'type': 'string_check', ...}}}",
            param="method.reinforcement",
            code="invalid_value",
        )
    return kind


def _given_twice(top: HyperparametersIn, nested: HyperparametersIn, nested_param: str) -> APIError:
    given = [", ".join(sorted(hp.model_dump(exclude_unset=True))) for hp in (top, nested)]
    return APIError(
        400,
        f"Hyperparameters are given twice, with different values: at the top level ({given[0]}) "
        f"and in {nested_param} ({given[1]}). Give them all in "
        "one place: with the OpenAI SDK, method={'type': 'supervised', 'supervised': "
        "{'hyperparameters': {'n_epochs': 2, 'lora': {'r': 8}}}} (lora goes inside it, beside the "
        "others), or without method=, extra_body={'hyperparameters': {'n_epochs': 2, 'lora': {'r': 8}}}",
        param="hyperparameters",
        code="invalid_value",
    )


def _method_of(body: JobCreate, kind: str, hp: dict[str, Any]) -> dict[str, Any]:
    """The contract's method record: its type, its own settings taken out of ``hp``, a grader."""
    method: dict[str, Any] = {"type": kind}
    for name in OWN_SETTINGS[kind]:
        if name in hp:
            method[name] = hp.pop(name)
    if kind == "reinforcement":
        assert body.method is not None and body.method.reinforcement is not None
        method["grader"] = body.method.reinforcement.grader.model_dump(mode="json", exclude_unset=True)
        if "eval_interval" in hp:
            hp["eval_every"] = hp.pop("eval_interval")
    return method


def requested_method(body: JobCreate) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The request's method (``{"type": ..., **its settings}``), the hyperparameters it gave (only those)
    and where they were given (for error params)."""
    kind = _one_method(body)
    top = body.hyperparameters
    inner = getattr(body.method, kind, None) if body.method is not None else None
    nested: HyperparametersIn | None = inner.hyperparameters if inner is not None else None
    nested_param = f"method.{kind}.hyperparameters"
    if top is not None and nested is not None and top != nested:
        raise _given_twice(top, nested, nested_param)
    where = "hyperparameters" if top is not None or nested is None else nested_param
    hp = (top or nested or HyperparametersIn()).model_dump(mode="json", exclude_unset=True)
    method = _method_of(body, kind, hp)
    if "dpo" in hp:
        raise APIError(
            400,
            "hyperparameters.dpo is set: ask for DPO with method={'type': 'dpo', 'dpo': {'hyperparameters': "
            "{'beta': 0.1}}}",
            param=f"{where}.dpo",
            code="invalid_value",
        )
    return method, hp, where
