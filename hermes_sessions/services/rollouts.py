"""Codex rollouts in PostgreSQL: the only code that writes ``CodexRollout`` and ``RolloutChunk`` rows.

PostgreSQL is the source of truth for a thread's rollout (``docs/contract.md`` I8); a worker's disk
is a cache wiped at every turn but for the rollout this process holds verified and codex's sqlite
projection of it (``launch.prepare_session_home``). Per turn (``execution.py``):

    turn_claim        reads the bound thread's generation g (``rollout_state``)
    rollout_restore   writes the stored bytes into the session's fresh CODEX_HOME at the original
                      relative path and verifies length + sha256 (a rollout still in the legacy shared
                      ``settings.CODEX_HOME`` is imported first: ``rollout_import``) — only the chunks
                      after the verified copy this host still holds (``rollout_files.held_prefix``), else
                      all of them, streamed a slice at a time (``RESTORE_SLICE``)
    … codex runs the turn; the app-server exits; ``codex.rollout_files.read_delta`` checks the prefix …
    rollout_store     inside the turn's finalize transaction: one insert-only chunk with the appended
                      bytes, and ``UPDATE … SET generation = g+1 WHERE generation = g``; a generation
                      that moved on raises ``RolloutFenced`` and the whole finalize commits nothing

Chunks are compressed with zlib when that makes them smaller (``compression = "zlib"``; measured in
the README: codex's JSONL shrinks to about a fifth).
"""
from __future__ import annotations

import hashlib
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from ..codex.rollout_files import (
    Restored,
    RolloutBase,
    RolloutDelta,
    RolloutDiverged,
    find_rollout,
    held_prefix,
    restore_rollout,
)
from ..models import CodexRollout, RolloutChunk, Session
from ..sql import query
from .pipelining import Batch, Later
from .verbatim import rows_insert_verbatim

logger = logging.getLogger(__name__)

ZLIB_LEVEL = 6
#: A restore brings at most this many stored bytes from PostgreSQL at once (a row, or a slice of a larger
#: chunk), and decompresses at most this many bytes at a time: its memory does not grow with the rollout.
RESTORE_SLICE = 1 << 20
#: Chunks per query of a restore (each at most ``RESTORE_SLICE`` stored bytes in the row).
RESTORE_BATCH = 8


class RolloutFenced(Exception):
    """The stored rollout moved on (another writer committed generation g+1, or created it) since this
    worker read generation g: its turn must commit nothing."""


def _base(row: CodexRollout) -> RolloutBase:
    return RolloutBase(thread_id=row.thread_id, relpath=row.relpath, length=row.length, sha256=row.sha256,
                       generation=row.generation)


def rollout_state(*, thread_id: str | None) -> RolloutBase | None:
    """The stored rollout of ``thread_id`` (no bytes loaded), or ``None`` when PostgreSQL holds none."""
    if not thread_id:
        return None
    # codex answers with the canonical lower-case spelling of a thread's UUID (docs/codex.md §3).
    row = CodexRollout.objects.filter(thread_id=thread_id.lower()).first()
    return _base(row) if row is not None else None


def _encode(data: bytes) -> tuple[bytes, str]:
    packed = zlib.compress(data, ZLIB_LEVEL)
    return (packed, "zlib") if len(packed) < len(data) else (data, "")


def _decode(data: bytes, compression: str) -> bytes:
    if compression == "zlib":
        return zlib.decompress(data)
    if compression:
        raise RolloutDiverged(f"unknown rollout chunk compression {compression!r}")
    return data


def rollout_load(*, base: RolloutBase) -> bytes:
    """The whole stored rollout of ``base.thread_id``: its chunks in ``seq`` order, each checked
    (offset, size, sha256). Raises ``RolloutDiverged`` when they do not add up to ``base``."""
    parts: list[bytes] = []
    length = 0
    chunks = RolloutChunk.objects.filter(rollout__thread_id=base.thread_id).order_by("seq")
    for chunk in chunks.values_list("offset", "size", "compression", "data", "sha256").iterator():
        offset, size, compression, data, sha = chunk
        raw = _decode(bytes(data), compression)
        if offset != length or len(raw) != size or hashlib.sha256(raw).hexdigest() != sha:
            raise RolloutDiverged(f"stored rollout chunk of thread {base.thread_id} at offset {offset} is damaged")
        parts.append(raw)
        length += size
    return b"".join(parts)


