"""The claim's decision and writes as one PostgreSQL statement, so that a claim is one round trip
(``turns._claim_in_one_trip``): ``BEGIN``, the locks, this statement, the ``running`` event and the
``COMMIT`` travel together (``pipelining``).

Why: the claim was two round trips — the locks with the reads, then, once Python had decided from them,
the writes with the ``COMMIT`` — and it sits between the woken worker and codex's ``turn/start`` on every
warm turn. On the loaded 2-core host the second round trip was ~2 ms of the ~5 ms claim (``make
bench-warm`` with timestamps along the turn). The decision it waited for is a few comparisons that SQL
makes as well: this statement runs after the locking statement in the same transaction, so under READ
COMMITTED its snapshot is taken after the lock waits and sees every turn committed before the locks were
granted — as the separate read did (never folded into the locking statement, whose snapshot predates
its waits).

Its CTEs, in order: ``clk`` the statement's clock (read once, after the locks: ``claim_params``); ``me`` the turn; ``blk`` whether another turn of the session runs or an earlier one
is still queued (I3); ``ok`` the turn if it may run now (queued, no cancel asked for, not blocked); ``upd``
marks it running under the new claim token, attempt + 1 and the lease; ``want`` / ``sess`` / ``ins`` write
the user's transcript row with the session's next sequence number — at the first claim, or at a re-claim
that finds none. The row it returns tells the caller what happened.
"""
from __future__ import annotations

import functools
import uuid
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models import Field, Model

from ..models import CodexBinding, CodexRollout, Message, Session, Turn


@functools.cache
def claim_sql() -> str:
    """The statement (text built once per process from the models' metadata; parameters ``claim_params``).
    One row: the new ``attempt`` (NULL: nothing was claimed — not queued, cancel asked for, or blocked), the
    active binding's thread id and that thread's stored rollout generation (NULL: none stored; ``lower`` as
    ``rollouts.rollout_state`` lower-cases codex's UUIDs). A turn that does not exist gives a row of NULLs.
    (PostgreSQL runs every data-modifying CTE whether or not the result reads it.)"""
    q = connection.ops.quote_name

    def col(model: type[Model], name: str) -> str:
        field = model._meta.get_field(name)
        assert isinstance(field, Field)  # a concrete column, not a reverse relation
        return q(str(field.column))

    t, s, m, b, r = (q(model._meta.db_table) for model in (Turn, Session, Message, CodexBinding, CodexRollout))
    tid, tsession, tseq, tattempt, tstatus = (col(Turn, n) for n in ("id", "session", "seq", "attempt", "status"))
    message_cols = ", ".join(col(Message, n) for n in (
        "session", "seq", "turn", "role", "content", "tool_calls", "tool_call_id", "reasoning", "codex_item_id",
        "created_at"))
    return (
        f"WITH clk AS (SELECT clock_timestamp() AS now), "
        f"me AS (SELECT {tid}, {tsession}, {tseq}, {tattempt}, {tstatus}, {col(Turn, 'cancel_requested_at')}, "
        f"{col(Turn, 'input')} FROM {t} WHERE {tid} = %(turn)s), "
        f"blk AS (SELECT EXISTS (SELECT 1 FROM {t} o JOIN me ON o.{tsession} = me.{tsession} "
        f"WHERE o.{tid} <> me.{tid} AND (o.{tstatus} = %(running)s OR (o.{tstatus} = %(queued)s "
        f"AND o.{tseq} < me.{tseq}))) AS blocked), "
        f"ok AS (SELECT me.* FROM me CROSS JOIN blk WHERE me.{tstatus} = %(queued)s "
        f"AND me.{col(Turn, 'cancel_requested_at')} IS NULL AND NOT blk.blocked), "
        f"upd AS (UPDATE {t} u SET {tstatus} = %(running)s, {col(Turn, 'started_at')} = (SELECT now FROM clk), "
        f"{tattempt} = u.{tattempt} + 1, {col(Turn, 'claim_token')} = %(token)s, "
        f"{col(Turn, 'lease_expires_at')} = %(lease)s FROM ok WHERE u.{tid} = ok.{tid} RETURNING u.{tattempt}), "
        f"want AS (SELECT ok.{tid}, ok.{tsession}, ok.{col(Turn, 'input')} FROM ok WHERE ok.{tattempt} = 0 "
        f"OR NOT EXISTS (SELECT 1 FROM {m} x WHERE x.{col(Message, 'turn')} = ok.{tid} "
        f"AND x.{col(Message, 'role')} = %(user)s)), "
        f"sess AS (UPDATE {s} v SET {col(Session, 'last_message_seq')} = v.{col(Session, 'last_message_seq')} + 1, "
        f"{col(Session, 'updated_at')} = (SELECT now FROM clk) FROM want WHERE v.{col(Session, 'id')} = want.{tsession} "
        f"RETURNING v.{col(Session, 'last_message_seq')}), "
        f"ins AS (INSERT INTO {m} ({message_cols}) SELECT want.{tsession}, sess.{col(Session, 'last_message_seq')}, "
        f"want.{tid}, %(user)s, want.{col(Turn, 'input')}, NULL::jsonb, '', '', '', (SELECT now FROM clk) FROM want CROSS JOIN sess "
        f"RETURNING 1) "
        f"SELECT (SELECT {tattempt} FROM upd), bd.{col(CodexBinding, 'thread_id')}, "
        f"(SELECT ro.{col(CodexRollout, 'generation')} FROM {r} ro "
        f"WHERE ro.{col(CodexRollout, 'thread_id')} = lower(bd.{col(CodexBinding, 'thread_id')})) "
        f"FROM (SELECT 1) one LEFT JOIN me ON true LEFT JOIN {b} bd ON bd.{col(CodexBinding, 'session')} = me.{tsession} "
        f"AND bd.{col(CodexBinding, 'status')} = %(active)s"
    )


def claim_params(*, turn_id: uuid.UUID, token: uuid.UUID, lease: datetime) -> dict[str, Any]:
    """``claim_sql``'s parameters: the turn, the new claim ``token`` and the lease's end. ``started_at``, the
    user row's ``created_at`` and the session's ``updated_at`` are the statement's own clock (``clk``:
    ``clock_timestamp()``, read once), taken after the locking statement before it — not the caller's before
    the round trip: a claim that waited for the session's lock while the turn before it was finalized had a
    ``started_at`` before that turn's ``finished_at``, which ``make faults`` reports as turns that "overlapped
    or ran out of order"; the one-trip enqueue stamps its times the same way."""
    return {"turn": turn_id, "token": token, "lease": lease, "running": Turn.Status.RUNNING,
            "queued": Turn.Status.QUEUED, "user": Message.Role.USER, "active": CodexBinding.Status.ACTIVE}
