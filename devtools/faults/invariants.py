"""The checks of ``make faults``: after a scenario, is anything lost, doubled or stuck?

:func:`check_database` judges the database against a scenario's :class:`~devtools.faults.record.Record`
and needs nothing but Django (the tests in ``tests/devtools/faults/`` plant defects and run it):

* each accepted input (a 202) has exactly one turn and it is terminal within ``bound`` seconds; a POST
  answered with an error created no turn; no turn exists that no POST accepted;
* succeeded turns have their user row and their assistant reply answering the input (else *lost*);
  no doubled user row, codex item or assistant reply, no seq gap or repeat (else *duplicates*);
* bindings obey I1–I3: one active binding per session, naming the thread of the session's latest
  succeeded turn, created only by a succeeded turn on that thread; one thread per session without
  rotations; no two turns of a session running at once, turns run in accepted order;
* one notice per rotation, at most one notice per turn; no rotation at all where the scenario says so
  (``Record.expect_no_rotation``: every thread's rollout is stored, so none may be given up);
* every active binding's thread has its rollout in PostgreSQL, and it adds up: chunks ``1..n`` with
  contiguous offsets, each chunk's size and sha256 right (after zlib), the total length and sha256
  those of the ``CodexRollout`` row, ``generation`` = ``n``; and each succeeded turn on that thread has
  its input in those bytes (else *lost*: the next turn's codex would not know it).

:func:`check` adds what only the running stack can tell (workers that died on their own, 5xx answers,
codex app-servers that outlived their worker — also one killed mid-scenario — or that no worker keeps
loaded) and makes the scenario's row of the table.
"""
from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from devtools.faults.record import TERMINAL, Record

if TYPE_CHECKING:
    from devtools.faults.scenarios import Scenario
    from devtools.faults.supervisor import Stack


@dataclass
class Tally:
    """Counts of one check: ``terminal``/``stuck`` accepted turns, ``lost`` and ``duplicates`` rows or
    turns, the ``longest`` seconds from POST to terminal, ``failed`` reasons, ``rotations``."""

    accepted: int = 0
    terminal: int = 0
    stuck: int = 0
    lost: int = 0
    duplicates: int = 0
    longest: float = 0.0
    failed_turns: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    rotations: int = 0


def check_database(rec: Record, bound: float) -> Tally:
    """Check the turns, messages, bindings and notices of ``rec.sessions``; every breach is appended to
    ``rec.violations`` (in the order: turns, transcript, bindings and notices). Returns the counts."""
    from hermes_sessions.models import Turn

    tally = Tally()
    turns = {str(t.pk): t for t in Turn.objects.filter(session_id__in=rec.sessions)}
    _check_accepted(rec, turns, bound, tally)
    _check_unaccepted(rec, turns, tally)
    _check_transcript(rec, turns, tally)
    for sid in rec.sessions:
        _check_session_bindings(rec, sid, turns, tally)
    _check_notices_per_turn(rec)
    _check_rollouts(rec, turns, tally)
    if rec.expect_no_rotation and tally.rotations:
        rec.violations.append(f"{tally.rotations} rotation(s), where every thread's rollout is stored")
    posted = {p.turn_id for p in rec.posted}
    tally.accepted = len(posted)
    tally.failed_turns = sum(1 for tid, t in turns.items() if tid in posted and t.status == "failed")
    return tally


# --------------------------------------------------------------------------------------- turns


def _check_accepted(rec: Record, turns: dict[str, Any], bound: float, tally: Tally) -> None:
    """Every accepted input: exactly one turn (its text names it uniquely), terminal within ``bound``."""
    v = rec.violations
    per_text = Counter((t.session_id, t.input) for t in turns.values())
    for p in {p.turn_id: p for p in rec.posted}.values():
        t = turns.get(p.turn_id)
        if t is None:
            v.append(f"accepted turn {p.turn_id} does not exist")
            tally.lost += 1
            continue
        n = per_text[(p.session_id, p.text)]
        if n != 1:
            v.append(f"input {p.text!r} has {n} turns")
            tally.duplicates += n - 1
        if t.status not in TERMINAL:
            tally.stuck += 1
            continue
        tally.terminal += 1
        took = t.finished_at.timestamp() - p.posted_at if t.finished_at is not None else None
        if took is not None:
            tally.longest = max(tally.longest, took)
        if took is None or took > bound:
            v.append(f"turn {p.turn_id} took longer than {bound:.0f} s to reach {t.status}")
        if t.status == "failed":
            tally.failed[(t.error or "?")[:160]] += 1
    if tally.stuck:
        v.append(f"{tally.stuck} accepted turn(s) not terminal after {bound:.0f} s")


