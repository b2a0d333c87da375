"""A session's work directory belongs to that session only: an id is free again once its session is
deleted, and the next session to take it must not find the files of the first
(``policy.session_workdir_ready``)."""
from __future__ import annotations

from hermes_sessions import policy


def test_a_reused_session_id_gets_an_empty_work_directory(codex_dirs):
    first = policy.session_workdir_ready("proj-x", created="2026-12-05T10:00:00+00:00")
    (first / "notes.txt").write_text("alice-private-token-123")
    again = policy.session_workdir_ready("proj-x", created="2026-12-05T10:00:00+00:00")  # the same session
    assert (again / "notes.txt").read_text() == "alice-private-token-123"
    reused = policy.session_workdir_ready("proj-x", created="2026-12-05T11:00:00+00:00")  # deleted, id taken again
    assert reused == first and list(reused.iterdir()) == []


def test_a_directory_from_before_the_marks_is_kept_for_its_session(codex_dirs):
    legacy = policy.session_workdir("old-1")
    legacy.mkdir(parents=True)
    (legacy / "work.txt").write_text("kept")
    assert (policy.session_workdir_ready("old-1", created="2026-12-01T00:00:00+00:00") / "work.txt").exists()


def test_the_marks_are_outside_every_sessions_directory(codex_dirs):
    path = policy.session_workdir_ready("s-1", created="2026-12-05T10:00:00+00:00")
    marks = path.parent / policy.WORKDIR_MARKS
    assert (marks / "s-1").exists() and marks not in path.parents and path not in marks.parents