def _insert_chunk(rollout: CodexRollout, *, seq: int, offset: int, data: bytes) -> None:
    if not data:
        return
    stored, compression = _encode(data)
    RolloutChunk.objects.create(rollout=rollout, seq=seq, offset=offset, size=len(data), compression=compression,
                                data=stored, sha256=hashlib.sha256(data).hexdigest())


def rollout_import(*, session_id: str, thread_id: str, home: Path | None = None) -> RolloutBase | None:
    """Import ``thread_id``'s rollout from a home on disk (default: the legacy shared
    ``settings.CODEX_HOME``, where rollouts lived before PostgreSQL kept them) unless PostgreSQL
    already holds it. Returns the stored rollout, or ``None`` when neither has one. Its own
    transaction; a concurrent import of the same thread keeps the first one."""
    thread_id = thread_id.lower()
    stored = rollout_state(thread_id=thread_id)
    if stored is not None:
        return stored
    source = Path(home or settings.CODEX_HOME).resolve()
    path = find_rollout(source, thread_id)
    if path is None:
        return None
    data = path.read_bytes()
    try:
        with transaction.atomic():
            row = CodexRollout.objects.create(
                thread_id=thread_id, session_id=session_id, relpath=str(path.relative_to(source)), length=len(data),
                sha256=hashlib.sha256(data).hexdigest(), generation=1, codex_version="imported",
            )
            _insert_chunk(row, seq=1, offset=0, data=data)
    except IntegrityError:
        logger.info("rollout of thread %s was imported concurrently", thread_id)
    else:
        logger.info("imported the rollout of thread %s from %s (%d bytes)", thread_id, path, len(data))
    return rollout_state(thread_id=thread_id)


def rollout_restore(*, session_id: str, thread_id: str | None, generation: int | None, home: Path) -> RolloutBase | None:
    """Put ``thread_id``'s stored rollout into ``home`` (a session's freshly wiped ``CODEX_HOME``, which
    may have kept the rollout file this process left there) at its original relative path, verified
    before ``thread/resume`` sees it. ``generation`` is what the claim read (``None``: PostgreSQL held no
    rollout then — one in the legacy home is imported now). Returns what was restored (the base a turn's
    delta extends), or ``None`` when there is no stored rollout anywhere (codex will then say ``no rollout
    found``, and the thread truly is gone). Raises ``RolloutFenced`` when the generation moved on since
    the claim, ``RolloutDiverged`` when the stored bytes do not verify."""
    if not thread_id:
        return None
    base = rollout_state(thread_id=thread_id) if generation is not None else rollout_import(
        session_id=session_id, thread_id=thread_id)
    if base is None:
        _forget_held(home, thread_id)  # forgotten since the claim: a copy kept here must not resume it
        return None
    if generation is not None and base.generation != generation:
        raise RolloutFenced(f"rollout of thread {thread_id} is at generation {base.generation}, claimed at {generation}")
    rollout_write(base=base, home=home)
    return base


def _forget_held(home: Path, thread_id: str) -> None:
    """Remove ``thread_id``'s rollout file from ``home`` if one was kept there."""
    try:
        path = find_rollout(home, thread_id)
    except RolloutDiverged:
        return
    if path is not None:
        path.unlink(missing_ok=True)


def rollout_write(*, base: RolloutBase, home: Path) -> Restored:
    """Write ``base`` into ``home``: the chunks after the verified prefix ``home`` holds
    (``rollout_files.held_prefix``), or — none held, or the held copy did not extend to ``base`` — every
    chunk, streamed. Returns what was kept and written. Raises ``RolloutDiverged`` when the stored chunks
    do not verify."""
    held = held_prefix(home, base)
    if held:
        try:
            return restore_rollout(home, base, rollout_stream(base=base, start=held), offset=held)
        except RolloutDiverged as exc:
            logger.info("rollout of thread %s: the %d bytes held on this host did not extend to the stored ones "
                        "(%s); restoring it in full", base.thread_id, held, exc)
    return restore_rollout(home, base, rollout_stream(base=base, start=0))


