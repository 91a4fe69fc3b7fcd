"""What a served model is between the layers that ask for generations and the serving process: the
model as the API resolved it for a team (:class:`ServedModel`), the serving process's internal routes,
and the model graders' judges of a reinforcement job (:class:`JudgeModels`: resolved at create, so a
worker asks the serving process exactly what the API allowed)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: The serving process's routes for the API's (and a worker's judge's) calls: ``{"team", "model",
#: "request"}`` with the serving token (serving.server).
INTERNAL_PATHS = {"chat": "/internal/v1/chat/completions", "completions": "/internal/v1/completions"}


class ServedModel(BaseModel):
    """A model as the API resolved it for a team: its id (what the answers and vLLM call it), what the
    built-in backend loads (``source``: a built-in config's name or a model folder), and the LoRA
    adapter folder of a fine-tuned model trained with LoRA (vLLM loads it as ``id``)."""

    id: str
    source: str
    adapter_path: str | None = None


class JudgeModels(BaseModel):
    """A reinforcement job's model graders' models, resolved for the job's team when it was created
    (``models``: each grader's ``model`` as it names it); the team is the one the serving process
    admits and shares decode time by."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    team: str = Field(min_length=1)
    models: dict[str, ServedModel] = Field(min_length=1)
