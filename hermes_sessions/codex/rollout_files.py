"""Codex's rollout file of a thread, on a worker's disk: find it, restore it, read what a turn appended.

Facts this rests on (``docs/codex.md`` §7):

- a thread's rollout is ``CODEX_HOME/sessions/…/rollout-<ts>-<thread id>.jsonl``; ``thread/resume``
  finds it by scanning ``sessions/`` for that name, at any depth — so restoring the file alone at its
  original relative path moves the thread to another home;
- it is append-only: a turn adds bytes at the end; a plain ``thread/resume`` (no overrides) writes
  nothing; the file is complete when ``turn/completed`` arrives, and closing the app-server adds
  nothing;
- a stale copy resumes without error and silently drops the newer turns — so a restored file is
  verified (length, sha256) before codex sees it, and a file whose prefix no longer matches what was
  stored is refused (``RolloutDiverged``), never stored.

A file this process wrote or read last (``KNOWN``) is checked after a turn without reading its prefix
again: same file (device and inode), not shorter, the same first and last ``TAIL_BYTES`` of the stored
length; the sha256 goes on from the kept hash state. Reading and hashing the whole file each turn cost
O(rollout) — ~0.15 ms at 136 KB, ~0.9 ms at 1.5 MB on this machine, growing with every turn of a
session — where the appended bytes are a few KB. What this gives up: a change *inside* the
prefix, away from both ends, by a writer other than codex's appends and this module (none exists in the
service: restores go through ``write_rollout``, which renews ``KNOWN``; ``write_leftover`` forgets it; a
kept thread's file is stamp-checked before its turn) is no longer seen at capture. It would not change
the conversation either: codex reads the file only at ``thread/resume``, right after the restore
verified it, and appends to the history it loaded then (``tests/codex/test_rollout_known.py``).

A restore is O(appended) on a host that holds a verified copy (``held_prefix``): the file is the one
``KNOWN`` holds — same device, inode, size, mtime and ctime as when this process last wrote or read it
(any write to it since changes its ctime, which no user can set back; Linux ≥ 6.13 gives it a finer
grain once it was read, so even a write within the same tick shows), and the same first and last
``TAIL_BYTES`` — and a prefix of the stored rollout no longer than it; only the bytes after it are
appended (``restore_rollout`` with an ``offset``), and the whole file's sha256, continued from the kept
hash state, must equal the stored one, or the caller restores in full. A full restore streams the
stored bytes into a temporary file (never the whole rollout in memory), verifies length and sha256,
then renames it into place. ``tests/codex/test_rollout_restore.py``, ``tests/services/test_rollouts.py``.

Nothing here touches the database; ``hermes_sessions.services.rollouts`` does.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


class RolloutDiverged(Exception):
    """The rollout file on disk is not an extension of the bytes PostgreSQL holds (or the restored
    file does not match them): the copy diverged, and nothing may be stored from it."""


@dataclass(frozen=True)
class RolloutBase:
    """What a turn started from: ``thread_id``'s stored rollout — ``relpath`` (relative to
    ``CODEX_HOME``), ``length`` (bytes), ``sha256`` (hex of those bytes) and the fencing
    ``generation`` read with it. ``generation`` 0 with ``length`` 0: nothing stored yet."""

    thread_id: str
    relpath: str
    length: int
    sha256: str
    generation: int


@dataclass(frozen=True)
class RolloutDelta:
    """What a turn appended to ``thread_id``'s rollout: ``data`` (bytes from ``offset``), the file's
    ``relpath``, its new total ``length`` and ``sha256`` (hex, of the whole file), and ``base`` — the
    stored rollout it extends (``None``: a new thread, ``offset`` 0)."""

    thread_id: str
    relpath: str
    offset: int
    data: bytes
    length: int
    sha256: str
    base: RolloutBase | None


def find_rollout(home: Path, thread_id: str) -> Path | None:
    """The rollout of ``thread_id`` under ``home/sessions`` (any depth), or ``None``. More than one
    match (codex would pick one unpredictably) raises ``RolloutDiverged``."""
    found = sorted((home / "sessions").glob(f"**/rollout-*-{thread_id}.jsonl"))
    if len(found) > 1:
        raise RolloutDiverged(f"{len(found)} rollout files for thread {thread_id} under {home}")
    return found[0] if found else None


#: Bytes at each end of a known prefix that ``read_delta`` compares (with the file's identity and length)
#: instead of hashing the whole prefix again.
TAIL_BYTES = 4096


@dataclass(frozen=True)
class _Known:
    """A rollout file as this process last wrote or read it: ``identity`` (``st_dev``, ``st_ino``),
    ``length`` and ``sha256`` (hex) of its bytes, ``digest`` (the sha256 state after them, copied before
    use), ``head`` and ``tail`` (its first and last ``TAIL_BYTES`` bytes), ``stamp`` (``st_size``,
    ``st_mtime_ns``, ``st_ctime_ns`` right after; ``None`` when the file was longer than ``length``
    then — codex still appending — so the entry may extend a capture but not vouch for a restore)."""

    identity: tuple[int, int]
    length: int
    sha256: str
    digest: Any
    head: bytes
    tail: bytes
    stamp: tuple[int, int, int] | None = None


def _stamp(st: os.stat_result, length: int) -> tuple[int, int, int] | None:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns) if st.st_size == length else None


class KnownPrefixes:
    """The rollout files this process wrote (a restore) or read (a turn's capture) last, by path — at most
    ``size``, least recently used dropped first. Thread-safe. A miss only costs the full read."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._known: OrderedDict[str, _Known] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, path: Path, data: bytes, digest: Any) -> None:
        """``path`` now holds ``data`` (whole file), whose sha256 state is ``digest`` (not used afterwards)."""
        try:
            st = path.stat()
        except OSError:
            return
        self.put(path, _Known((st.st_dev, st.st_ino), len(data), digest.hexdigest(), digest,
                              bytes(data[:TAIL_BYTES]), bytes(data[-TAIL_BYTES:]), _stamp(st, len(data))))

    def put(self, path: Path, known: _Known) -> None:
        with self._lock:
            self._known[str(path)] = known
            self._known.move_to_end(str(path))
            while len(self._known) > self.size:
                self._known.popitem(last=False)

    def get(self, path: Path, base: RolloutBase) -> _Known | None:
        """What is known of ``path`` if it is ``base`` (same length and sha256), else ``None``."""
        with self._lock:
            known = self._known.get(str(path))
        if known is None or known.length != base.length or known.sha256 != base.sha256:
            return None
        return known

    def held(self, path: Path) -> _Known | None:
        """What is known of ``path`` if the file there is still exactly that (module docstring): same
        identity and stamp, same first and last ``TAIL_BYTES``; else ``None`` (and forgotten)."""
        with self._lock:
            known = self._known.get(str(path))
        if known is None or known.stamp is None:
            return None
        try:
            with open(path, "rb") as fh:
                st = os.fstat(fh.fileno())
                same = ((st.st_dev, st.st_ino) == known.identity and _stamp(st, known.length) == known.stamp
                        and fh.read(TAIL_BYTES) == known.head)
                if same:
                    fh.seek(max(0, known.length - TAIL_BYTES))
                    same = fh.read(TAIL_BYTES) == known.tail
        except OSError:
            same = False
        if not same:
            self.forget(path)
            return None
        return known

    def forget(self, path: Path) -> None:
        with self._lock:
            self._known.pop(str(path), None)

    def _after_fork(self) -> None:
        # A forked child (Celery's prefork pool, gunicorn's workers) starts empty, with a lock nobody holds.
        self._known, self._lock = OrderedDict(), threading.Lock()


KNOWN = KnownPrefixes()
os.register_at_fork(after_in_child=KNOWN._after_fork)


@dataclass(frozen=True)
class Restored:
    """What ``restore_rollout`` did: the file's ``path``, ``kept`` bytes of it left as they were (a held
    prefix) and ``written`` bytes written."""

    path: Path
    kept: int
    written: int


def _target(home: Path, base: RolloutBase) -> Path:
    target = (home / base.relpath).resolve()
    if not target.is_relative_to(home / "sessions") or not target.name.endswith(f"-{base.thread_id}.jsonl"):
        raise RolloutDiverged(f"stored rollout path {base.relpath!r} is not a rollout under sessions/")
    return target


def held_prefix(home: Path, base: RolloutBase) -> int:
    """Bytes of ``base`` that ``home`` already holds, verified as the module docstring says: the length of
    the file at ``base.relpath`` when this process knows it unchanged and it is no longer than ``base``;
    0 otherwise (no file, unknown, changed, longer). Whether they are ``base``'s bytes is settled by
    ``restore_rollout``'s final sha256."""
    try:
        target = _target(home, base)
    except RolloutDiverged:
        return 0
    known = KNOWN.held(target)
    return known.length if known is not None and known.length <= base.length else 0


def _rollout_in(home: Path, thread_id: str | None) -> Path | None:
    """``thread_id``'s one rollout file under ``home``; ``None`` when there is none (or several)."""
    if not thread_id or not home.is_dir():
        return None
    try:
        return find_rollout(home, thread_id)
    except RolloutDiverged:
        return None


def held_rollout(home: Path, thread_id: str | None) -> Path | None:
    """The rollout of ``thread_id`` under ``home`` if this process holds it unchanged (``KNOWN.held``):
    the file a wipe of the home keeps for the next restore (``launch.prepare_session_home``), with
    codex's projection of it (``codex_state_files``)."""
    path = _rollout_in(home, thread_id)
    return path if path is not None and KNOWN.held(path) is not None else None


#: Codex's sqlite files that are derived from the rollouts of a home (0.171.0, observed and read in its
#: source, ``docs/codex.md`` §7): ``state_<v>.sqlite`` indexes the threads (a start-up backfill reads every
#: rollout under ``sessions/`` when it finds none: part of ``initialize``), ``thread_history_<v>.sqlite``
#: projects a thread's rollout into turns and items with a cursor (``next_rollout_byte_offset`` and the
#: ordinal of the line before it), which ``thread/resume`` extends from the cursor when the file still
#: agrees with it, and rebuilds from byte 0 when the file is missing. Both cost O(rollout) CPU when
#: absent: ~0.4 s and ~0.9 s at 20 MB. Each with its WAL, shared-memory and rollback-journal companions.
CODEX_STATE_PATTERNS = ("state_*.sqlite", "thread_history_*.sqlite")
_SQLITE_COMPANIONS = ("", "-wal", "-shm", "-journal")


def codex_state_files(home: Path) -> list[Path]:
    """The files of ``CODEX_STATE_PATTERNS`` in ``home`` (with their companions), as they exist now."""
    names = {p.name for pattern in CODEX_STATE_PATTERNS for p in home.glob(pattern)}
    return sorted(home / f"{name}{suffix}" for name in names for suffix in _SQLITE_COMPANIONS
                  if (home / f"{name}{suffix}").exists())


def drop_codex_state(home: Path) -> None:
    """Remove codex's projection of the rollouts (``codex_state_files``) from ``home``: the file it was
    built from is no longer the one in place (a full restore, a removed or rewritten rollout). Codex
    rebuilds it from the rollout at its next start and ``thread/resume``."""
    for path in codex_state_files(home):
        path.unlink(missing_ok=True)


def file_identity(path: Path | None) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``path``, or ``None`` when there is no such file."""
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


class _Ends:
    """The first and last ``TAIL_BYTES`` of a stream of pieces, kept as they pass."""

    def __init__(self, head: bytes = b"", tail: bytes = b"") -> None:
        self.head, self.tail = head, tail

    def add(self, piece: bytes) -> None:
        if len(self.head) < TAIL_BYTES:
            self.head += piece[: TAIL_BYTES - len(self.head)]
        self.tail = (self.tail + piece[-TAIL_BYTES:])[-TAIL_BYTES:]


def restore_rollout(home: Path, base: RolloutBase, pieces: Iterable[bytes], *, offset: int = 0) -> Restored:
    """Make ``home/<base.relpath>`` hold ``base``'s bytes, verified (length, sha256) before codex sees it.

    ``offset`` 0: ``pieces`` are the whole rollout, streamed into a temporary file beside the target
    (a name codex never reads), fsynced, checked and renamed into place — memory holds one piece at a
    time. ``offset`` > 0: the file holds ``base``'s first ``offset`` bytes (``held_prefix`` said so) and
    ``pieces`` are the rest, appended; the sha256 continues from the kept hash state. Raises
    ``RolloutDiverged`` when the result does not match ``base`` (nothing is left in place: a temporary
    file is removed, an appended file cut back and forgotten — the caller then restores in full), when
    the held file changed meanwhile, or when the relpath leaves ``home/sessions``. Exceptions raised by
    ``pieces`` (a damaged stored chunk, a lost connection) propagate the same way."""
    target = _target(home, base)
    target.parent.mkdir(parents=True, exist_ok=True)
    fh: IO[bytes]
    if offset:
        known = KNOWN.held(target)
        if known is None or known.length != offset:
            raise RolloutDiverged(f"the rollout of thread {base.thread_id} on this host changed before its restore")
        digest, ends, fh = known.digest.copy(), _Ends(known.head, known.tail), open(target, "r+b")  # noqa: SIM115
        fh.seek(offset)
        tmp = target
    else:
        digest, ends = hashlib.sha256(), _Ends()
        tmp = target.with_name(f".restore-{os.getpid()}-{threading.get_ident()}.tmp")
        fh = open(tmp, "wb")  # noqa: SIM115 — closed in the finally below
    length = offset
    try:
        with fh:
            for piece in pieces:
                fh.write(piece)
                digest.update(piece)
                ends.add(piece)
                length += len(piece)
            if length != base.length or digest.hexdigest() != base.sha256:
                raise RolloutDiverged(
                    f"the rollout of thread {base.thread_id} restored from PostgreSQL does not match its record "
                    f"({length} bytes{f' on {offset} held' if offset else ''}, expected {base.length})")
            fh.flush()
            os.fsync(fh.fileno())
        if not offset:
            os.replace(tmp, target)
    except BaseException:
        KNOWN.forget(target)
        if offset:
            with open(target, "r+b") as cut:
                cut.truncate(offset)
        else:
            tmp.unlink(missing_ok=True)
        raise
    st = target.stat()
    KNOWN.put(target, _Known((st.st_dev, st.st_ino), length, base.sha256, digest, ends.head, ends.tail,
                             _stamp(st, length)))
    return Restored(path=target, kept=offset, written=length - offset)


def write_rollout(home: Path, base: RolloutBase, data: bytes) -> Path:
    """Write ``data`` (the whole stored rollout) to ``home/<base.relpath>`` and verify it against
    ``base`` (length and sha256) before codex may see it: ``restore_rollout`` of one piece. Raises
    ``RolloutDiverged`` on a mismatch or a relpath that leaves ``home/sessions``."""
    return restore_rollout(home, base, [data]).path


def read_delta(home: Path, thread_id: str, base: RolloutBase | None) -> RolloutDelta | None:
    """After the app-server exited: the bytes codex appended to ``thread_id``'s rollout since
    ``base``. ``None`` when there is no file and nothing was stored (a thread that ran no turn).
    Raises ``RolloutDiverged`` when the stored prefix (``base.length`` bytes, ``base.sha256``) does
    not match the file's start, or the file is gone although a base was restored. A file this process
    wrote or read as ``base`` (``KNOWN``, module docstring) is read only in its first ``TAIL_BYTES`` and
    from ``TAIL_BYTES`` before ``base.length`` on."""
    path = find_rollout(home, thread_id)
    if path is None:
        if base is not None and base.length:
            raise RolloutDiverged(f"the rollout of thread {thread_id} is gone from {home} after the turn")
        return None
    if base is not None and base.length >= TAIL_BYTES and (known := KNOWN.get(path, base)) is not None:
        delta = _read_known(home, path, thread_id, base, known)
        if delta is not None:
            return delta
    data = path.read_bytes()
    offset = base.length if base is not None else 0
    # One pass over the file: the prefix's hash is checked, then extended by the appended bytes (a
    # hashlib digest leaves the object usable). Two passes cost ~0.17 ms per 300 KB each, per turn.
    view = memoryview(data)
    digest = hashlib.sha256(view[:offset])
    if base is not None and (len(data) < offset or digest.hexdigest() != base.sha256):
        raise RolloutDiverged(
            f"the rollout of thread {thread_id} no longer starts with the {offset} bytes stored in PostgreSQL; "
            "not storing a diverged copy"
        )
    digest.update(view[offset:])
    KNOWN.remember(path, data, digest.copy())  # stamped only if the file is still len(data) long
    return RolloutDelta(
        thread_id=thread_id,
        relpath=str(path.relative_to(home)),
        offset=offset,
        data=data[offset:],
        length=len(data),
        sha256=digest.hexdigest(),
        base=base,
    )


def _read_known(home: Path, path: Path, thread_id: str, base: RolloutBase, known: _Known) -> RolloutDelta | None:
    """``read_delta`` for a file this process knows as ``base`` (``KNOWN``): only the first and the last
    ``TAIL_BYTES`` of the prefix and what follows are read. ``None`` — read it all — unless the open file is
    the same (device, inode), at least ``base.length`` long and its prefix starts and ends as known."""
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        if (st.st_dev, st.st_ino) != known.identity or st.st_size < base.length:
            KNOWN.forget(path)
            return None
        head = fh.read(TAIL_BYTES)
        fh.seek(base.length - TAIL_BYTES)
        rest = fh.read()
    if head != known.head or rest[:TAIL_BYTES] != known.tail:
        KNOWN.forget(path)
        return None
    appended = rest[TAIL_BYTES:]
    digest = known.digest.copy()
    digest.update(appended)
    length, sha256 = base.length + len(appended), digest.hexdigest()
    # The file as it is now: the next turn's base once this one is stored. Stamped from a stat taken after
    # the read, only if nothing was appended since (then it may vouch for a restore, ``held_prefix``).
    try:
        stamp = _stamp(path.stat(), length)
    except OSError:
        stamp = None
    KNOWN.put(path, _Known(known.identity, length, sha256, digest, known.head, (known.tail + appended)[-TAIL_BYTES:],
                           stamp))
    return RolloutDelta(thread_id=thread_id, relpath=str(path.relative_to(home)), offset=base.length,
                        data=appended, length=length, sha256=sha256, base=base)


#: ``item_completed`` item types (lower-cased) of a turn that only talked (codex 0.171.0's rollouts; the
#: same set as ``runner._TEXT_ONLY_ITEMS`` of the API's camelCase names).
_TALK_ITEMS = frozenset({"usermessage", "agentmessage", "reasoning", "plan", "contextcompaction"})


@dataclass(frozen=True)
class Leftover:
    """A rollout found in a session's home before it is wiped: ``relpath`` and the whole ``data``."""

    thread_id: str
    relpath: str
    data: bytes

    def shows_work(self, base: RolloutBase | None) -> bool:
        """Whether what codex appended after ``base`` shows that the lost attempt's turn completed (an
        ``event_msg`` ``task_complete`` line) or did more than talk (an ``event_msg`` ``item_completed`` of a
        command, a file change, a tool call: ``_TALK_ITEMS`` apart). Only then is the leftover worth
        writing back: the re-run adopts that turn (``runner._adopt_completed_turn``) instead of running its
        input again. A turn that was cut off having only talked is run again — on the stored rollout, so
        that its input is in the thread once, not twice
        (``tests/services/test_durability.py::test_a_rerun_after_a_turn_cut_off_while_talking_sends_its_input_once``).
        Line shapes: codex 0.171.0's rollouts (item types in PascalCase: ``UserMessage``, ``CommandExecution``)."""
        tail = self.data[base.length:] if base is not None else self.data
        for line in tail.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut off by the kill
            payload = entry.get("payload") if isinstance(entry, dict) else None
            if not isinstance(payload, dict) or entry.get("type") != "event_msg":
                continue
            if payload.get("type") == "task_complete":
                return True
            item = payload.get("item")
            if payload.get("type") == "item_completed" and isinstance(item, dict):
                kind = str(item.get("type") or "").lower()
                if kind and kind not in _TALK_ITEMS:
                    return True
        return False

    def extends(self, base: RolloutBase | None) -> bool:
        """True when these bytes are ``base`` plus an append (or ``base`` is ``None``): codex resumes an
        extension of what it wrote before without losing anything (append-only, ``docs/codex.md`` §7)."""
        if base is None:
            return True
        return len(self.data) > base.length and hashlib.sha256(self.data[: base.length]).hexdigest() == base.sha256


def read_leftover(home: Path, thread_id: str | None) -> Leftover | None:
    """The rollout of ``thread_id`` still in ``home`` (a lost worker's, on this host), or ``None``."""
    path = _rollout_in(home, thread_id)
    if path is None or thread_id is None:
        return None
    return Leftover(thread_id=thread_id, relpath=str(path.relative_to(home)), data=path.read_bytes())


def write_leftover(home: Path, leftover: Leftover) -> None:
    """Put a leftover rollout back into the freshly made ``home``, at its relative path."""
    target = (home / leftover.relpath).resolve()
    if not target.is_relative_to(home / "sessions"):
        raise RolloutDiverged(f"leftover rollout path {leftover.relpath!r} is not under sessions/")
    target.parent.mkdir(parents=True, exist_ok=True)
    KNOWN.forget(target)  # written in place: not the bytes this process knew there
    target.write_bytes(leftover.data)
