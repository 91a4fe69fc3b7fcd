"""``zenflow jobs purge``, ``zenflow storage usage`` and ``zenflow storage sweep``: freeing and
accounting storage (api.retention, store.usage), registered by api.cli.main."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker


def _sessions() -> sessionmaker[Session]:
    from sqlalchemy.orm import sessionmaker

    from api.migrate import upgrade
    from store.db import make_engine
    from store.settings import get_settings

    url = get_settings().resolved_database_url
    upgrade(url)
    return sessionmaker(bind=make_engine(url), expire_on_commit=False)


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return n


def _gib(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)"


def cmd_jobs(args: argparse.Namespace) -> int:
    from api.retention import ForeignPathError, JobNotFinishedError, purge_job_outputs
    from store.settings import get_settings

    with _sessions()() as session:
        try:
            done = purge_job_outputs(session, args.job_id, jobs_dir=get_settings().resolved_jobs_dir)
        except (LookupError, JobNotFinishedError, ForeignPathError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    where = ", ".join(done.removed) or "nothing on disk"
    print(
        f"job {done.job_id}: removed {where}; {done.rows_deleted} checkpoint row(s); {_gib(done.freed_bytes)} freed"
    )
    return 0


def cmd_storage(args: argparse.Namespace) -> int:
    from api.core.config import get_api_settings
    from store.settings import get_settings

    sessions = _sessions()
    if args.storage_command == "usage":
        from api.core.auth import TeamNotFoundError, find_team
        from store.usage import team_storage_usage

        with sessions() as session:
            try:
                team = find_team(session, args.team)
            except TeamNotFoundError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            u = team_storage_usage(session, team.id)
        print(f"team {team.name} ({team.id})")
        print(f"  uploaded files  {_gib(u.uploads_bytes)}")
        print(f"  result files    {_gib(u.results_bytes)}")
        print(f"  job outputs     {_gib(u.jobs_bytes)}")
        print(f"  total           {_gib(u.total_bytes)}")
        return 0

    from api.retention import sweep

    keep = get_api_settings().retain_checkpoints if args.keep is None else args.keep
    done = sweep(sessions, keep=keep, jobs_dir=get_settings().resolved_jobs_dir)
    freed = sum(p.freed_bytes for p in done)
    print(
        f"retention (newest {keep} checkpoint(s) plus the final model per finished job): "
        f"{len(done)} job(s) changed, {sum(len(p.removed) for p in done)} path(s) removed, {_gib(freed)} freed"
    )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("jobs", help="fine-tuning jobs' stored outputs")
    js = p.add_subparsers(dest="jobs_command", required=True)
    q = js.add_parser("purge", help="remove a finished job's checkpoints and final model (frees its storage)")
    q.add_argument("job_id")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("storage", help="stored bytes per team; the retention policy")
    ss = p.add_subparsers(dest="storage_command", required=True)
    q = ss.add_parser("usage", help="a team's stored bytes: uploads, result files, job outputs")
    q.add_argument("--team", required=True, help="team name or id")
    q = ss.add_parser("sweep", help="hold every finished job to the retention policy once")
    q.add_argument(
        "--keep",
        type=_count,
        default=None,
        help="checkpoints kept per finished job (default ZENFLOW_API_RETAIN_CHECKPOINTS)",
    )
    p.set_defaults(func=cmd_storage)
