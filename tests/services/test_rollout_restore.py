"""Restoring a rollout from PostgreSQL (``services/rollouts.rollout_write``): a host that holds a verified
copy of a stored prefix appends only the chunks it lacks; any copy that is not exactly that — tampered in
the middle, truncated, longer, replaced on a reused inode — is restored in full and ends byte-identical;
a full restore streams the chunks, its memory bounded whatever the rollout's size."""
from __future__ import annotations

import hashlib
import os
import random
import tracemalloc
from pathlib import Path

import pytest
from django.db import transaction

from hermes_sessions import services
from hermes_sessions.codex import rollout_files
from hermes_sessions.codex.rollout_files import RolloutBase, RolloutDelta, RolloutDiverged
from hermes_sessions.models import RolloutChunk
from hermes_sessions.services import rollouts

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

THREAD = "019a0000-0000-7000-8000-00000000beef"
RELPATH = f"sessions/2026/12/05/rollout-2026-12-05T10-00-00-{THREAD}.jsonl"


def _turn_lines(turn: int, size: int, rnd: random.Random) -> bytes:
    """About ``size`` bytes of rollout-like JSONL for one turn (compressible as codex's is, not trivially)."""
    out, n = [], 0
    while n < size:
        words = " ".join(rnd.choice(("echo", "turn", "file", "diff", "test", "ok", "ls", "cat")) + str(rnd.randrange(999))
                         for _ in range(40))
        line = b'{"type":"response_item","payload":{"type":"message","role":"assistant","turn":%d,"text":"%s"}}\n' % (
            turn, words.encode())
        out.append(line)
        n += len(line)
    return b"".join(out)


class Stored:
    """A rollout stored turn by turn through ``rollout_store`` (the finalize's path), its bytes kept here
    only as a sha256 and, for small ones, the whole (``whole``)."""

    def __init__(self, session, keep_bytes: bool = True) -> None:
        self.session, self.keep_bytes = session, keep_bytes
        self.base: RolloutBase | None = None
        self.digest, self.length, self.whole = hashlib.sha256(), 0, b""

    def append(self, data: bytes) -> RolloutBase:
        self.digest.update(data)
        delta = RolloutDelta(thread_id=THREAD, relpath=RELPATH, offset=self.length, data=data,
                             length=self.length + len(data), sha256=self.digest.hexdigest(), base=self.base)
        with transaction.atomic():
            rollouts.rollout_store(session=self.session, delta=delta)
        self.length += len(data)
        if self.keep_bytes:
            self.whole += data
        self.base = rollouts.rollout_state(thread_id=THREAD)
        assert self.base is not None
        return self.base


@pytest.fixture
def stored(user) -> Stored:
    s = Stored(services.session_create(owner=user))
    rnd = random.Random(5)
    for turn in range(6):
        s.append(_turn_lines(turn, 20_000 if turn else 36_000, rnd))
    return s


@pytest.fixture
def streamed(monkeypatch) -> list[int]:
    """The uncompressed bytes each restore read from PostgreSQL (``rollout_stream``'s pieces), one total per call."""
    totals: list[int] = []
    real = rollouts.rollout_stream

    def counting(**kwargs):
        totals.append(0)
        for piece in real(**kwargs):
            totals[-1] += len(piece)
            yield piece

    monkeypatch.setattr(rollouts, "rollout_stream", counting)
    return totals


def _file(home: Path) -> Path:
    return home / RELPATH


def test_a_host_holding_the_prefix_writes_only_the_appended_chunks(stored, tmp_path, streamed):
    home = tmp_path / "home"
    first = rollouts.rollout_write(base=stored.base, home=home)
    assert (first.kept, first.written, streamed) == (0, stored.length, [stored.length])
    inode, held = _file(home).stat().st_ino, stored.length
    rnd = random.Random(6)
    stored.append(_turn_lines(7, 20_000, rnd))
    base = stored.append(_turn_lines(8, 20_000, rnd))
    again = rollouts.rollout_write(base=base, home=home)
    assert (again.kept, again.written) == (held, stored.length - held)
    assert streamed[-1] == stored.length - held  # only the two new chunks came from PostgreSQL
    assert _file(home).read_bytes() == stored.whole and _file(home).stat().st_ino == inode
    # Nothing new stored: nothing read, nothing written.
    assert rollouts.rollout_write(base=base, home=home).written == 0 and streamed[-1] == 0


