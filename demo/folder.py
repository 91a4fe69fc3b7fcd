"""The demo's data folder and the environment its CLI calls and server share with every ``zenflow``
command; the team and key it makes there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: The repository root: the CLI and the server run from it.
ROOT = Path(__file__).resolve().parents[1]


def data_folder(data_dir: Path | None = None) -> Path:
    """The demo's data folder by the rule of every ``zenflow`` command (:class:`store.settings.Settings`:
    ``ZENFLOW_DATA_DIR`` or ``.env``, default ``var``), or ``--data-dir``; absolute."""
    from store.settings import Settings

    return (data_dir if data_dir is not None else Settings().data_dir).resolve()


def service_env(data_dir: Path) -> dict[str, str]:
    """Our environment, ``ZENFLOW_*`` included, with the data folder made absolute (the CLI and the
    server run from the repository root)."""
    env = dict(os.environ)
    env["ZENFLOW_DATA_DIR"] = str(data_dir)
    env["ZENFLOW_MODEL_ROOTS"] = with_demo_root(env.get("ZENFLOW_MODEL_ROOTS", ""))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def with_demo_root(roots: str) -> str:
    """``ZENFLOW_MODEL_ROOTS`` (``:``-separated or a JSON list) with the demo base's root added."""
    from trainer.samples import MODELS_DIR

    if roots.strip().startswith("["):
        return json.dumps([*json.loads(roots), str(MODELS_DIR)])
    return ":".join([*filter(None, roots.split(":")), str(MODELS_DIR)])


def prepare(data_dir: Path, *, fresh: bool) -> dict[str, str]:
    """The data folder made (emptied first when ``fresh``); the environment of the CLI and the server."""
    if data_dir.exists() and fresh:
        shutil.rmtree(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    return service_env(data_dir)


def zenflow_cli(env: dict[str, str], *args: str) -> str:
    """``zenflow ARGS`` (``python -m api.cli.main``) in ``env``; its output."""
    out = subprocess.run(
        [sys.executable, "-m", "api.cli.main", *args],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def create_team(env: dict[str, str]) -> tuple[str, str]:
    """A new team and an API key for it, made with the CLI: ``(team, key)``."""
    team = f"demo-{int(time.time())}"
    print(zenflow_cli(env, "teams", "create", team))
    key = zenflow_cli(env, "keys", "create", "--team", team, "--name", "demo", "-q").splitlines()[-1]
    print(f"API key created for {team}: {key[:11]}... (shown once)")
    return team, key
