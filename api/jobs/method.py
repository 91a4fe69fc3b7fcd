"""A create request's hyperparameters from wherever it gives them: at the top level (our extra) or in
OpenAI's ``method`` (``method.supervised.hyperparameters`` or ``method.dpo.hyperparameters``). A DPO
job's carry ``dpo: {"beta": ...}`` (trainer.method.DpoSpec), the form the job row stores and the trainer
reads; the job object shows it back as ``method: {"type": "dpo", ...}`` (api.jobs.views.job_method)."""

from __future__ import annotations

from typing import Any

from api.core.errors import APIError
from api.schemas import HyperparametersIn, JobCreate


def requested_hyperparameters(body: JobCreate) -> tuple[dict[str, Any], str]:
    """The requested hyperparameters and where they were given (for error params). A DPO job's carry
    ``dpo: {"beta": ...}`` (trainer.method.DpoSpec; ``beta`` given beside the others in the request)."""
    method = body.method
    kind = method.type if method is not None else "supervised"
    if method is not None and getattr(method, "supervised" if kind == "dpo" else "dpo") is not None:
        other = "supervised" if kind == "dpo" else "dpo"
        raise APIError(
            400,
            f"method.{other} is given with method.type {kind!r}: give method.{kind} instead",
            param=f"method.{other}",
            code="invalid_value",
        )
    top = body.hyperparameters
    inner = getattr(method, kind, None) if method is not None else None
    nested: HyperparametersIn | None = inner.hyperparameters if inner is not None else None
    nested_param = f"method.{kind}.hyperparameters"
    if top is not None and nested is not None and top != nested:
        given = [", ".join(sorted(hp.model_dump(exclude_unset=True))) for hp in (top, nested)]
        raise APIError(
            400,
            f"Hyperparameters are given twice, with different values: at the top level ({given[0]}) "
            f"and in {nested_param} ({given[1]}). Give them all in "
            "one place: with the OpenAI SDK, method={'type': 'supervised', 'supervised': "
            "{'hyperparameters': {'n_epochs': 2, 'lora': {'r': 8}}}} (lora goes inside it, beside the "
            "others), or without method=, extra_body={'hyperparameters': {'n_epochs': 2, 'lora': {'r': 8}}}",
            param="hyperparameters",
            code="invalid_value",
        )
    where = "hyperparameters" if top is not None or nested is None else nested_param
    hp = (top or nested or HyperparametersIn()).model_dump(mode="json")
    if kind == "dpo":
        hp["dpo"] = {"beta": hp.pop("beta", "auto")}
    elif "dpo" in hp:
        raise APIError(
            400,
            "hyperparameters.dpo is set in a supervised job: ask for DPO with method={'type': 'dpo', "
            "'dpo': {'hyperparameters': {'beta': 0.1}}}",
            param=f"{where}.dpo",
            code="invalid_value",
        )
    return hp, where