def _tamper_middle(path: Path, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(len(data) // 2)
        fh.write(b"X")


def _truncate(path: Path, data: bytes) -> None:
    os.truncate(path, len(data) // 2)


def _same_ends_on_a_reused_inode(path: Path, data: bytes) -> None:
    """Another file of the same length, first and last 4 KB at the same path — ext4 hands the freed inode
    back, so device, inode and size match what was known; only its middle differs."""
    path.unlink()
    middle = len(data) // 2
    path.write_bytes(data[:middle] + b"Y" + data[middle + 1:])


def _longer(path: Path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(b'{"a turn":"that was never stored"}\n')


@pytest.mark.parametrize("change", [_tamper_middle, _truncate, _same_ends_on_a_reused_inode, _longer])
def test_a_copy_that_is_not_the_known_prefix_is_restored_in_full(stored, tmp_path, streamed, change):
    home = tmp_path / "home"
    rollouts.rollout_write(base=stored.base, home=home)
    change(_file(home), stored.whole)
    base = stored.append(_turn_lines(9, 20_000, random.Random(9)))
    restored = rollouts.rollout_write(base=base, home=home)
    assert (restored.kept, restored.written) == (0, stored.length) and streamed[-1] == stored.length
    assert _file(home).read_bytes() == stored.whole


def test_a_prefix_of_another_rollout_falls_back_to_the_full_restore(stored, tmp_path, streamed):
    """A held copy whose bytes the stored chunks do not extend (the final sha256 differs) is cut back and
    the rollout restored in full."""
    home = tmp_path / "home"
    rollouts.rollout_write(base=stored.base, home=home)
    other = RolloutBase(THREAD, RELPATH, stored.length + 5, "0" * 64, 99)  # a record the chunks do not match
    with pytest.raises(RolloutDiverged):
        rollouts.rollout_write(base=other, home=home)
    assert rollout_files.KNOWN.held(_file(home)) is None
    restored = rollouts.rollout_write(base=stored.base, home=home)
    assert restored.kept == 0 and _file(home).read_bytes() == stored.whole


def test_a_damaged_appended_chunk_fails_the_restore_and_leaves_no_wrong_file(stored, tmp_path):
    home = tmp_path / "home"
    rollouts.rollout_write(base=stored.base, home=home)
    base = stored.append(b'{"turn":"new"}\n' * 100)
    RolloutChunk.objects.filter(rollout__thread_id=THREAD, seq=base.generation).update(sha256="0" * 64)
    with pytest.raises(RolloutDiverged, match="damaged"):
        rollouts.rollout_write(base=base, home=home)
    assert not _file(home).exists() or _file(home).read_bytes() != stored.whole
    assert [p.name for p in _file(home).parent.iterdir() if p.name.startswith(".restore-")] == []


def test_a_full_restore_streams_a_50_mb_rollout_in_bounded_memory(user, tmp_path):
    s = Stored(services.session_create(owner=user), keep_bytes=False)
    rnd = random.Random(50)
    part = _turn_lines(0, 1 << 20, rnd)
    for turn in range(50):  # 50 turns of ~1 MB: ~50 MB stored as 50 chunks
        s.append(part[turn:] + part[:turn])
    rollout_files.KNOWN.forget(_file(tmp_path / "home"))
    tracemalloc.start()
    try:
        restored = rollouts.rollout_write(base=s.base, home=tmp_path / "home")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert restored.written == s.length > 50_000_000
    assert peak < 12 * (1 << 20), f"peak {peak / (1 << 20):.1f} MiB for a {s.length / (1 << 20):.0f} MiB rollout"
    assert hashlib.sha256(_file(tmp_path / "home").read_bytes()).hexdigest() == s.digest.hexdigest()


def test_a_chunk_stored_larger_than_a_slice_is_read_in_slices(user, tmp_path):
    """One chunk of 16 MiB (an imported rollout is one chunk), stored as ~8.5 MiB of zlib: read a slice at
    a time — a slice, its uncompressed piece and zlib's buffers, whatever the chunk's size."""
    s = Stored(services.session_create(owner=user), keep_bytes=False)
    s.append(os.urandom(8 << 20).hex().encode())
    tracemalloc.start()
    try:
        restored = rollouts.rollout_write(base=s.base, home=tmp_path / "home")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert restored.written == 16 << 20 and peak < 6 * rollouts.RESTORE_SLICE
    assert hashlib.sha256(_file(tmp_path / "home").read_bytes()).hexdigest() == s.digest.hexdigest()
