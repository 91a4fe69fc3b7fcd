"""Helpers of the console's browser tests: the live server's handle (a team and key in its database) and
the page's problems as they come."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Page


@dataclass
class LiveServer:
    base_url: str
    database_url: str
    log: Path

    def team_key(self) -> tuple[str, str]:
        """A new team and key in the server's database: (team name, key)."""
        from sqlalchemy.orm import Session

        from api.core.auth import create_key, create_team
        from store.db import make_engine

        engine = make_engine(self.database_url)
        try:
            with Session(engine) as s:
                team = create_team(s, f"console-{secrets.token_hex(3)}")
                _, key = create_key(s, team, "console test")
                s.commit()
                return team.name, key
        finally:
            engine.dispose()

    def set_storage_quota(self, team_name: str, storage_bytes: int) -> None:
        """The team's own storage limit (a row of team_quotas, as ``zenflow quotas set`` writes)."""
        from sqlalchemy import select
        from sqlalchemy.orm import Session

        from store.db import make_engine
        from store.orm import Team, TeamQuota

        engine = make_engine(self.database_url)
        try:
            with Session(engine) as s:
                team = s.scalars(select(Team).where(Team.name == team_name)).one()
                s.merge(TeamQuota(team_id=team.id, storage_bytes=storage_bytes))
                s.commit()
        finally:
            engine.dispose()


def page_problems(page: Page) -> list[str]:
    """Uncaught exceptions and console errors (a CSP refusal is one) the page reports, as they come.
    Chromium also logs each 4xx answer as "Failed to load resource": those are expected here."""
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"uncaught: {exc}"))
    page.on(
        "console",
        lambda msg: (
            problems.append(msg.text)
            if msg.type == "error" and not msg.text.startswith("Failed to load resource")
            else None
        ),
    )
    return problems
