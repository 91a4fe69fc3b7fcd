"""``zenflow quotas set`` and ``zenflow quotas show``: a team's quotas (store.quotas), registered by api.cli.main.

``set`` changes only the quotas it is given; ``default`` puts one back to the server's default
(``ZENFLOW_DEFAULT_MAX_RUNNING_JOBS`` ..., unlimited unless configured)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from decimal import Decimal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

#: The value that puts a quota back to the server's default.
DEFAULT = "default"
#: Quota flag -> (quota name, the stored value of what was given).
_FLAGS: dict[str, tuple[str, Callable[[float], int | float]]] = {
    "max_running_jobs": ("max_running_jobs", int),
    "max_queued_jobs": ("max_queued_jobs", int),
    "gpu_hours": ("gpu_hours", float),
    "storage_gib": ("storage_bytes", lambda gib: int(gib * 2**30)),
}


def _value(parse: Callable[[str], float]) -> Callable[[str], float | str]:
    def check(text: str) -> float | str:
        if text == DEFAULT:
            return DEFAULT
        try:
            v = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r} (or '{DEFAULT}')") from None
        if not math.isfinite(v) or v < 0:
            raise argparse.ArgumentTypeError("must be a number >= 0 (or 'default')")
        return v

    return check


def _session() -> Session:
    from sqlalchemy.orm import sessionmaker

    from api.migrate import upgrade
    from store.db import make_engine
    from store.settings import get_settings

    url = get_settings().resolved_database_url
    upgrade(url)
    return sessionmaker(bind=make_engine(url), expire_on_commit=False)()


def _shown(name: str, value: float | None) -> str:
    if value is None:
        return "unlimited"
    if name == "storage_bytes":
        return f"{int(value):,} bytes ({value / 2**30:.2f} GiB)"
    if name == "gpu_hours":
        return _hours(value)
    return str(int(value))


def _hours(value: float) -> str:
    """Two decimals, or two significant digits below one hour: a short CPU job's 0.004 GPU-hours is
    not shown as 0.00."""
    if value == 0 or abs(value) >= 1:
        return f"{value:,.2f}"
    return format(Decimal(f"{value:.2g}"), "f")


def cmd_quotas(args: argparse.Namespace) -> int:
    from api.core.auth import TeamNotFoundError, find_team
    from store import quotas
    from store.settings import get_settings

    settings = get_settings()
    with _session() as session:
        try:
            team = find_team(session, args.team)
        except TeamNotFoundError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if args.quotas_command == "set":
            values: dict[str, int | float | None] = {}
            for flag, (name, stored) in _FLAGS.items():
                given = getattr(args, flag)
                if given is not None:
                    values[name] = None if given == DEFAULT else stored(given)
            if not values:
                print("error: give at least one quota to set (see --help)", file=sys.stderr)
                return 2
            quotas.set_limits(session, team.id, values)
            session.commit()
        limits = quotas.limits_for(session, team.id, settings)
        usage = quotas.as_dict(quotas.usage_for(session, team.id, settings))
    print(
        f"team {team.name} ({team.id}); GPU-hours counted over the last {settings.quota_period_days:g} days"
    )
    used = {"max_running_jobs": "running_jobs", "max_queued_jobs": "queued_jobs"}
    for name in quotas.QUOTAS:
        source = "team" if name in limits.own else "default"
        u = usage[used.get(name, name)]
        print(
            f"  {name:<17} limit {_shown(name, getattr(limits, name)):<32} ({source})  used {_shown(name, u)}"
        )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("quotas", help="per-team quotas: running and queued jobs, GPU-hours, storage")
    qs = p.add_subparsers(dest="quotas_command", required=True)
    q = qs.add_parser("set", help="set a team's quotas (the others keep theirs); 'default' resets one")
    q.add_argument("--team", required=True, help="team name or id")
    q.add_argument("--max-running-jobs", type=_value(int), help="jobs running at once (more wait their turn)")
    q.add_argument("--max-queued-jobs", type=_value(int), help="jobs waiting at once (a create beyond: 429)")
    q.add_argument(
        "--gpu-hours",
        type=_value(float),
        help="GPU-hours per rolling quota period (ZENFLOW_QUOTA_PERIOD_DAYS)",
    )
    q.add_argument("--storage-gib", type=_value(float), help="GiB stored: files, results, job outputs")
    q = qs.add_parser("show", help="a team's quotas and usage")
    q.add_argument("--team", required=True, help="team name or id")
    p.set_defaults(func=cmd_quotas)
