"""Builds the C++ CPU optimizer into the package at install time (metadata: pyproject.toml).

``build_ext`` runs offload/cpu_adam_build.py's :func:`build_installed` with the torch of the
environment that runs the build, which must be the one the jobs use: install with
``pip install --no-build-isolation`` after torch (scripts/bootstrap.sh and the Dockerfile do).  An
isolated build has no torch (pyproject's build requirements leave it out on purpose: they would pull a
second, CUDA torch whose ABI the jobs' torch need not share); it then installs without the extension
and says so, and ``python -m offload.cpu_adam_build`` builds it later.  ``ZENFLOW_CPU_ADAM_BUILD``:
``auto`` (default; skip without torch, compiler or ninja), ``require`` (those are errors) or ``skip``.
A failing compile always fails the install.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from setuptools import setup  # type: ignore[import-untyped]  # no py.typed, no stubs in the venv
from setuptools.command.build_ext import build_ext  # type: ignore[import-untyped]
from setuptools.dist import Distribution  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parent


def _builder() -> ModuleType:
    """offload/cpu_adam_build.py by file path (importing the package would need its dependencies)."""
    spec = importlib.util.spec_from_file_location(
        "_zenflow_cpu_adam_build", ROOT / "offload" / "cpu_adam_build.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class BuildCpuAdam(build_ext):  # type: ignore[misc]
    """Puts offload/_ext/zenflow_cpu_adam.so (+ manifest) into the build, or the source tree when editable."""

    def run(self) -> None:
        mode = os.environ.get("ZENFLOW_CPU_ADAM_BUILD", "auto").strip().lower()
        if mode == "skip":
            return
        try:
            import torch  # noqa: F401
        except ImportError:
            self._skip(mode, "torch is not importable in the build environment (use --no-build-isolation)")
            return
        b = _builder()
        inplace = bool(self.editable_mode or self.inplace)
        dest = (ROOT if inplace else Path(self.build_lib)) / "offload" / "_ext"
        try:
            built = b.build_installed(
                dest, [ROOT / "offload" / "csrc" / "cpu_adam.cpp"], [ROOT / "offload" / "csrc"]
            )
        except b.CpuAdamToolchainMissing as exc:
            self._skip(mode, str(exc))
            return
        if not inplace:  # a wheel need not carry the build's lock file
            (dest / b.LOCK_FILE).unlink(missing_ok=True)
        print(f"zenflow CPU Adam: {'built' if built else 'up to date'} in {dest}", file=sys.stderr)

    @staticmethod
    def _skip(mode: str, why: str) -> None:
        msg = f"zenflow CPU Adam extension not built: {why}; run `python -m offload.cpu_adam_build` after install"
        if mode == "require":
            raise SystemExit(msg)
        print(f"WARNING: {msg}", file=sys.stderr)

    def get_outputs(self) -> list[str]:
        return []

    def get_output_mapping(self) -> dict[str, str]:
        return {}


class BinaryDistribution(Distribution):  # type: ignore[misc]
    """The wheel carries a platform-specific .so: not a py3-none-any wheel."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_ext": BuildCpuAdam}, distclass=BinaryDistribution)
