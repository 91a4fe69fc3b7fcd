"""Inside the sandbox: run the user's grader (``python -I -S -c <this file's text>``, started by
:mod:`.sandbox_child` in the sandbox's root, where this file is not visible).

Reads the request (JSON: ``op`` ``"grade"`` or ``"check"``, ``source``, and for ``grade`` the
``sample`` and ``item``) from stdin and writes one JSON result to the stdout it was given: ``{"value":
number}``, or ``{"error": "runtime" | "invalid", "details": ...}``. Before any user code runs, fd 1
becomes the stderr the server gave (``/dev/null``): the grader's prints go nowhere, and only this file
writes the result. The details name the exception and the grader's own line, never a path.
"""

from __future__ import annotations

import builtins
import inspect
import json
import math
import numbers
import os
import sys
import traceback
from typing import Any

FILENAME = "<grader>"
MAX_DETAILS = 500
#: Where the sandbox mounts the allowed packages (see :data:`trainer.graders.sandbox.ALLOWED_PACKAGES`).
PACKAGES = "/pkgs"


class GraderFailure(Exception):
    def __init__(self, kind: str, details: str) -> None:
        super().__init__(details)
        self.kind = kind
        self.details = details


def _short(text: str) -> str:
    return text if len(text) <= MAX_DETAILS else text[: MAX_DETAILS - 3] + "..."


def describe(exc: BaseException, source: str) -> str:
    """``Type: message (line N, in f: the line)``, N the last frame of the grader's own code."""
    head = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, SyntaxError):
        return f"SyntaxError at line {exc.lineno}: {exc.msg}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == FILENAME]
    if not frames:
        return head
    last = frames[-1]
    lines = source.splitlines()
    lineno = last.lineno or 0
    text = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
    return f"{head} (line {lineno}, in {last.name}: {text})"


def load(source: str) -> Any:
    """The grader's ``grade``, after running its module (user code)."""
    namespace: dict[str, Any] = {"__name__": "grader", "__builtins__": builtins}
    try:
        exec(compile(source, FILENAME, "exec"), namespace)
    except BaseException as exc:
        raise GraderFailure("runtime", describe(exc, source)) from None
    grade = namespace.get("grade")
    if not callable(grade):
        raise GraderFailure("invalid", "source does not define grade(sample, item)")
    return grade


def check_signature(grade: Any) -> None:
    try:
        inspect.signature(grade).bind(None, None)
    except (TypeError, ValueError):
        raise GraderFailure("invalid", "grade must take two parameters: grade(sample, item)") from None


def as_number(value: Any) -> float:
    """The grade as a float: a real number (int, float, numpy's), finite; a bool is not a number here."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GraderFailure("invalid", f"grade returned {type(value).__name__}, not a number")
    try:
        number = float(value)
    except Exception as exc:
        raise GraderFailure(
            "invalid", f"grade returned {type(value).__name__}: {describe(exc, '')}"
        ) from None
    if not math.isfinite(number):
        raise GraderFailure("invalid", f"grade returned {number}, not a finite number")
    return number


def grade(request: dict[str, Any]) -> dict[str, Any]:
    source = request["source"]
    fn = load(source)
    try:
        value = fn(request["sample"], request["item"])
    except BaseException as exc:
        raise GraderFailure("runtime", describe(exc, source)) from None
    return {"value": as_number(value)}


def check(request: dict[str, Any]) -> dict[str, Any]:
    check_signature(load(request["source"]))
    return {"ok": True}


def respond(request: dict[str, Any]) -> dict[str, Any]:
    try:
        return grade(request) if request["op"] == "grade" else check(request)
    except GraderFailure as failure:
        return {"error": failure.kind, "details": _short(failure.details)}


def main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    me = os.getpid()
    out = os.dup(1)
    os.dup2(2, 1)  # the grader's prints: the server's /dev/null
    os.close(0)
    if os.path.isdir(PACKAGES):
        sys.path.append(PACKAGES)
    try:
        answer = json.dumps(respond(request))
    except BaseException as exc:  # a MemoryError building the answer, the grader's own exit
        answer = json.dumps({"error": "runtime", "details": type(exc).__name__})
    if os.getpid() == me:  # not a process the grader forked
        os.write(out, answer.encode())
    os._exit(0)  # not waiting for threads the grader left running


if __name__ == "__main__":
    main()
