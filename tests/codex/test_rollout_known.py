"""A turn's capture of a rollout this process wrote or read last reads only both ends of it
(``rollout_files.KNOWN``): the same delta as a full read, and anything that is not that
file any more — replaced, truncated, rewritten in place, re-made on a reused inode, its first or last
bytes of the stored prefix changed — is read in full and, if it diverged, refused."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from hermes_sessions.codex import rollout_files
from hermes_sessions.codex.rollout_files import (
    TAIL_BYTES,
    KnownPrefixes,
    RolloutBase,
    RolloutDiverged,
    read_delta,
    write_rollout,
)

RELPATH = "sessions/2026/12/03/rollout-2026-12-03T10-00-00-t1.jsonl"


def _base(data: bytes, generation: int = 1) -> RolloutBase:
    return RolloutBase(thread_id="t1", relpath=RELPATH, length=len(data), sha256=hashlib.sha256(data).hexdigest(),
                       generation=generation)


def _append(home: Path, data: bytes) -> None:
    with open(home / RELPATH, "ab") as fh:
        fh.write(data)


@pytest.fixture
def restored(tmp_path) -> tuple[Path, bytes]:
    stored = b''.join(b'{"line":%d,"pad":"%s"}\n' % (i, b"x" * 40) for i in range(400))  # ~25 KB
    home = tmp_path / "home"
    write_rollout(home, _base(stored), stored)
    return home, stored


def test_consecutive_turns_read_only_the_tail_and_get_what_a_full_read_gets(restored, monkeypatch):
    home, whole = restored
    base = _base(whole)

    def no_full_read(self):
        raise AssertionError(f"read in full: {self}")

    monkeypatch.setattr(Path, "read_bytes", no_full_read)
    for turn in range(3):
        appended = b'{"turn":%d}\n' % turn * (turn + 1)
        _append(home, appended)
        delta = read_delta(home, "t1", base)
        whole += appended
        assert (delta.offset, delta.data, delta.length) == (base.length, appended, len(whole))
        assert delta.sha256 == hashlib.sha256(whole).hexdigest() and delta.relpath == RELPATH
        base = _base(whole, generation=base.generation + 1)  # stored: the next turn's base


def test_a_file_that_is_not_the_known_one_is_read_in_full_and_refused_if_it_diverged(restored):
    home, stored = restored
    base, path = _base(stored), home / RELPATH
    # Replaced (another inode) by a copy whose first byte differs: only the full read can tell.
    other = path.with_name("other")
    other.write_bytes(b"X" + stored[1:] + b"more\n")
    os.replace(other, path)
    with pytest.raises(RolloutDiverged, match="no longer starts with"):
        read_delta(home, "t1", base)
    # Restored again, then cut short in place (the same inode).
    write_rollout(home, base, stored)
    with open(path, "r+b") as fh:
        fh.truncate(len(stored) - 10)
    with pytest.raises(RolloutDiverged, match="no longer starts with"):
        read_delta(home, "t1", base)
    # Restored again, then the bytes just before the stored length changed in place, and an append.
    write_rollout(home, base, stored)
    with open(path, "r+b") as fh:
        fh.seek(len(stored) - 5)
        fh.write(b"ZZZZ\n")
    _append(home, b"appended\n")
    with pytest.raises(RolloutDiverged, match="no longer starts with"):
        read_delta(home, "t1", base)


def test_a_base_other_than_the_known_one_is_read_in_full(restored, monkeypatch):
    home, stored = restored
    calls = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: calls.append(self) or real(self))
    older = stored[:-100]  # what PostgreSQL holds is not what this process last saw (e.g. a fenced finalize)
    _append(home, b"new\n")
    delta = read_delta(home, "t1", _base(older))
    assert calls and delta.data == stored[-100:] + b"new\n"
    assert delta.sha256 == hashlib.sha256(stored + b"new\n").hexdigest()


def test_the_known_files_are_bounded_least_recently_used_first(tmp_path):
    known = KnownPrefixes(size=2)
    paths = [tmp_path / f"f{i}" for i in range(3)]
    for path in paths:
        path.write_bytes(b"a" * TAIL_BYTES)
        known.remember(path, b"a" * TAIL_BYTES, hashlib.sha256(b"a" * TAIL_BYTES))
    base = RolloutBase("t", "r", TAIL_BYTES, hashlib.sha256(b"a" * TAIL_BYTES).hexdigest(), 1)
    assert known.get(paths[0], base) is None
    assert known.get(paths[1], base) is not None and known.get(paths[2], base) is not None
    assert rollout_files.KNOWN.size >= 8  # a worker's kept threads (HERMES_WARM_MAX_THREADS) fit


def test_a_file_rewritten_in_place_with_another_start_is_refused(restored):
    """The same inode (``open(…, 'r+b')``, ``Path.write_bytes``), another first byte or
    100 bytes, the same last bytes before the stored length — the checks on the tail and the inode alone would
    let these through."""
    home, stored = restored
    base, path = _base(stored), home / RELPATH
    with open(path, "r+b") as fh:
        fh.write(b"X")
    _append(home, b'{"turn":1}\n')
    with pytest.raises(RolloutDiverged, match="no longer starts with"):
        read_delta(home, "t1", base)
    write_rollout(home, base, stored)
    inode = path.stat().st_ino
    path.write_bytes(b"Z" * 100 + stored[100:] + b'{"turn":1}\n')
    assert path.stat().st_ino == inode
    with pytest.raises(RolloutDiverged, match="no longer starts with"):
        read_delta(home, "t1", base)


def test_a_home_remade_by_another_writer_on_a_reused_inode_is_refused(restored):
    """The home wiped and its file written again by something other than this process's
    ``write_rollout`` — ext4 hands the freed inode number straight back, so the identity check passes."""
    home, stored = restored
    base = _base(stored)
    remade = b"Q" * 10 + stored[10:] + b"tail\n"
    for _ in range(50):  # the reuse is the filesystem's choice: the check must hold with or without it
        shutil.rmtree(home)
        (home / RELPATH).parent.mkdir(parents=True)
        (home / RELPATH).write_bytes(remade)
        with pytest.raises(RolloutDiverged, match="no longer starts with"):
            read_delta(home, "t1", base)
        write_rollout(home, base, stored)  # known again, for the next round


def test_a_forked_child_starts_with_nothing_known(restored):
    home, stored = restored
    assert rollout_files.KNOWN.get(home / RELPATH, _base(stored)) is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing known, and the lock free
        os.write(write, b"empty" if rollout_files.KNOWN.get(home / RELPATH, _base(stored)) is None else b"kept")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"empty"


def _line(kind: str, payload: dict | None = None) -> bytes:
    import json

    return (json.dumps({"timestamp": "2026-12-06T02:36:20.000Z", "type": kind, "payload": payload or {}}) + "\n").encode()


def test_a_leftover_shows_work_only_for_a_completed_turn_or_one_that_acted():
    """Lines as codex 0.171.0 writes them (a rollout of the contract tests, RUNCMD turns): a turn cut off
    after its user message and some text shows no work; one with ``task_complete``, or with a completed
    command, does."""
    import hashlib

    from hermes_sessions.codex.rollout_files import Leftover, RolloutBase

    stored = _line("session_meta") + _line("event_msg", {"type": "task_complete"})
    base = RolloutBase(thread_id="t", relpath="sessions/r.jsonl", length=len(stored),
                       sha256=hashlib.sha256(stored).hexdigest(), generation=1)
    talked = (_line("event_msg", {"type": "task_started"}) + _line("turn_context")
              + _line("response_item", {"type": "message", "role": "user"})
              + _line("event_msg", {"type": "item_completed", "item": {"type": "UserMessage"}})
              + _line("response_item", {"type": "message", "role": "assistant"})
              + b'{"timestamp": "2026-12-06T02:36:2')  # the kill cut the last line
    acted = talked[:talked.rindex(b"\n") + 1] + _line("event_msg", {"type": "item_completed", "item": {"type": "CommandExecution"}})
    done = talked[:talked.rindex(b"\n") + 1] + _line("event_msg", {"type": "task_complete"})

    def leftover(tail: bytes) -> Leftover:
        return Leftover(thread_id="t", relpath="sessions/r.jsonl", data=stored + tail)

    assert leftover(talked).extends(base) and not leftover(talked).shows_work(base)
    assert leftover(acted).shows_work(base) and leftover(done).shows_work(base)
    # The stored part's own task_complete is not this attempt's.
    assert not leftover(_line("event_msg", {"type": "task_started"})).shows_work(base)