def rollout_stream(*, base: RolloutBase, start: int = 0) -> Iterator[bytes]:
    """The stored bytes of ``base.thread_id``'s rollout from byte ``start`` (a chunk boundary) to its end,
    uncompressed, in pieces of at most ``RESTORE_SLICE`` bytes; each chunk checked (offset, size, sha256)
    as it ends. A query per ``RESTORE_BATCH`` chunks (``rollout_chunks_from``) and per slice of a chunk
    stored larger than ``RESTORE_SLICE`` (``rollout_chunk_slice``); no transaction is held between them
    (a chunk is insert-only: what was read stays true). Raises ``RolloutDiverged`` when no chunk starts at
    ``start``, a chunk is damaged, or they end before ``base.length``."""
    length = start
    while length < base.length:
        with connection.cursor() as cursor:
            cursor.execute(query("rollout_chunks_from"), {"thread": base.thread_id, "start": length,
                                                          "limit": RESTORE_BATCH, "slice": RESTORE_SLICE})
            rows = cursor.fetchall()
        if not rows:
            break
        for rollout_id, seq, offset, size, compression, sha, stored_length, data in rows:
            if offset != length:
                raise RolloutDiverged(f"stored rollout of thread {base.thread_id}: no chunk starts at byte {length}")
            stored = [bytes(data)] if data is not None else _slices(rollout_id, seq, stored_length)
            digest, produced = hashlib.sha256(), 0
            for piece in _decoded(stored, compression):
                digest.update(piece)
                produced += len(piece)
                yield piece
            if produced != size or digest.hexdigest() != sha:
                raise RolloutDiverged(f"stored rollout chunk of thread {base.thread_id} at offset {offset} is damaged")
            length += size
            if length >= base.length:
                break
    if length != base.length:
        raise RolloutDiverged(f"stored rollout of thread {base.thread_id} ends at byte {length}, its record at "
                              f"{base.length}")


def _slices(rollout_id: int, seq: int, stored_length: int) -> Iterator[bytes]:
    for at in range(0, stored_length, RESTORE_SLICE):
        with connection.cursor() as cursor:
            cursor.execute(query("rollout_chunk_slice"),
                           {"rollout": rollout_id, "seq": seq, "from": at + 1, "length": RESTORE_SLICE})
            (data,) = cursor.fetchone()
        yield bytes(data)


def _decoded(stored: Iterator[bytes] | list[bytes], compression: str) -> Iterator[bytes]:
    """``stored`` pieces uncompressed as ``compression`` says, at most ``RESTORE_SLICE`` bytes a piece."""
    if not compression:
        yield from stored
        return
    if compression != "zlib":
        raise RolloutDiverged(f"unknown rollout chunk compression {compression!r}")
    unpack = zlib.decompressobj()
    try:
        for data in stored:
            while data:
                piece = unpack.decompress(data, RESTORE_SLICE)
                data = unpack.unconsumed_tail
                if piece:
                    yield piece
        rest = unpack.flush()  # all input consumed above: what zlib still buffers is a few bytes
        if rest:
            yield rest
    except zlib.error as exc:
        raise RolloutDiverged(f"a stored rollout chunk does not decompress: {exc}") from exc


def rollout_store(*, session: Session, delta: RolloutDelta, codex_version: str = "") -> None:
    """Append ``delta`` (what a turn added to its thread's rollout) inside the turn's finalize
    transaction, under the session lock: one chunk (insert-only) and the fenced header update
    ``generation = g+1 WHERE generation = g AND length = <base length>``. Raises ``RolloutFenced``
    when another writer moved the rollout on (the caller rolls everything back)."""
    if not connection.in_atomic_block:
        raise TransactionManagementError("rollout_store runs inside the turn's finalize transaction")
    base = delta.base
    if base is None or base.generation == 0:
        if CodexRollout.objects.filter(thread_id=delta.thread_id).exists():
            raise RolloutFenced(f"rollout of thread {delta.thread_id} was stored by another writer")
        row = CodexRollout.objects.create(
            thread_id=delta.thread_id, session=session, relpath=delta.relpath, length=delta.length,
            sha256=delta.sha256, generation=1, codex_version=codex_version[:64],
        )
        _insert_chunk(row, seq=1, offset=0, data=delta.data)
        return
    with connection.cursor() as cursor:
        cursor.execute(*_store_fenced_statement(delta, codex_version=codex_version))
        if cursor.fetchone() is None:
            raise RolloutFenced(fenced_reason(delta))


