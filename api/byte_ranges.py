"""HTTP range requests (RFC 9110, sections 13.1.5 and 14) for a body of known length: which bytes a
``Range`` header asks for, and whether an ``If-Range`` validator still lets it.

One range per request: a header that is not ``bytes=``, names several ranges, or does not parse is
ignored (the whole body is sent, 200), as the RFC allows; a range that starts at or past the end is
unsatisfiable (416 with ``Content-Range: bytes */LENGTH``); a last position past the end is clamped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from email.utils import formatdate, parsedate_to_datetime

_RANGE = re.compile(r"^\s*(\d*)\s*-\s*(\d*)\s*$")


@dataclass(frozen=True)
class ByteRange:
    """Bytes ``[start, end)`` of a body of ``length`` bytes."""

    start: int
    end: int
    length: int

    @property
    def content_range(self) -> str:
        return f"bytes {self.start}-{self.end - 1}/{self.length}"


class RangeNotSatisfiable(Exception):
    def __init__(self, length: int) -> None:
        super().__init__(f"the requested range is not within the {length} bytes of the content")
        self.length = length

    @property
    def content_range(self) -> str:
        return f"bytes */{self.length}"


def parse_range(header: str | None, length: int) -> ByteRange | None:
    """The one range ``header`` asks of a body of ``length`` bytes; None: send the whole body.
    Raises :class:`RangeNotSatisfiable`."""
    if header is None:
        return None
    unit, sep, spec = header.partition("=")
    if not sep or unit.strip().lower() != "bytes" or "," in spec:
        return None
    m = _RANGE.match(spec)
    if m is None or m.group(1) == m.group(2) == "":
        return None
    first, last = m.group(1), m.group(2)
    if first == "":  # a suffix: the last N bytes
        n = int(last)
        if n == 0 or length == 0:
            raise RangeNotSatisfiable(length)
        return ByteRange(max(0, length - n), length, length)
    start = int(first)
    end = length if last == "" else int(last) + 1
    if last != "" and end <= start:  # last before first: an invalid range, ignored
        return None
    if start >= length:
        raise RangeNotSatisfiable(length)
    return ByteRange(start, min(end, length), length)


def http_date(seconds: float) -> str:
    return formatdate(seconds, usegmt=True)


def if_range_holds(header: str | None, *, etag: str, last_modified: int) -> bool:
    """Whether a ``Range`` may be honoured under ``If-Range`` (absent: yes): an entity tag must equal
    ``etag`` by strong comparison (a weak one never does), a date must be exactly ``last_modified``."""
    if header is None:
        return True
    value = header.strip()
    if value.startswith(('"', "W/")):
        return value == etag
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return False
    return when.tzinfo is not None and int(when.timestamp()) == last_modified
