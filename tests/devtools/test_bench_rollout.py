"""``devtools/bench_rollout.py``'s growth: whole turns cut at ``task_complete``, compaction cycles, and copies
whose lines carry consecutive ordinals and fresh ids (codex's projection rejects an ordinal lower than the
next one; the same ids twice would collapse into one item), the thread's own id kept."""
from __future__ import annotations

import json

import pytest

from devtools.bench_rollout import _cycles, _Renamer, _turns

THREAD = "01a248ff-8392-7e91-b1db-081f440efce2"


def _line(ordinal: int, kind: str, payload: dict) -> bytes:
    return json.dumps({"timestamp": "2026-12-06T01:00:00.000Z", "ordinal": ordinal, "type": kind, "payload": payload},
                      separators=(",", ":")).encode() + b"\n"


def _turn(first: int, turn_id: str, call: str, compacted: bool = False) -> bytes:
    lines = [
        _line(first, "event_msg", {"type": "task_started", "turn_id": turn_id}),
        _line(first + 1, "response_item", {"type": "function_call", "call_id": f"call_{call}", "thread_id": THREAD}),
        _line(first + 2, "response_item", {"type": "function_call_output", "call_id": f"call_{call}",
                                           "id": f"fco_{turn_id}"}),
    ]
    if compacted:
        lines.append(_line(first + 3, "compacted", {"message": "summary", "replacement_history": []}))
    lines.append(_line(first + len(lines), "event_msg", {"type": "task_complete", "turn_id": turn_id}))
    return b"".join(lines)


T1 = "01a24900-0000-7000-8000-000000000001"
T2 = "01a24900-0000-7000-8000-000000000002"
DATA = _turn(10, T1, "aaaaaaaaaaaa") + _turn(14, T2, "bbbbbbbbbbbb", compacted=True)


def test_turns_end_at_task_complete_and_cycles_at_a_compaction():
    turns = _turns(DATA)
    assert [t.count(b"\n") for t in turns] == [4, 5]
    assert b"".join(turns) == DATA
    assert _cycles(DATA) == [turns]
    assert _cycles(_turn(0, T1, "cccccccccccc")) == []


def test_copies_have_consecutive_ordinals_and_fresh_ids_but_the_thread_s():
    renamer = _Renamer(THREAD, next_ordinal=19)
    copies = []
    for _ in range(2):
        renamer.new_cycle()
        copies.append(b"".join(renamer.copy(t) for t in _turns(DATA)))
    rows = [json.loads(line) for copy in copies for line in copy.splitlines()]
    assert [r["ordinal"] for r in rows] == list(range(19, 19 + 18))
    assert {r["payload"].get("thread_id") for r in rows} == {THREAD, None}
    turn_ids = {r["payload"]["turn_id"] for r in rows if "turn_id" in r["payload"]}
    assert len(turn_ids) == 4 and not turn_ids & {T1, T2}
    calls = [r["payload"]["call_id"] for r in rows if "call_id" in r["payload"]]
    assert calls[0] == calls[1] and calls[2] == calls[3]  # a call and its output still match
    assert len(set(calls)) == 4 and "call_aaaaaaaaaaaa" not in calls
    assert all(len(c) == len("call_aaaaaaaaaaaa") for c in calls)


def test_a_line_without_a_leading_ordinal_is_refused():
    with pytest.raises(RuntimeError, match="without a leading ordinal"):
        _Renamer(THREAD, next_ordinal=0).copy(b'{"type":"event_msg","payload":{}}\n')
