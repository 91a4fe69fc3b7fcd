"""The job contract: what a client asks of a fine-tuning job (:class:`JobRequest`) and what the job *is*
once decided (:class:`ResolvedJob`: every value concrete, each with its :data:`Source`), inside a
:class:`Resolution` (when, why, for which machine).

This package is the bottom of the service (pydantic only: no torch, no database). ``offload`` takes its
engine literals and the public engine settings' defaults from here, ``store`` keeps a job's request and
resolutions as these records, ``trainer`` turns a request into a resolution (:mod:`trainer.resolve`, the
one module that decides ``auto``), ``api`` shows both. Each setting, its default and its bounds are
defined once, here.
"""

from contract.engine import (
    DEFAULT_ACCUMULATOR,
    ENGINE_MODES,
    Accumulator,
    EngineKnobs,
    EngineMode,
    EngineRequest,
    ResolvedEngine,
)
from contract.hyperparameters import (
    RUNTIME_FIELDS,
    HyperparametersRequest,
    ResolvedHyperparameters,
    RuntimeChoices,
    SystemMessage,
    Truncation,
)
from contract.job import RESOLUTIONS, JobRequest, PlanOutcome, Resolution, ResolvedJob, Source
from contract.lora import LoraSpec
from contract.method import (
    DpoMethod,
    MethodName,
    MethodRequest,
    ResolvedDpo,
    ResolvedMethod,
    ResolvedSupervised,
    SupervisedMethod,
)
from contract.resources import MAX_GPUS_PER_NODE, MAX_NODES_PER_JOB, Resources
from contract.values import MAX_COUNT, Auto, Dtype

__all__ = [
    "DEFAULT_ACCUMULATOR",
    "ENGINE_MODES",
    "MAX_COUNT",
    "MAX_GPUS_PER_NODE",
    "MAX_NODES_PER_JOB",
    "RESOLUTIONS",
    "RUNTIME_FIELDS",
    "Accumulator",
    "Auto",
    "DpoMethod",
    "Dtype",
    "EngineKnobs",
    "EngineMode",
    "EngineRequest",
    "HyperparametersRequest",
    "JobRequest",
    "LoraSpec",
    "MethodName",
    "MethodRequest",
    "PlanOutcome",
    "Resolution",
    "ResolvedDpo",
    "ResolvedEngine",
    "ResolvedHyperparameters",
    "ResolvedJob",
    "ResolvedMethod",
    "ResolvedSupervised",
    "Resources",
    "RuntimeChoices",
    "Source",
    "SupervisedMethod",
    "SystemMessage",
    "Truncation",
]
