"""Where the serving process is (env prefix ``ZENFLOW_API_``, the names the API and the serving process
have always read): the API sends chat and completions there, and a worker's reinforcement job asks it
for its model graders' judgements (trainer.graders.serving_judge). Defined once here, under both;
``serving.config.ServingSettings`` extends it with the engine's own settings."""

from __future__ import annotations

from functools import lru_cache
from typing import Self

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServingEndpoint(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZENFLOW_API_", env_file=".env", extra="ignore")

    #: The serving process (``http://serving:8001``); empty: the API serves chat and completions itself,
    #: in its own process (the embedded default), and training jobs have no model graders' judge.
    inference_server_url: str = ""
    #: Shared by the API, the workers and the serving process: the serving process answers only requests
    #: that bear it (it trusts the team and the model folder they name), and refuses to start without one.
    inference_server_token: SecretStr = SecretStr("")
    #: A request (waiting included) ends with 504 / a stream error after this long, its generation
    #: stopped; its callers wait that long and a margin.
    inference_timeout_seconds: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _url_needs_token(self) -> Self:
        if self.inference_server_url and not self.inference_server_token.get_secret_value():
            raise ValueError("inference_server_url needs inference_server_token (the serving process's)")
        return self


@lru_cache(maxsize=1)
def get_serving_endpoint() -> ServingEndpoint:
    return ServingEndpoint()