def _check_unaccepted(rec: Record, turns: dict[str, Any], tally: Tally) -> None:
    """Turns no 202 named: made by a POST the client saw fail, or by nothing at all."""
    posted = {p.turn_id for p in rec.posted}
    posted_texts = {(p.session_id, p.text) for p in rec.posted}
    unanswered = set(rec.unanswered)
    for tid, t in turns.items():
        if tid in posted:
            continue
        if (t.session_id, t.input) in unanswered:
            # The client got an error (5xx / no answer), yet the input was taken: a turn it does not know of.
            rec.violations.append(f"a POST answered with an error still created turn {tid} ({t.status})")
            if t.status not in TERMINAL:
                tally.stuck += 1
        elif (t.session_id, t.input) not in posted_texts:
            rec.violations.append(f"turn {tid} exists that no POST accepted")
            tally.duplicates += 1


# --------------------------------------------------------------------------------------- transcript


def _check_transcript(rec: Record, turns: dict[str, Any], tally: Tally) -> None:
    """User row and reply of every succeeded turn; nothing doubled; seq dense per session."""
    from hermes_sessions.models import Message

    msgs = list(Message.objects.filter(session_id__in=rec.sessions).order_by("session_id", "seq"))
    by_turn: dict[str, list[Any]] = defaultdict(list)
    by_session: dict[str, list[Any]] = defaultdict(list)
    for m in msgs:
        by_turn[str(m.turn_id)].append(m)
        by_session[m.session_id].append(m)
    for tid, t in turns.items():
        _check_turn_rows(rec, tid, t, by_turn.get(tid, []), tally)
    for sid in rec.sessions:
        seqs = [m.seq for m in by_session.get(sid, [])]
        if seqs != list(range(1, len(seqs) + 1)):
            tally.duplicates += len(seqs) - len(set(seqs))
            rec.violations.append(f"session {sid}: message seq not 1..{len(seqs)} (gaps or repeats)")
        tseqs = sorted(t.seq for t in turns.values() if t.session_id == sid)
        if tseqs != list(range(1, len(tseqs) + 1)):
            rec.violations.append(f"session {sid}: turn seq not 1..{len(tseqs)}")


def _check_turn_rows(rec: Record, tid: str, t: Any, rows: list[Any], tally: Tally) -> None:
    """One turn's transcript rows: one user row, each codex item once, a reply if it succeeded."""
    v = rec.violations
    users = [m for m in rows if m.role == "user"]
    if len(users) > 1:
        tally.duplicates += len(users) - 1
        v.append(f"turn {tid}: {len(users)} user rows")
    items = Counter((m.codex_item_id, m.role) for m in rows if m.codex_item_id)
    for (item, role), n in items.items():
        if n > 1:
            tally.duplicates += n - 1
            v.append(f"turn {tid}: codex item {item} ({role}) stored {n} times")
    if t.status == "succeeded":
        # The reply is the assistant row without tool calls; a turn that ran a tool (``RUNCMD``) also has
        # the assistant's call and the tool's row, and its reply reports the tool's output, not the input.
        replies = [m for m in rows if m.role == "assistant" and not m.tool_calls]
        ran_tool = any(m.role == "tool" for m in rows)
        _check_succeeded_rows(rec, tid, t, users, replies, tally, echoes=not ran_tool)
    if users and users[0].seq > min((m.seq for m in rows), default=users[0].seq):
        v.append(f"turn {tid}: a row precedes its user row")


def _check_succeeded_rows(rec: Record, tid: str, t: Any, users: list[Any], replies: list[Any], tally: Tally, *,
                          echoes: bool = True) -> None:
    v = rec.violations
    if not users or users[0].content != t.input:
        tally.lost += 1
        v.append(f"succeeded turn {tid} lacks its user row")
    if not replies:
        tally.lost += 1
        v.append(f"succeeded turn {tid} lacks its assistant reply")
    elif len(replies) > 1:
        tally.duplicates += len(replies) - 1
        v.append(f"succeeded turn {tid}: {len(replies)} assistant replies for one echo")
    elif (echoes and t.input not in replies[0].content) or t.final_text != replies[0].content:
        v.append(f"succeeded turn {tid}: the reply does not answer its input")


# --------------------------------------------------------------------------------------- bindings and notices


