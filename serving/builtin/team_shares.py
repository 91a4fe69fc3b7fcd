"""Admission of built-in inference requests, shared fairly between teams.

The backend has ``slots`` admission slots (``inference_threads + inference_queue_size``): requests
admitted and not yet done, decoding or waiting. A team may hold at most its share of them,
``ceil(slots / T)`` with ``T`` the teams holding a slot now, the asking team counted. So a team alone may
use every slot, and as soon as a second team asks, the first can get no more than half until its
requests drain below that, while the second is admitted at once. Because a newcomer is admitted even
when the slots are all held by a team over its share, the total may pass ``slots`` for as long as those
requests take to finish; it never passes ``2 * slots`` (the hard bound of memory and waiting time),
beyond which every team is refused until requests finish.

Why a share of the moment rather than a fixed cap per team: a fixed cap either leaves slots idle when
one team is alone (cap < slots) or lets a few teams lock out the rest (cap * teams > slots); the share
adapts to the teams actually asking.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: its team at its share, or the backend at its hard bound."""

    team_held: int
    share: int
    teams: int
    total: int

    @property
    def team_full(self) -> bool:
        return self.team_held >= self.share


class TeamShares:
    """Slots held per team, and the share rule above; thread-safe."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.hard_limit = 2 * slots
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def held(self, team: str) -> int:
        with self._lock:
            return self._held[team]

    def share(self, teams: int) -> int:
        return math.ceil(self.slots / max(teams, 1))

    def admit(self, team: str) -> Refusal | None:
        """Take a slot for ``team``; a :class:`Refusal` (nothing taken) when it may not."""
        with self._lock:
            held = self._held[team]
            teams = len(self._held) + (0 if held else 1)
            share = self.share(teams)
            total = sum(self._held.values())
            if held >= share or total >= self.hard_limit:
                return Refusal(held, share, teams, total)
            self._held[team] = held + 1
            return None

    def release(self, team: str) -> None:
        with self._lock:
            if self._held[team] <= 1:
                self._held.pop(team, None)
            else:
                self._held[team] -= 1
