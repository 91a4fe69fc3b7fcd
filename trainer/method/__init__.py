"""The fine-tuning methods: each a module owning its data, its loss and its metrics (:mod:`.supervised`,
:mod:`.dpo`), behind :class:`~trainer.method.base.TrainingMethod`; :func:`method_for` picks a resolved
job's. A new method is a module here and a member of ``contract.method``'s unions."""

from __future__ import annotations

import importlib

from contract.method import MethodName, ResolvedMethod
from trainer.method.base import TrainingMethod

#: Each method's module and class (imported when a run uses it: the methods import torch lazily, but
#: their modules are a run's, not the API's).
METHODS: dict[MethodName, str] = {
    "supervised": "trainer.method.supervised:SupervisedTraining",
    "dpo": "trainer.method.dpo:DpoTraining",
    "reinforcement": "trainer.method.reinforcement:ReinforcementTraining",
}


def method_for(resolved: ResolvedMethod) -> TrainingMethod:
    """The run's method of a resolved job (its class's ``of(resolved)``)."""
    module, name = METHODS[resolved.type].split(":")
    cls = getattr(importlib.import_module(module), name)
    method: TrainingMethod = cls.of(resolved)
    return method
