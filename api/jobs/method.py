"""A create request's method and hyperparameters from wherever it gives them: the hyperparameters at the
top level (our extra) or in OpenAI's ``method`` (``method.supervised.hyperparameters`` or
``method.dpo.hyperparameters``, DPO's ``beta`` among them). The job's request (contract.job.JobRequest)
keeps the method apart: ``{"type": "dpo", "beta": ...}``; the job object shows it back in OpenAI's shape
(api.jobs.views.job_method)."""

from __future__ import annotations

from typing import Any

from api.core.errors import APIError
from api.schemas import HyperparametersIn, JobCreate


def _one_method(body: JobCreate) -> str:
    """The method's type; a 400 when the other method's settings are given beside it."""
    method = body.method
    kind = method.type if method is not None else "supervised"
    other = "supervised" if kind == "dpo" else "dpo"
    if method is not None and getattr(method, other) is not None:
        raise APIError(
            400,
            f"method.{other} is given with method.type {kind!r}: give method.{kind} instead",
            param=f"method.{other}",
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
    method: dict[str, Any] = {"type": kind}
    if kind == "dpo" and "beta" in hp:
        method["beta"] = hp.pop("beta")
    if "dpo" in hp:
        raise APIError(
            400,
            "hyperparameters.dpo is set: ask for DPO with method={'type': 'dpo', 'dpo': {'hyperparameters': "
            "{'beta': 0.1}}}",
            param=f"{where}.dpo",
            code="invalid_value",
        )
    return method, hp, where
