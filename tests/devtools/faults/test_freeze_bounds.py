"""freeze-warm-holder's bound on when a frozen holder's sessions' next turns are claimed
(``warm_scenarios._claim_bounds``), without the stack: the hand-off's bound after the post, or a turn slot
coming free if that is later — and the stall the bound is for (a turn left behind the long turn whose worker
reserved its countdown copy) is past it."""
from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from devtools.faults.record import Posted, Record
from devtools.faults.warm_scenarios import FREEZE_SLACK, _claim_bounds

POST = 1_000.0


def at(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(POST + seconds, UTC)


def turn(pk: str, started: float | None, finished: float | None = None) -> Any:
    return SimpleNamespace(pk=pk, started_at=at(started), finished_at=at(finished))


def scenario(*turn_ids: str) -> Any:
    rec = Record("freeze-warm-holder")
    rec.posted = [Posted(t, "s", "x", POST) for t in turn_ids]
    return SimpleNamespace(rec=rec)


def test_the_bound_is_the_hand_off_after_the_post_or_a_free_slot_if_later(settings):
    settings.HERMES_AFFINITY_DEADLINE, settings.HERMES_WORKER_HEARTBEAT_SECONDS = 2, 0.5
    limit = 2 + 3 * 0.5 + FREEZE_SLACK
    busy = [turn("short1", -1, 1.0), turn("short2", -1, 5.5), turn("long", -1, 16.0)]
    held = [turn("b", 5.6, 6.5), turn("a", 3.0, 4.0), turn("c", 6.6, 7.5)]
    got = {t.pk: (round(d, 3), round(b, 3)) for t, d, b in _claim_bounds(scenario("a", "b", "c"), held, busy)}
    assert got["a"] == (3.0, limit)  # a slot was free at 1.0 s: the hand-off's bound
    assert got["b"] == (5.6, 4.0 + FREEZE_SLACK)  # the next slot: the one "a" ran in, free again at 4.0 s
    assert got["c"] == (6.6, 5.5 + FREEZE_SLACK)  # then short2's, free at 5.5 s


def test_a_turn_left_behind_the_long_turn_fails_and_one_never_claimed_is_left_to_the_caller(settings):
    settings.HERMES_AFFINITY_DEADLINE, settings.HERMES_WORKER_HEARTBEAT_SECONDS = 2, 0.5
    busy = [turn("short1", -1, 5.5), turn("short2", -1, 5.6), turn("long", -1, 16.0)]
    held = [turn("a", 16.3, 17.0), turn("b", None)]
    (only,) = _claim_bounds(scenario("a", "b"), held, busy)
    assert only[0].pk == "a" and only[1] > only[2]  # 16.3 s > 8.5 s: the stall fails
