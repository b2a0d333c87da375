"""What a scenario did, for the invariant checks to judge: the inputs the API accepted and what
went wrong on the way. Plain data; no Django, no processes."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass
class Posted:
    """An input the API accepted (202) as turn ``turn_id``."""

    turn_id: str
    session_id: str
    text: str
    posted_at: float  # wall clock, just before the POST was sent


@dataclass
class Record:
    """One scenario's record; ``row`` is its line of the table once checked."""

    name: str
    runs: int = 0
    posted: list[Posted] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    http_5xx: list[str] = field(default_factory=list)
    unanswered: list[tuple[str, str]] = field(default_factory=list)  # (session, text) posts that got no 202
    lock: threading.Lock = field(default_factory=threading.Lock)
    row: dict[str, Any] = field(default_factory=dict)
    expect_no_rotation: bool = False  # a scenario in which no thread may rotate (its rollouts are stored)
    worker_restarts: int = 0  # workers that exited on their own and were restarted, as a supervisor would
