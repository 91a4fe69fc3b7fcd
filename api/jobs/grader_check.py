"""A reinforcement job's grader at create: checked as ``/v1/fine_tuning/alpha/graders/validate`` checks
one (trainer.graders.validate), its problems a 400 naming ``method.reinforcement.grader.<param>``; and
the item fields its templates read, for the data check to find in the rows (api.jobs.data_check)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from api.core.errors import APIError
from contract.method import ReinforcementMethod

if TYPE_CHECKING:
    from trainer.graders.sandbox import SandboxLimits

#: Where a job's grader is in the create request.
GRADER_PARAM = "method.reinforcement.grader"


def invalid_grader(problems: list[tuple[str, str]]) -> APIError:
    """The 400 of a grader's problems (trainer.graders.validate), naming the first one's param."""
    message = "; ".join(f"{where}: {msg}" for where, msg in problems)
    return APIError(400, f"Invalid grader: {message}", param=problems[0][0], code="invalid_grader")


def check_job_grader(method: dict[str, Any], limits: SandboxLimits | None = None) -> dict[str, str]:
    """The item fields the job's grader reads, by the param that reads each (empty for another method);
    a 400 for a grader with a problem, naming its param (a Python grader's source imported in the
    sandbox under ``limits``: the server's, worker.grading)."""
    if method.get("type") != "reinforcement":
        return {}
    from trainer.graders.template import item_fields
    from trainer.graders.validate import grader_errors, model_graders

    grader = ReinforcementMethod.model_validate(method).grader
    if (found := next(model_graders(grader, GRADER_PARAM), None)) is not None:
        param = found[0]
        raise APIError(
            400,
            f"{param}: model graders (score_model, label_model) are not available in training jobs on this "
            "server yet: the workers have no serving endpoint to ask; use string_check, text_similarity, "
            "python or multi of them (model graders run in /v1/fine_tuning/alpha/graders/run)",
            param=param,
            code="invalid_grader",
        )
    problems = grader_errors(grader, path=GRADER_PARAM, limits=limits)
    if problems:
        raise invalid_grader(problems)
    return item_fields(grader, GRADER_PARAM)


def missing_item_fields(fields: dict[str, str], have: list[str] | None, file_param: str) -> APIError | None:
    """A 400 naming the grader's param whose item field no row of the file has (None: all there)."""
    if have is None:
        return None
    for name, param in fields.items():
        if name not in have:
            shown = ", ".join(sorted(have)[:20])
            return APIError(
                400,
                f"{param} reads {{{{item.{name}}}}}, but no row of the {file_param.replace('_', ' ')} has a "
                f"field {name!r} (its rows have: {shown})",
                param=param,
                code="invalid_grader",
            )
    return None
