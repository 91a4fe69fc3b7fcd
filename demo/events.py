"""A job's events as the demo prints them, from the API's server-sent event stream."""

from __future__ import annotations

import json
import time
from typing import Any


def follow_events(base: str, key: str, job_id: str, timeout: float) -> None:
    """Print the job's events from its SSE stream until it ends (reconnecting with Last-Event-ID)."""
    import httpx

    last: str | None = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        headers = {"Authorization": f"Bearer {key}", "Accept": "text/event-stream"}
        if last:
            headers["Last-Event-ID"] = last
        try:
            with httpx.stream(
                "GET",
                f"{base}/v1/fine_tuning/jobs/{job_id}/events",
                headers=headers,
                timeout=httpx.Timeout(10, read=60),
            ) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        last = line[4:]
                    elif line.startswith("data: "):
                        data = line[6:]
                        if data == "[DONE]":
                            return
                        print_event(json.loads(data))
        except httpx.HTTPError as exc:
            print(f"  (event stream interrupted: {exc}; reconnecting)")
            time.sleep(1)
    raise RuntimeError("the job did not finish in time")


def print_event(ev: dict[str, Any]) -> None:
    """One line per event; per-step metrics events only every 16th step (the rest are in /metrics)."""
    raw = ev.get("data")
    data: dict[str, Any] = raw if isinstance(raw, dict) else {}
    step = data.get("step")
    if (
        ev.get("type") == "metrics"
        and isinstance(step, int)
        and step % 16
        and step not in (1, data.get("total_steps"))
    ):
        return
    stamp = time.strftime("%H:%M:%S", time.localtime(ev["created_at"]))
    msg = ev["message"]
    if ev.get("type") == "metrics" and isinstance(data.get("stall_fraction"), int | float):
        msg = f"{msg} (stall {data['stall_fraction']:.1%})"
    print(f"  {stamp} {ev['level']:5s} {msg}")