def rollout_store_batched(batch: Batch, *, delta: RolloutDelta, codex_version: str = "") -> Later[bool] | None:
    """``rollout_store`` of a rollout stored before (generation ≥ 1) as a statement batched in ``batch``
    (``pipelining``): the finalize sends it with its locks. Its value: ``False`` when fenced
    out (the caller raises ``RolloutFenced``, ``fenced_reason``, and rolls back). ``None`` for what must
    run as ``rollout_store`` once the locks are held: a first store (it checks for another writer's row
    first)."""
    if delta.base is None or delta.base.generation == 0:
        return None
    return batch.add(*_store_fenced_statement(delta, codex_version=codex_version), convert=bool)


def fenced_reason(delta: RolloutDelta) -> str:
    """``RolloutFenced``'s message for a delta whose base generation moved on."""
    generation = delta.base.generation if delta.base is not None else 0
    return f"rollout of thread {delta.thread_id} moved on from generation {generation}"


def _store_fenced_statement(delta: RolloutDelta, *, codex_version: str) -> tuple[str, dict[str, Any]]:
    """``rollout_store``'s fenced header update and its chunk as one statement (``queries.sql``:
    ``rollout_store_fenced_with_chunk``, or ``rollout_store_fenced`` for a delta without bytes), and its
    parameters. The ORM's ``update()`` returns no id, which cost a third query."""
    base = delta.base
    assert base is not None
    params: dict[str, Any] = {
        "length": delta.length, "sha256": delta.sha256, "next": base.generation + 1, "relpath": delta.relpath,
        "version": codex_version[:64], "now": timezone.now(), "thread": delta.thread_id,
        "generation": base.generation, "base_length": base.length, "base_sha256": base.sha256}
    if not delta.data:
        return query("rollout_store_fenced"), params
    stored, compression = _encode(delta.data)
    params.update(seq=base.generation + 1, offset=delta.offset, size=len(delta.data), compression=compression,
                  data=stored, chunk_sha256=hashlib.sha256(delta.data).hexdigest())
    return query("rollout_store_fenced_with_chunk"), params


def rollout_forget(*, thread_id: str) -> int:
    """Delete ``thread_id``'s stored rollout, chunks included (an operator's decision, or the demo's
    "rollout lost"). Returns how many rollouts were deleted (0 or 1)."""
    with transaction.atomic():
        deleted, by_model = CodexRollout.objects.filter(thread_id=thread_id).delete()
    return by_model.get(CodexRollout._meta.label, 0)


def rollout_insert_verified(*, rollout: CodexRollout, chunks: list[RolloutChunk]) -> None:
    """Store an exported rollout (``manage.py import_sessions``) byte for byte: the header row and
    its chunks exactly as exported (stored bytes, compression, seq, times), after checking that the
    chunks decode to ``rollout.length`` bytes with ``rollout.sha256``, each at its offset with its
    size and sha256. Inside the import's transaction. Raises ``RolloutDiverged`` when they do not
    verify (nothing is written), ``IntegrityError`` when the thread is already stored."""
    digest = hashlib.sha256()
    length = 0
    for chunk in sorted(chunks, key=lambda c: c.seq):
        raw = _decode(bytes(chunk.data), chunk.compression)
        if chunk.offset != length or len(raw) != chunk.size or hashlib.sha256(raw).hexdigest() != chunk.sha256:
            raise RolloutDiverged(f"rollout of thread {rollout.thread_id}: chunk {chunk.seq} does not verify "
                                  f"(offset {chunk.offset}, size {chunk.size})")
        digest.update(raw)
        length += len(raw)
    if length != rollout.length or digest.hexdigest() != rollout.sha256:
        raise RolloutDiverged(f"rollout of thread {rollout.thread_id}: chunks give {length} bytes, sha256 "
                              f"{digest.hexdigest()}; the header says {rollout.length} bytes, {rollout.sha256}")
    (stored,) = rows_insert_verbatim([rollout])
    for chunk in chunks:
        chunk.rollout = stored
    rows_insert_verbatim(chunks)
