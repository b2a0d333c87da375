"""Design §3.5 — the history seed a fresh thread gets is bounded: the whole seed, header and
omission marker included, stays within ``HERMES_HISTORY_SEED_MAX_CHARS`` (32,000 by default), keeping the
newest turns and dropping the oldest."""
from __future__ import annotations

import pytest

from hermes_sessions import services
from hermes_sessions.history_seed import CURRENT_TURN_MARKER, HEADER, OMITTED, render_history_seed
from hermes_sessions.models import Message, Turn
from tests.factories import MessageFactory

UNCAPPED = 10**9


class Row:
    def __init__(self, role, content, tool_calls=None):
        self.role, self.content, self.tool_calls = role, content, tool_calls


def long_transcript(turns: int, size: int) -> list[Row]:
    rows = []
    for n in range(turns):
        rows.append(Row("user", f"question {n:03d} " + "q" * size))
        rows.append(Row("assistant", f"answer {n:03d} " + "a" * size))
    return rows


def assert_capped_tail(seed: str, rows, cap: int) -> None:
    full = render_history_seed(rows, max_chars=UNCAPPED)
    assert len(full) > cap  # the case is worth testing
    assert len(seed) <= cap, f"seed is {len(seed)} characters; the cap is {cap}"
    assert seed.startswith(HEADER + "\n\n" + OMITTED + "\n\n")
    kept = seed[len(HEADER + "\n\n" + OMITTED + "\n\n"):]
    assert full.endswith(kept)  # a contiguous tail: the newest rows, in order
    assert kept.startswith("[USER]") or kept.startswith("[ASSISTANT]")  # whole blocks only
    assert len(seed) > cap - 2 * len(rows[-1].content) - 50  # and no more was dropped than one block's worth


def test_the_default_cap_bounds_the_whole_seed_marker_included(settings):
    assert settings.HERMES_HISTORY_SEED_MAX_CHARS == 32_000  # docs/contract.md §3
    rows = long_transcript(turns=1_000, size=20)  # small blocks: the cap is met to within a few characters
    seed = render_history_seed(rows)
    assert_capped_tail(seed, rows, 32_000)
    assert "answer 999" in seed and "question 999" in seed
    assert "question 000" not in seed


@pytest.mark.parametrize("cap", [len(HEADER) + len(OMITTED) + 200, 1_000, 5_000])
def test_a_smaller_cap_from_settings_is_kept_too(settings, cap):
    settings.HERMES_HISTORY_SEED_MAX_CHARS = cap
    rows = long_transcript(turns=60, size=80)
    assert_capped_tail(render_history_seed(rows), rows, cap)


def test_a_newest_block_longer_than_the_cap_keeps_its_end():
    rows = [Row("user", "old"), Row("assistant", "start " + "z" * 5_000 + " the end")]
    seed = render_history_seed(rows, max_chars=2_000)
    assert len(seed) <= 2_000
    assert seed.startswith(HEADER + "\n\n" + OMITTED + "\n\n") and seed.endswith(" the end")
    assert "old" not in seed


def test_under_the_cap_everything_is_kept_without_a_marker():
    rows = long_transcript(turns=3, size=10)
    seed = render_history_seed(rows, max_chars=32_000)
    assert OMITTED not in seed
    assert seed == render_history_seed(rows, max_chars=UNCAPPED)
    assert "question 000" in seed and "answer 002" in seed


@pytest.mark.django_db
def test_the_service_seed_uses_the_configured_cap(user, settings):
    settings.HERMES_HISTORY_SEED_MAX_CHARS = 3_000
    session = services.session_create(owner=user)
    current = Turn.objects.create(session=session, seq=1, input="now")
    for n in range(40):
        MessageFactory(session=session, seq=n + 1, role="user" if n % 2 == 0 else "assistant",
                       content=f"row {n:02d} " + "m" * 200)
    MessageFactory(session=session, seq=41, role="user", content="the current turn", turn=current)

    seed = services.history_seed(session_id=session.id, exclude_turn_id=current.id)

    assert 0 < len(seed) <= 3_000
    assert "row 39" in seed and "row 00" not in seed and "the current turn" not in seed
    assert seed.startswith(HEADER + "\n\n" + OMITTED)
    assert Message.objects.filter(session=session).count() == 41  # seeding writes no rows


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(30)
def test_a_rotated_thread_gets_a_capped_seed(user, scripted_codex, run_turn_now, settings):
    settings.HERMES_HISTORY_SEED_MAX_CHARS = 1_500
    session = services.session_create(owner=user)
    for n in range(4):
        last = run_turn_now(session=session, text=f"turn {n} " + "t" * 400, user=user)
    scripted_codex.remove_rollout(last.codex_thread_id)

    rotated = run_turn_now(session=session, text="after the rotation", user=user)

    assert rotated.thread_action == "rotated", rotated.error
    seed, marker, text = scripted_codex.turn_inputs()[-1].partition(f"\n\n{CURRENT_TURN_MARKER}\n")
    assert (marker, text) == (f"\n\n{CURRENT_TURN_MARKER}\n", "after the rotation")
    assert len(seed) <= 1_500 and OMITTED in seed
    assert "echo: turn 3" in seed and "turn 0 " not in seed
