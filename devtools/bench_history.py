"""``make bench``'s long-history part: a turn in a session with 100,000 prior messages against one with 10.

Both sessions get their transcript by bulk SQL (``INSERT … SELECT generate_series``) before the timed
turns. Two kinds of turn read the history, and each is timed through the whole stack:

* **first turn**: the session has no binding (an operator ended it just before) → ``thread/start`` with
  the history seed;
* **rotation**: the session's binding names a thread whose stored rollout was deleted just before (and
  the session's CODEX_HOME is wiped at every turn, so no file is left) → codex answers ``no rollout
  found`` → a fresh, seeded thread.

The seed is tail-capped (``HERMES_HISTORY_SEED_MAX_CHARS``); the small session's ten rows are long enough
to fill that cap too, so both sides send codex the same amount of text and the ratio shows only what
the history's length costs (reading the bounded tail), not a bigger model input.

The rounds run back to back after ``make bench``'s latency rounds (``--history-runs`` of them, whatever
``--runs`` is). In each round a kind's two turns — long session, short session, in alternating order —
are timed one right after the other, and the figure is the median of those per-pair ratios
(``bench_figures.ratio_spread``: with its quartiles and the 95 % confidence interval of the median), so
the machine's drift, which hits a pair's two turns alike, cancels pair by pair.
"""
from __future__ import annotations

import sys
import time
import uuid
from typing import Any

from devtools.bench_figures import paired_ratios

BIG, SMALL = 100_000, 10
# The big session's rows: user ~200 characters, assistant ~600 (chat-like); the small one's: long
# enough that ten of them fill the seed's cap as the big session's tail does.
BIG_CHARS = (200, 600)


