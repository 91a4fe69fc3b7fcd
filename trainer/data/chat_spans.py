"""Where a rendered conversation's learned assistant turns are: the character spans that carry loss,
found in time linear in the conversation's length.

A learned turn's span runs from the end of the conversation before it rendered with the generation
prompt to where the conversation up to and including it stops agreeing with the whole conversation
(trainer.data.chat_format). Rendering every prefix of a conversation of N messages renders O(N^2)
messages (a 4000-message line took minutes); here a prefix is rendered only for turns among the first
:data:`EXACT_PREFIX_MESSAGES` messages (and for the first learned turn after the head, which is the
first exchange up to its assistant reply). A later turn is rendered in a window: the head, then the
messages since the previous learned turn. The window's text after the head (its last ``len(window) -
len(head with the generation prompt)`` characters, which hold no head text) is searched for in the
whole text near where the previous turn ended; found, the span starts where that text ends there and
ends where the window's reply stops agreeing with the whole text. A template whose rendering of a
turn depends on more than the head and the turn's own exchange (the window's text is not found)
gives the remaining turns the fallback: the turn's content found in the text after the previous span
(plus eos when it follows), the same fallback prefixes take when a template refuses a partial
conversation. Every search is bounded by what the window rendered, so one record costs
O(length x a constant) whatever its template.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Span = tuple[int, int]
#: ``render(messages, add_generation_prompt) -> text`` (the template with its tools bound).
Render = Callable[[list[dict[str, Any]], bool], str]

#: Turns within the first this many messages are found by rendering their whole prefix (as before
#: windows existed: short conversations, nearly all data, come out the same whatever the template).
EXACT_PREFIX_MESSAGES = 32
#: Head message contents are shortened to this in windows (a long first exchange is not rendered again
#: with every window; what the window's text is matched on never holds head text).
_HEAD_CONTENT = "x"
#: Slack of the bounded searches, in characters (template text around a turn beyond its window's).
_SLACK = 1024


def common_prefix(a: str, b: str, i: int = 0, j: int = 0) -> int:
    """Length of the common prefix of ``a[i:]`` and ``b[j:]``, by doubling block compares (C speed)."""
    n = min(len(a) - i, len(b) - j)
    done, step = 0, 64
    while done < n:
        k = min(step, n - done)
        if a[i + done : i + done + k] == b[j + done : j + done + k]:
            done += k
            step *= 2
            continue
        if k <= 16:
            while a[i + done] == b[j + done]:
                done += 1
            return done
        step = k // 2
    return n


def located(full: str, content: str, eos: str, start: int, end: int | None = None) -> Span | None:
    """The fallback span: ``content`` found in ``full[start:end]``, plus ``eos`` right after it."""
    at = full.find(content, start, end) if content else -1
    if at < 0:
        return None
    stop = at + len(content)
    if eos and full.startswith(eos, stop):
        stop += len(eos)
    return at, stop


@dataclass
class _Turn:
    """What one learned turn's rendering gave: its span, and where its generated part starts in the
    whole text with the length of its window's rendering of it (for bounding the next search)."""

    span: Span | None
    start: int | None
    rendered: int


def _prefix_turn(render: Render, full: str, msgs: list[dict[str, Any]], i: int, cursor: int) -> _Turn:
    """The span of turn ``i`` by rendering its prefix (the definition)."""
    try:
        before = render(msgs[:i], True)
        upto = render(msgs[: i + 1], False)
    except Exception:  # templates that refuse partial conversations
        return _Turn(None, None, 0)
    if not full.startswith(before):
        return _Turn(None, None, len(upto) - len(before))
    end = common_prefix(upto, full)
    span = (len(before), end) if len(before) >= cursor and end > len(before) else None
    return _Turn(span, len(before), len(upto) - len(before))


