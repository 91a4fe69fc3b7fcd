"""The team's storage quota at upload (``POST /v1/files``; the quota itself: store.quotas).

Checked twice, and nothing is kept for a refused upload:

1. before the body is read (:func:`receive_within_quota`): a team with no room left is refused at once,
   and the stream is cut (the temp file removed) as soon as the file passes the bytes left, or the
   server's ``max_upload_bytes`` when that is less;
2. before the file's row is written (:func:`check_upload_fits`), under the team's row lock: uploads
   and job outputs that took the room meanwhile are counted, and the placed file is removed again by
   the caller on refusal.

A refusal is a 400 ``quota_exceeded``, ``param`` ``storage_bytes`` (as a create over the storage quota):
it lasts until the team deletes files or fine-tuned models.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session
from starlette.requests import Request

from api.core.deps import run_db
from api.core.errors import APIError
from api.storage import ReceivedUpload, receive_upload
from store import quotas
from store.settings import Settings


def quota_error(limit: int, stored: int, size: int | None) -> APIError:
    """The 400 for an upload the team's storage quota has no room for."""
    left = max(0, limit - stored)
    what = (
        f"this file ({size:,} bytes) does not fit in the {left:,} bytes left"
        if size is not None
        else f"this file is larger than the {left:,} bytes left"
    )
    return APIError(
        400,
        f"Quota storage_bytes exceeded: the team stores {stored:,} of {limit:,} bytes and {what}; "
        "nothing was kept. Delete files or fine-tuned models to make room",
        param="storage_bytes",
        code="quota_exceeded",
        headers={"Connection": "close"},
    )


async def receive_within_quota(
    request: Request, incoming: Path, team_id: str, settings: Settings
) -> ReceivedUpload:
    """:func:`api.storage.receive_upload` with the limit the smaller of ``max_upload_bytes`` and the
    team's room (a 400 ``quota_exceeded`` when the file passes the room; at once when there is none)."""
    room = await run_db(request, quotas.storage_room, team_id, settings)
    if room is None:
        return await receive_upload(request, incoming, settings.max_upload_bytes)
    limit, stored = room
    left = limit - stored
    if left <= 0:
        raise quota_error(limit, stored, None)
    try:
        return await receive_upload(request, incoming, min(settings.max_upload_bytes, left))
    except APIError as exc:
        if exc.code == "file_too_large" and left < settings.max_upload_bytes:
            raise quota_error(limit, stored, None) from exc
        raise


def check_upload_fits(session: Session, team_id: str, settings: Settings, size: int) -> None:
    """Before a file of ``size`` bytes is recorded: the team's storage quota, under its row lock (held
    to the commit, so two uploads racing for the last room are decided one after the other)."""
    quotas.lock_team(session, team_id)
    room = quotas.storage_room(session, team_id, settings)
    if room is not None and room[1] + size > room[0]:
        raise quota_error(room[0], room[1], size)
