"""The demo's command line: ``python -m demo [--data-dir D] [--timeout S] [--fresh] [--stay]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import demo
from demo.flow import run
from demo.folder import data_folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo", description=(demo.__doc__ or "").splitlines()[0])
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="default: ZENFLOW_DATA_DIR (./var), as for every zenflow command",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the job")
    p.add_argument(
        "--fresh", action="store_true", help="delete the data folder first (its teams, keys, jobs)"
    )
    p.add_argument(
        "--keep", action="store_true", help=argparse.SUPPRESS
    )  # the default now; old scripts pass it
    p.add_argument(
        "--stay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep serving after the demo, for the console (default: when stdin is a terminal)",
    )
    args = p.parse_args(argv)
    stay = sys.stdin.isatty() if args.stay is None else args.stay
    return run(data_folder(args.data_dir), timeout=args.timeout, fresh=args.fresh, stay=stay)