def seed_messages(session_id: str, count: int, *, user_chars: int, assistant_chars: int) -> None:
    """Append ``count`` transcript rows (user, assistant, user, … with no turn) to ``session_id`` in one
    ``INSERT … SELECT generate_series`` and move ``last_message_seq`` on; its own transaction."""
    from django.db import connection, transaction

    from hermes_sessions.models import Message, Session

    messages, sessions = Message._meta.db_table, Session._meta.db_table
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(f"SELECT last_message_seq FROM {sessions} WHERE id = %s FOR UPDATE", [session_id])
        start = cur.fetchone()[0] + 1
        cur.execute(
            f"""INSERT INTO {messages} (session_id, seq, turn_id, role, content, tool_calls, tool_call_id,
                                        reasoning, codex_item_id, created_at)
                SELECT %(s)s, g, NULL,
                       CASE WHEN g %% 2 = 1 THEN 'user' ELSE 'assistant' END,
                       left('message ' || g || ': ' || repeat(md5(g::text) || ' ', %(n)s),
                            CASE WHEN g %% 2 = 1 THEN %(u)s ELSE %(a)s END),
                       NULL, '', '', '', now()
                FROM generate_series(%(start)s, %(end)s) AS g""",
            {"s": session_id, "start": start, "end": start + count - 1, "u": user_chars, "a": assistant_chars,
             "n": max(user_chars, assistant_chars) // 33 + 1},
        )
        cur.execute(f"UPDATE {sessions} SET last_message_seq = %s WHERE id = %s", [start + count - 1, session_id])
    with connection.cursor() as cur:
        cur.execute(f"ANALYZE {messages}")  # as autovacuum would after a load like this


def small_row_chars() -> int:
    """Row length at which ``SMALL`` rows fill the history seed's cap (with a tenth to spare)."""
    from django.conf import settings

    return settings.HERMES_HISTORY_SEED_MAX_CHARS * 11 // (10 * SMALL)


def end_binding(session_id: str) -> None:
    """No binding: the next turn is a first turn (``thread/start`` + seed)."""
    from hermes_sessions.models import Session
    from hermes_sessions.services.bindings import binding_end

    binding_end(session=Session.objects.get(pk=session_id), reason="make bench: a first turn")


def lose_thread(session_id: str) -> str:
    """Delete the stored rollout of the session's bound thread (the next turn rotates); its thread id."""
    from hermes_sessions.models import CodexBinding
    from hermes_sessions.services.rollouts import rollout_forget

    binding = CodexBinding.objects.get(session_id=session_id, status=CodexBinding.Status.ACTIVE)
    if not rollout_forget(thread_id=binding.thread_id):
        raise RuntimeError(f"session {session_id}: no stored rollout for thread {binding.thread_id}")
    return binding.thread_id


class HistoryBench:
    """The two sessions and their timed turns. ``client`` is the bench's ``StackClient``."""

    KINDS = ("first", "rotation")

    def __init__(self, client: Any):
        self.client = client
        self.sessions = {BIG: f"{client.session_id}-h{BIG}", SMALL: f"{client.session_id}-h{SMALL}"}
        self.seconds: dict[tuple[str, int], list[float]] = {(k, n): [] for k in self.KINDS for n in self.sessions}
        self.timings: dict[tuple[str, int], list[dict[str, Any]]] = {(k, n): [] for k in self.KINDS for n in self.sessions}
        self.seed_seconds: dict[int, list[float]] = {n: [] for n in self.sessions}

    def create(self) -> None:
        """Make both sessions (through the API) and load their transcripts."""
        for sid in self.sessions.values():
            self.client.call("POST", "/sessions/", {"id": sid})
        seed_messages(self.sessions[BIG], BIG, user_chars=BIG_CHARS[0], assistant_chars=BIG_CHARS[1])
        chars = small_row_chars()
        seed_messages(self.sessions[SMALL], SMALL, user_chars=chars, assistant_chars=chars)

    def turn(self, kind: str, size: int, text: str, *, record: bool = True) -> None:
        """One first turn or rotation in the session of ``size`` messages, waited for on the session's event
        stream as the bench's other stack turns are; checks codex did what was meant."""
        sid = self.sessions[size]
        if kind == "first":
            end_binding(sid)
        else:
            lose_thread(sid)
        elapsed, turn = self.client.turn(text, session_id=sid, watch=True)
        expected = "started" if kind == "first" else "rotated"
        if turn["thread_action"] != expected:
            raise RuntimeError(f"{kind} turn in the {size}-message session was {turn['thread_action']!r}, not {expected!r}")
        if record:
            self.seconds[(kind, size)].append(elapsed)
            self.timings[(kind, size)].append(turn["timings"])

    def read_seed(self, size: int) -> float:
        """Seconds to read and render the session's history seed as a fresh thread's turn does (in this
        process, on its database connection: no codex, no worker)."""
        from hermes_sessions.services.turns import history_seed

        t0 = time.monotonic()
        history_seed(session_id=self.sessions[size], exclude_turn_id=uuid.uuid4())
        return time.monotonic() - t0

    def run(self, rounds: int) -> None:
        """An untimed warm-up round (every kind of turn once, in both sessions), then ``rounds`` timed
        ones, back to back; progress on stderr."""
        self.round(0, record=False)
        for i in range(rounds):
            print(f"  history round {i + 1}/{rounds}", file=sys.stderr, flush=True)
            self.round(i)

    def ratios(self, kind: str) -> list[float]:
        """The per-pair ratios of ``kind``: each round's turn in the long session over the same round's
        turn in the short one (timed one right after the other)."""
        return paired_ratios(self.seconds[(kind, BIG)], self.seconds[(kind, SMALL)])

    def round(self, i: int, *, record: bool = True) -> None:
        """A first turn in each session, then a rotation in each, then a seed read in each: each kind's
        two turns are a pair timed back to back, and which session goes first alternates between rounds
        (``BIG, SMALL`` in even rounds), so drift and any cost of going first or second hit both alike."""
        order = (BIG, SMALL) if i % 2 == 0 else (SMALL, BIG)
        for kind in self.KINDS:
            for size in order:
                self.turn(kind, size, f"history {kind} {i}", record=record)
        for size in order:
            seconds = self.read_seed(size)
            if record:
                self.seed_seconds[size].append(seconds)