def _light(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    return {**m, "content": _HEAD_CONTENT} if isinstance(content, str) and len(content) > 1 else m


class _Windows:
    """Renders learned turns in windows (see the module docstring)."""

    def __init__(self, render: Render, full: str, msgs: list[dict[str, Any]], q: int) -> None:
        self.render, self.full, self.msgs = render, full, msgs
        self.head = [_light(m) for m in msgs[:q]]
        self.head_len: int | None = None  # the head rendered with the generation prompt
        self.ok = True

    def turn(self, i: int, p: int, lo: int, allowance: int, cursor: int) -> _Turn | None:
        """Turn ``i`` in the window head + msgs[p:i+1], its text searched for in full from ``lo`` (within
        ``2 * allowance`` and slack). None when the window's text is not found, or the template refuses
        it (the caller stops using windows); a turn with nothing before it in its window (an assistant
        message right after the previous learned one) has no text to search for: no span, no start."""
        try:
            if self.head_len is None:
                self.head_len = len(self.render(self.head, True))
            before = self.render(self.head + self.msgs[p:i], True)
            upto = self.render(self.head + self.msgs[p : i + 1], False)
        except Exception:
            return None
        h = self.head_len
        pattern_len = len(before) - h
        if pattern_len <= 0 or not upto.startswith(before[h:], h):
            return _Turn(None, None, len(upto) - len(before))
        hi = min(len(self.full), lo + 2 * allowance + pattern_len + _SLACK)
        at = self.full.find(before[h:], lo, hi)
        if at < 0:
            return None
        start = at + pattern_len
        end = start + common_prefix(upto, self.full, len(before), start)
        span = (start, end) if start >= cursor and end > start else None
        return _Turn(span, start, len(upto) - len(before))


def _text_len(msgs: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) if isinstance(m.get("content"), str) else 0 for m in msgs)


def loss_spans(render: Render, full: str, msgs: list[dict[str, Any]], eos: str) -> list[Span]:
    """The learned assistant turns' spans in ``full`` (``render(msgs, False)``), in order, disjoint."""
    assistants = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not assistants:
        return []
    search = _Search(render, full, msgs, eos, q=assistants[0] + 1)
    spans: list[Span] = []
    prev: int | None = None  # the previous learned turn
    for i in assistants:
        if msgs[i].get("weight", 1) == 0:
            continue
        since = 0 if prev is None else prev + 1  # the messages this turn adds to the previous one's
        span = search.span(i, since)
        if span is not None:
            spans.append(span)
        prev = i
    return spans


class _Search:
    """The learned turns' spans found one after the other, each search bounded by the previous one's."""

    def __init__(self, render: Render, full: str, msgs: list[dict[str, Any]], eos: str, q: int) -> None:
        self.render, self.full, self.msgs, self.eos = render, full, msgs, eos
        self.q = q  # the head: the first exchange, up to its assistant reply
        self.windows = _Windows(render, full, msgs, q)
        self.cursor = 0  # the end of the last span
        # where the next window's text may start: full[lo:], within 2 x allowance
        self.lo, self.allowance = 0, len(full)

    def span(self, i: int, since: int) -> Span | None:
        """Learned turn ``i``'s span, msgs[since:i] the messages since the previous learned turn."""
        exact = i < EXACT_PREFIX_MESSAGES or since <= self.q  # the window would be the whole prefix
        turn = self._rendered(i, since, exact)
        span = turn.span if turn is not None else None
        if span is None:  # the fallback: the content in the text after the previous span
            bound = min(len(self.full), self._fallback_bound(i, since, exact, turn))
            span = located(self.full, self.msgs[i]["content"], self.eos, self.cursor, bound)
        self._advance(i, since, turn, span)
        return span

    def _rendered(self, i: int, since: int, exact: bool) -> _Turn | None:
        """The turn by its prefix (``exact``) or its window while windows work (None: neither)."""
        if exact:
            return _prefix_turn(self.render, self.full, self.msgs, i, self.cursor)
        if not self.windows.ok:
            return None
        turn = self.windows.turn(i, since, self.lo, self.allowance, self.cursor)
        self.windows.ok = turn is not None
        return turn

    def _fallback_bound(self, i: int, since: int, exact: bool, turn: _Turn | None) -> int:
        """Where the fallback's search for the content stops."""
        if exact:
            return len(self.full)
        if turn is not None and turn.start is not None:
            return turn.start + 2 * turn.rendered + _SLACK
        return self.cursor + 2 * _text_len(self.msgs[since : i + 1]) + _SLACK * (i + 1 - since)

    def _advance(self, i: int, since: int, turn: _Turn | None, span: Span | None) -> None:
        """Where the next turn's window text is searched for, and the cursor past this turn's span."""
        if turn is not None and turn.start is not None:
            self.lo, self.allowance = turn.start + 1, turn.rendered
        elif span is not None:
            self.lo, self.allowance = span[0] + 1, span[1] - span[0]
        else:
            self.allowance += 2 * _text_len(self.msgs[since : i + 1]) + _SLACK * (i + 1 - since)
        if span is not None:
            self.cursor = span[1]
