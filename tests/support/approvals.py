"""A "person" for approval tests: a thread that waits until an approval is pending and decides it,
while the test's own thread runs the turn that asked."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connection


def turn_with_person(run_turn_now: Callable[..., Any], *, session: Any, user: Any, text: str,
                     find_pending: Callable[[], Any], act: Callable[[Any], object], wait: float = 60.0) -> Any:
    """Run the turn for ``text`` (``run_turn_now``) while a thread polls ``find_pending()`` every 20 ms and,
    the first time it returns something, calls ``act`` with it (giving up after ``wait`` seconds).
    Returns the finished turn, once the thread is done too."""

    def person() -> None:
        deadline = time.monotonic() + wait
        try:
            while time.monotonic() < deadline:
                pending = find_pending()
                if pending:
                    act(pending)
                    return
                time.sleep(0.02)
        finally:
            connection.close()  # this thread's own connection

    thread = threading.Thread(target=person)
    thread.start()
    try:
        return run_turn_now(session=session, text=text, user=user)
    finally:
        thread.join()
