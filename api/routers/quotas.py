"""``GET /v1/quotas``: the calling team's quota limits and usage (our extra; see store.quotas)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session

from api.core.auth import Principal
from api.core.deps import SettingsDep, TeamDep, run_db
from api.core.errors import error_responses
from api.schemas import QuotaLimits, QuotaObject, QuotaUsage
from store import quotas
from store.settings import Settings

router = APIRouter(prefix="/v1/quotas", tags=["quotas"], responses=error_responses(401, 503))


@router.get("", response_model=QuotaObject)
async def get_quotas(request: Request, team: TeamDep, settings: SettingsDep) -> QuotaObject:
    """The team's limits (its own, else the server's defaults; null = unlimited) and what it uses:
    running and waiting jobs, GPU-hours in the rolling period, stored bytes."""
    return await run_db(request, _get_quotas, team, settings)


def _get_quotas(session: Session, team: Principal, settings: Settings) -> QuotaObject:
    limits = quotas.limits_for(session, team.team_id, settings)
    usage = quotas.usage_for(session, team.team_id, settings)
    return QuotaObject(
        organization_id=team.team_id,
        period_days=settings.quota_period_days,
        limits=QuotaLimits(**quotas.as_dict(limits)),
        usage=QuotaUsage(**quotas.as_dict(usage)),
        custom=[name for name in quotas.QUOTAS if name in limits.own],
    )