def _check_session_bindings(rec: Record, sid: str, turns: dict[str, Any], tally: Tally) -> None:
    """I1–I3 for one session, and one notice per rotation."""
    from hermes_sessions.models import CodexBinding, Notice

    v = rec.violations
    st = sorted((t for t in turns.values() if t.session_id == sid), key=lambda t: t.seq)
    bindings = list(CodexBinding.objects.filter(session_id=sid))
    active = [b for b in bindings if b.status == "active"]
    if len(active) > 1:
        v.append(f"session {sid}: {len(active)} active bindings")
    rotated = [t for t in st if t.thread_action == "rotated"]
    tally.rotations += len(rotated)
    ok = [t for t in st if t.status == "succeeded" and t.thread_action]
    if ok:
        _check_latest_thread(v, sid, ok, bindings, active, len(rotated))
    for b in bindings:  # I1: a binding is created only by a turn whose rows committed with it
        creator = turns.get(str(b.created_by_turn_id))
        if creator is None or creator.status != "succeeded" or creator.codex_thread_id != b.thread_id:
            v.append(f"session {sid}: binding {b.thread_id} not created by a succeeded turn on that thread")
    # I3: no two turns of the session ran at once; they ran in accepted order.
    ran = [t for t in st if t.started_at is not None]
    for prev, nxt in zip(ran, ran[1:], strict=False):
        if prev.finished_at is None or prev.finished_at > nxt.started_at:
            v.append(f"session {sid}: turns #{prev.seq} and #{nxt.seq} overlapped or ran out of order")
    notices = Notice.objects.filter(session_id=sid).count()
    if notices != len(rotated):
        v.append(f"session {sid}: {notices} notices for {len(rotated)} rotations")


def _check_latest_thread(v: list[str], sid: str, ok: list[Any], bindings: list[Any], active: list[Any],
                         rotations: int) -> None:
    """I2: the active binding names the thread of the latest succeeded turn (unless a later turn ended
    it); the succeeded turns share one thread per rotation and started at most one."""
    latest = ok[-1]
    ended_later = any(b.ended_by_turn_id and b.ended_by_turn_id != latest.pk and b.ended_at
                      and latest.finished_at and b.ended_at > latest.finished_at for b in bindings)
    if not active and not ended_later:
        v.append(f"session {sid}: succeeded turns but no active binding")
    elif active and active[0].thread_id != latest.codex_thread_id:
        v.append(f"session {sid}: active binding {active[0].thread_id} is not the thread of its latest "
                 f"succeeded turn ({latest.codex_thread_id}, turn #{latest.seq})")
    threads = {t.codex_thread_id for t in ok}
    if len(threads) > 1 + rotations:
        v.append(f"session {sid}: {len(threads)} codex threads with {rotations} rotation(s) — "
                 "a turn did not resume the session's thread")
    started_ok = [t for t in ok if t.thread_action == "started"]
    if len(started_ok) > 1:
        v.append(f"session {sid}: {len(started_ok)} succeeded turns started a new thread")


def _check_notices_per_turn(rec: Record) -> None:
    from django.db.models import Count

    from hermes_sessions.models import Notice

    per_turn_notice = (Notice.objects.filter(session_id__in=rec.sessions, turn__isnull=False)
                       .values("turn").annotate(n=Count("id")).filter(n__gt=1).count())
    if per_turn_notice:
        rec.violations.append(f"{per_turn_notice} turn(s) with more than one notice")


# --------------------------------------------------------------------------------------- rollouts


def _check_rollouts(rec: Record, turns: dict[str, Any], tally: Tally) -> None:
    """The stored rollout of every active binding's thread adds up, and holds its succeeded turns."""
    from hermes_sessions.models import CodexBinding, CodexRollout

    active = dict(CodexBinding.objects.filter(session_id__in=rec.sessions, status="active")
                  .values_list("thread_id", "session_id"))
    stored = {r.thread_id: r for r in CodexRollout.objects.filter(thread_id__in=list(active))}
    for thread_id, sid in sorted(active.items()):
        r = stored.get(thread_id)
        if r is None:
            rec.violations.append(f"session {sid}: bound thread {thread_id} has no rollout in PostgreSQL")
            continue
        data = _stored_rollout(rec.violations, sid, r)
        if data is None:
            continue
        for tid, t in turns.items():
            if t.status == "succeeded" and t.codex_thread_id == thread_id and t.input.encode() not in data:
                tally.lost += 1
                rec.violations.append(f"session {sid}: succeeded turn {tid} is not in its thread's stored rollout")


