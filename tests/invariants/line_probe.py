"""Which of some source lines a test run executes, in every Python process it starts (``check_breakages.py``).

``check_breakages.py`` copies this file as ``sitecustomize.py`` into a directory it puts first on
``PYTHONPATH``, so that every interpreter of the run imports it at start-up: pytest itself and the
processes the tests start (the API server, Celery workers, ``manage.py``), forked children included (a
fork keeps its parent's trace function). With ``HERMES_LINE_PROBE`` set (JSON ``{path: [line, ...]}``)
it traces only frames of those files (``sys.settrace``, ``threading.settrace``) and appends each wanted
line the first time this process runs it to ``$HERMES_LINE_PROBE_OUT/<pid>`` as ``path:line`` — at once,
because a process may end by ``os._exit`` with nothing flushed. Without the variables it does nothing.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from types import FrameType
from typing import Any


def start(spec: str, out: str) -> None:
    """Trace the lines of ``spec`` (JSON ``{path: [line, ...]}``), recording hits under the directory ``out``."""
    wanted: dict[str, set[int]] = {os.path.realpath(path): set(lines) for path, lines in json.loads(spec).items()}
    by_name: dict[str, set[int] | None] = {}  # a code object's co_filename -> its file's wanted lines

    def lines_of(frame: FrameType) -> set[int] | None:
        name = frame.f_code.co_filename
        if name not in by_name:
            by_name[name] = wanted.get(os.path.realpath(name))
        return by_name[name]

    def record(path: str, line: int) -> None:
        with open(os.path.join(out, str(os.getpid())), "a") as fh:
            fh.write(f"{os.path.realpath(path)}:{line}\n")

    def trace_lines(frame: FrameType, event: str, arg: Any) -> Any:
        lines = lines_of(frame)
        if not lines:
            return None  # every wanted line of this file has run in this process
        if event == "line" and frame.f_lineno in lines:
            lines.discard(frame.f_lineno)
            record(frame.f_code.co_filename, frame.f_lineno)
        return trace_lines

    def trace_calls(frame: FrameType, event: str, arg: Any) -> Any:
        return trace_lines if lines_of(frame) else None

    threading.settrace(trace_calls)
    sys.settrace(trace_calls)


if os.environ.get("HERMES_LINE_PROBE") and os.environ.get("HERMES_LINE_PROBE_OUT"):
    start(os.environ["HERMES_LINE_PROBE"], os.environ["HERMES_LINE_PROBE_OUT"])
