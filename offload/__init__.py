"""The ZenFlow offload engine (a library on its own: imports nothing from trainer/, api/ or store/).

Importing ``offload`` is cheap: the names below load on first use, and the C++ CPU optimizer (built
when the package is installed, :mod:`offload.cpu_adam_build`) is loaded only when a CPU step first runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offload.config import EngineConfig
    from offload.cpu_thread import CPUThreadError
    from offload.engine import ZenFlowEngine
    from offload.step_metrics import StepMetrics

__all__ = ["CPUThreadError", "EngineConfig", "StepMetrics", "ZenFlowEngine"]

_WHERE = {
    "EngineConfig": "offload.config",
    "StepMetrics": "offload.step_metrics",
    "ZenFlowEngine": "offload.engine",
    "CPUThreadError": "offload.cpu_thread",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'offload' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
