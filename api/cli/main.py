"""``zenflow``: serve, db upgrade/downgrade/current/check, teams, keys, quotas, and the trainer's ``train``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sqlalchemy import select

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from store.settings import Settings


def _settings() -> Settings:
    from store.settings import get_settings

    return get_settings()


def _session() -> Session:
    from sqlalchemy.orm import sessionmaker

    from store.db import make_engine

    engine = make_engine(_settings().resolved_database_url)
    return sessionmaker(bind=engine, expire_on_commit=False)()


def _ensure_schema() -> None:
    from api.migrate import upgrade

    upgrade(_settings().resolved_database_url)


def cmd_serve(args: argparse.Namespace) -> int:
    from api.server import serve

    return serve(
        host=args.host, port=args.port, worker=args.worker, reaper=args.reaper, log_level=args.log_level
    )


def cmd_db(args: argparse.Namespace) -> int:
    from api import migrate

    url = _settings().resolved_database_url
    if args.db_command == "upgrade":
        migrate.upgrade(url, args.revision)
        print(f"database at {migrate.current(url)} (head {migrate.head()})")
    elif args.db_command == "downgrade":
        migrate.downgrade(url, args.revision)
        print(f"database at {migrate.current(url) or 'base'}")
    elif args.db_command == "current":
        cur = migrate.current(url)
        print(f"{cur or 'base'}{' (head)' if cur == migrate.head() else ''}")
    elif args.db_command == "check":
        from alembic.util import CommandError

        try:
            migrate.check(url)
        except CommandError as exc:
            print(f"drift between store/orm.py and the migrations: {exc}", file=sys.stderr)
            return 1
        print("models and migrations agree")
    return 0


def cmd_teams(args: argparse.Namespace) -> int:
    from api.core.auth import TeamExistsError, create_team
    from store.orm import Team

    _ensure_schema()
    with _session() as session:
        if args.teams_command == "create":
            try:
                team = create_team(session, args.name)
            except (TeamExistsError, ValueError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            session.commit()
            print(f"team {team.name} created: {team.id}")
        else:
            for team in session.scalars(select(Team).order_by(Team.created_at)):
                print(f"{team.id}\t{team.name}")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from api.core.auth import TeamNotFoundError, create_key, find_team, revoke_key
    from store.orm import ApiKey

    _ensure_schema()
    with _session() as session:
        if args.keys_command == "create":
            try:
                team = find_team(session, args.team)
            except TeamNotFoundError as exc:
                print(f"error: {exc} (create it with: zenflow teams create NAME)", file=sys.stderr)
                return 1
            row, key = create_key(session, team, args.name)
            session.commit()
            if args.quiet:
                print(key)
            else:
                print(f"API key {row.id} for team {team.name} ({team.id}); shown once, store it now:")
                print(key)
        elif args.keys_command == "revoke":
            try:
                row = revoke_key(session, args.key)
            except LookupError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            session.commit()
            print(f"key {row.id} ({row.prefix}...) revoked")
        else:
            team = find_team(session, args.team)
            for row in session.scalars(select(ApiKey).where(ApiKey.team_id == team.id)):
                state = "revoked" if row.revoked_at else "active"
                print(f"{row.id}\t{row.prefix}...\t{row.name}\t{state}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from api.core.config import get_api_settings

    api = get_api_settings()
    parser = argparse.ArgumentParser(prog="zenflow", description="ZenFlow fine-tuning service")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the API (and, on embedded defaults, a worker) in one process")
    p.add_argument("--host", default=api.host)
    p.add_argument("--port", type=int, default=api.port)
    p.add_argument(
        "--worker",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start an in-process Celery worker (default: only with no broker configured)",
    )
    p.add_argument(
        "--reaper",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="re-queue jobs whose worker stopped sending heartbeats (default: with --worker)",
    )
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("db", help="database migrations")
    dbs = p.add_subparsers(dest="db_command", required=True)
    q = dbs.add_parser("upgrade", help="upgrade to a revision (default head)")
    q.add_argument("revision", nargs="?", default="head")
    q = dbs.add_parser("downgrade", help="downgrade to a revision (default -1; 'base' empties it)")
    q.add_argument("revision", nargs="?", default="-1")
    dbs.add_parser("current", help="print the current revision")
    dbs.add_parser("check", help="fail when store/orm.py and the migrations disagree")
    p.set_defaults(func=cmd_db)

    p = sub.add_parser("teams", help="teams (tenants)")
    ts = p.add_subparsers(dest="teams_command", required=True)
    q = ts.add_parser("create", help="create a team")
    q.add_argument("name")
    ts.add_parser("list", help="list teams")
    p.set_defaults(func=cmd_teams)

    p = sub.add_parser("keys", help="API keys")
    ks = p.add_subparsers(dest="keys_command", required=True)
    q = ks.add_parser("create", help="create a key for a team and print it once")
    q.add_argument("--team", required=True, help="team name or id")
    q.add_argument("--name", default="", help="a label for the key")
    q.add_argument("--quiet", "-q", action="store_true", help="print only the key")
    q = ks.add_parser("revoke", help="revoke a key (id or prefix)")
    q.add_argument("key")
    q = ks.add_parser("list", help="list a team's keys")
    q.add_argument("--team", required=True)
    p.set_defaults(func=cmd_keys)

    from api.cli.quotas import register as register_quotas
    from api.cli.storage import register as register_storage
    from trainer.cli import register
    from trainer.plan.cli import register as register_plan

    register_storage(sub)  # jobs purge, storage usage, storage sweep
    register_quotas(sub)  # quotas set, quotas show
    register(sub)
    register_plan(sub)  # plan
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
