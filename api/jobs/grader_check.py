"""A reinforcement job's grader at create: checked as ``/v1/fine_tuning/alpha/graders/validate`` checks
one (trainer.graders.validate), its problems a 400 naming ``method.reinforcement.grader.<param>``; its
model graders' models resolved for the team (a 404 naming the grader's ``model`` otherwise) for the
workers to ask the serving process for (contract.serving.JudgeModels); and the item fields its templates
read, for the data check to find in the rows (api.jobs.data_check)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from api.core.errors import APIError
from api.model_names import served, team_model
from contract.graders import Grader
from contract.method import ReinforcementMethod
from contract.serving import JudgeModels, ServedModel
from store.settings import Settings

if TYPE_CHECKING:
    from trainer.graders.sandbox import SandboxLimits

#: Where a job's grader is in the create request.
GRADER_PARAM = "method.reinforcement.grader"


@dataclass(frozen=True)
class JobGrader:
    """What create learned of a job's grader: the item fields it reads, by the param that reads each,
    and its model graders' models resolved for the team (None: it has none)."""

    item_fields: dict[str, str] = field(default_factory=dict)
    judges: JudgeModels | None = None


def invalid_grader(problems: list[tuple[str, str]]) -> APIError:
    """The 400 of a grader's problems (trainer.graders.validate), naming the first one's param."""
    message = "; ".join(f"{where}: {msg}" for where, msg in problems)
    return APIError(400, f"Invalid grader: {message}", param=problems[0][0], code="invalid_grader")


def check_job_grader(
    session: Session,
    team_id: str,
    method: dict[str, Any],
    settings: Settings,
    *,
    serving_url: str,
    limits: SandboxLimits | None = None,
) -> JobGrader:
    """The job's grader checked (nothing for another method): a 400 for a problem, naming its param (a
    Python grader's source imported in the sandbox under ``limits``: the server's, worker.grading); a
    model grader's model resolved for the team, judged by the serving process at ``serving_url`` (none
    configured: a 400, as the workers would have nothing to ask)."""
    if method.get("type") != "reinforcement":
        return JobGrader()
    from trainer.graders.template import item_fields
    from trainer.graders.validate import grader_errors

    grader = ReinforcementMethod.model_validate(method).grader
    judges = _judges(session, team_id, grader, settings, serving_url)
    problems = grader_errors(
        grader, path=GRADER_PARAM, embeddings=bool(settings.grader_embedding_model), limits=limits
    )
    if problems:
        raise invalid_grader(problems)
    return JobGrader(item_fields(grader, GRADER_PARAM), judges)


def _judges(
    session: Session, team_id: str, grader: Grader, settings: Settings, serving_url: str
) -> JudgeModels | None:
    """The grader's model graders' models for the team; None when it has none."""
    from trainer.graders.validate import model_graders

    models: dict[str, ServedModel] = {}
    for param, model in model_graders(grader, GRADER_PARAM):
        if not serving_url:
            raise APIError(
                400,
                f"{param}: a training job's model graders are judged by the serving process, and this "
                "server runs none (ZENFLOW_API_INFERENCE_SERVER_URL; docs/graders.md): use "
                "string_check, text_similarity, python or multi of them here",
                param=param,
                code="invalid_grader",
            )
        if model not in models:
            models[model] = served(team_model(session, team_id, model, settings, param=param))
    return JudgeModels(team=team_id, models=models) if models else None


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
