"""Cursor (keyset) pagination in the OpenAI style: ``after`` = the last id of the previous page."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import InstrumentedAttribute, Session

DEFAULT_LIMIT = 20
MAX_LIMIT = 10_000

T = TypeVar("T")


def after_clause(
    cols: Sequence[InstrumentedAttribute[Any]], values: Sequence[Any], *, descending: bool
) -> Any:
    """Rows strictly beyond ``values`` in the (col1, col2, ...) order, without tuple comparisons."""
    terms = []
    for i, col in enumerate(cols):
        eqs = [c == v for c, v in zip(cols[:i], values[:i], strict=True)]
        cmp = col < values[i] if descending else col > values[i]
        terms.append(and_(*eqs, cmp))
    return or_(*terms)


def page(
    session: Session,
    stmt: Select[Any],
    cols: Sequence[InstrumentedAttribute[Any]],
    *,
    after: Sequence[Any] | None,
    limit: int,
    descending: bool,
) -> tuple[list[Any], bool]:
    """One page of ORM rows and whether more follow."""
    if after is not None:
        stmt = stmt.where(after_clause(cols, after, descending=descending))
    order = [c.desc() if descending else c.asc() for c in cols]
    rows = list(session.scalars(stmt.order_by(*order).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def list_object(
    data: list[T], has_more: bool, *, id_of: Callable[[T], str] = attrgetter("id")
) -> dict[str, Any]:
    """The OpenAI list object of one page, as plain data (validated by the endpoint's ``ListObject``
    response model): ``first_id``/``last_id`` are ``id_of`` of the first and last items, None when
    the page is empty."""
    return {
        "object": "list",
        "data": data,
        "has_more": has_more,
        "first_id": id_of(data[0]) if data else None,
        "last_id": id_of(data[-1]) if data else None,
    }