def _stored_rollout(v: list[str], sid: str, r: Any) -> bytes | None:
    """The bytes of rollout ``r`` from its chunks, or ``None`` (with the violations) when they do not add up."""
    import hashlib
    import zlib

    from hermes_sessions.models import RolloutChunk

    parts: list[bytes] = []
    bad: list[str] = []
    chunks = RolloutChunk.objects.filter(rollout=r).order_by("seq").values_list("seq", "offset", "size", "compression",
                                                                               "data", "sha256")
    for n, (seq, offset, size, compression, data, sha) in enumerate(chunks, start=1):
        raw = zlib.decompress(bytes(data)) if compression == "zlib" else bytes(data)
        at = sum(len(p) for p in parts)
        if seq != n or offset != at or len(raw) != size or hashlib.sha256(raw).hexdigest() != sha:
            bad.append(f"chunk #{seq} (expected #{n} at offset {at}) has offset {offset}, size {size}/{len(raw)}"
                       f"{'' if hashlib.sha256(raw).hexdigest() == sha else ', wrong sha256'}")
        parts.append(raw)
    data = b"".join(parts)
    if len(data) != r.length or hashlib.sha256(data).hexdigest() != r.sha256:
        bad.append(f"chunks hold {len(data)} B (sha256 {hashlib.sha256(data).hexdigest()[:12]}), "
                   f"the row says {r.length} B (sha256 {r.sha256[:12]})")
    if r.generation != len(parts):
        bad.append(f"generation {r.generation} with {len(parts)} chunk(s)")
    for b in bad:
        v.append(f"session {sid}: stored rollout of {r.thread_id}: {b}")
    return None if bad else data


# --------------------------------------------------------------------------------------- with the stack


def check_stack(rec: Record, stack: Stack) -> None:
    """Workers that died on their own (replaced), 5xx answers, and codex app-servers: none may outlive its
    worker (one of a worker killed with SIGKILL during the scenario still running 5 s after the kill, or
    any under no running worker), and every one still running under a worker must be a thread it keeps
    loaded (session affinity: a ``WarmThread`` row naming that worker's queue and the session it works
    for) — every turn is over, so no other should run (up to 10 s to go). Appended to ``rec.violations``."""
    rec.violations.extend(stack.reap_dead())
    if rec.http_5xx:
        rec.violations.append(f"{len(rec.http_5xx)} answer(s) 5xx, e.g. {rec.http_5xx[0]}")
    rec.violations.extend(stack.codex_outliving(grace=5.0))
    deadline = time.monotonic() + 10
    while (extra := codex_not_kept(stack)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if extra:
        rec.violations.append(f"{len(extra)} codex process(es) left over that no worker keeps: " + "; ".join(extra[:3]))


def codex_not_kept(stack: Stack) -> list[str]:
    """The codex processes of the run that are not a thread kept loaded by the worker they run under:
    ``pid … cwd …`` each."""
    from devtools.processes import ancestors, codex_processes
    from hermes_sessions.models import TurnWorker, WarmThread

    queue_of_pid = dict(TurnWorker.objects.values_list("pid", "queue"))
    warm = set(WarmThread.objects.values_list("session_id", "queue"))
    out = []
    for cp in codex_processes(stack.codex_home):
        chain = [cp.ppid, *ancestors(cp.ppid)]
        queue = next((queue_of_pid[p] for p in chain if p in queue_of_pid), "")
        session = os.path.basename(cp.cwd) if os.path.dirname(cp.cwd) == stack.work_root else ""
        if not (queue and session and (session, queue) in warm):
            out.append(f"pid {cp.pid} cwd {cp.cwd} {cp.cmd[:60]}")
    return out


def row(rec: Record, tally: Tally) -> dict[str, Any]:
    """The scenario's line of the table (and its notes, failure reasons and violations)."""
    return {
        "scenario": rec.name,
        "runs": rec.runs,
        "accepted": tally.accepted,
        "terminal": tally.terminal,
        "lost": tally.lost,
        "duplicates": tally.duplicates,
        "longest_s": round(tally.longest, 1),
        "failed": tally.failed_turns,
        "worker_restarts": rec.worker_restarts,
        "stuck": tally.stuck,
        "violations": rec.violations,
        "failed_reasons": dict(tally.failed),
        "notes": rec.notes,
        "rotations": tally.rotations,
    }


def check(sc: Scenario, bound: float) -> dict[str, Any]:
    """All checks of one scenario; returns (and keeps as ``sc.rec.row``) its row."""
    tally = check_database(sc.rec, bound)
    check_stack(sc.rec, sc.stack)
    sc.rec.row = row(sc.rec, tally)
    return sc.rec.row

