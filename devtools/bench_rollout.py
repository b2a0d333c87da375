"""A cold turn of a session whose rollout is 100 MB against one whose rollout is 1 MB, on a host that has seen
the rollout (it restored or read it last: ``rollout_files.held_prefix``) and on one that has not (the
session's home wiped, nothing known), with the real pinned codex, the model stand-in and PostgreSQL.

Each session's rollout is what a long coding session writes. Its first turn runs through the service; then
codex itself, in the session's home with the session's command line and environment, runs ``SEED_TURNS``
more (user messages and the shell commands the stand-in's ``RUNCMD`` asks for: ``response_item`` messages,
``function_call`` and ``function_call_output`` lines, ``turn_context``, ``token_count`` … per turn) with a
``thread/compact/start`` every ``COMPACT_EVERY`` turns (a ``compacted`` line: a long session compacts as
its context fills, so the model's history stays bounded); those bytes are stored a chunk per turn, as the
finalize stores them. The rollout is then grown to its size with copies of those compaction cycles —
whole turns, each line with the next ``ordinal`` (codex's projection requires them consecutive) and fresh
turn, item, call and response ids — stored a chunk per turn. Every timed turn is cold
(``HERMES_WARM_IDLE_SECONDS=0``): claim, restore, spawn, ``initialize``, ``thread/resume``, the turn,
capture, finalize, timed in this process with the task run eagerly (no broker, no HTTP: the part that grows
with the rollout is the worker's and codex's). Rounds alternate the sizes.

Printed (``bench_figures.parse_figures``): ``cold_turn_100mb_vs_1mb_seen`` (target ≤ 1.2) and
``cold_turn_100mb_vs_1mb_unseen``, the medians behind them, the worker's ``restore_ms`` and every phase the
worker times (``initialize_ms``: spawn + ``initialize``, ``thread_ms``: ``thread/resume``, …). Needs
``DATABASE_URL`` (a ``*_rollout_bench`` database is made beside it and dropped after). Run alone:
``python -m devtools.bench_rollout [--rounds N] [--big-mb 100] [--small-mb 1]``; ``make bench`` runs it
with ``--rollout-rounds``.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from devtools.databases import create_database, database_beside, drop_database
from devtools.model_stand_in import ModelStandIn

#: Turns codex runs for real in each session after its first, and how often it compacts among them.
SEED_TURNS = 50
COMPACT_EVERY = 25
SEED_TEXTS = (
    "RUNCMD ls -la /usr/bin | head -60",
    "please summarise the design of the module in two paragraphs " * 5,
    "RUNCMD seq 1 400",
    "RUNCMD cat /etc/services | head -80",
    "ok, next step",
    "RUNCMD python3 -c 'import sys; print(sys.version)'",
)
_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_HEX_ID = re.compile(rb"(?:(?<=msg_)|(?<=call_)|(?<=resp_))[0-9a-f]{12,16}(?![0-9a-f-])")
_ORDINAL = re.compile(rb'^(\{"timestamp":"[^"]*","ordinal":)(\d+)')


def _setup(db_url: str, scratch: Path, stand_in_url: str) -> Any:
    os.environ.update({
        "DATABASE_URL": db_url, "CELERY_TASK_ALWAYS_EAGER": "1", "CODEX_MODEL_PROVIDER": "stand-in",
        "CODEX_STAND_IN_URL": stand_in_url, "CODEX_HOMES_ROOT": str(scratch / "homes"),
        "CODEX_WORK_ROOT": str(scratch / "work"), "CODEX_HOME": str(scratch / "codex_home"),
        "CODEX_USER_HOME": str(scratch / "user_home"), "HERMES_WARM_IDLE_SECONDS": "0", "HERMES_WARM_POOL": "0",
        "HERMES_LOG_LEVEL": "WARNING",
        # No metric reports: the bench's database is dropped at its end, before the exit's last report.
        "HERMES_METRICS_REPORT_SECONDS": "0"})
    os.environ.pop("CELERY_BROKER_URL", None)
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-rollout-only")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    create_database(db_url)
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    user, _ = get_user_model().objects.get_or_create(username="bench-rollout")
    return user


def _turn(session: Any, user: Any, text: str) -> tuple[float, dict[str, Any]]:
    from hermes_sessions import services
    from hermes_sessions.models import Turn

    t0 = time.monotonic()
    turn = services.turn_enqueue(session=session, input_text=text, user=user)
    turn.refresh_from_db()
    elapsed = time.monotonic() - t0
    if turn.status != Turn.Status.SUCCEEDED:
        raise RuntimeError(f"turn {turn.id} {turn.status}: {turn.error}")
    return elapsed, dict(turn.timings or {})


def _wait_turn(client: Any) -> None:
    while (note := client.next_notification(timeout=120)) is None or note["method"] != "turn/completed":
        pass
    if note["params"]["turn"]["status"] != "completed":
        raise RuntimeError(f"seed turn {note['params']['turn']['status']}: {note['params']['turn'].get('error')}")


def _seed_turns(session: Any, thread: str) -> None:
    """Codex runs ``SEED_TURNS`` turns of ``thread`` in the session's home (the home the service's last turn
    left, its command line and environment), compacting every ``COMPACT_EVERY``; then exits."""
    from hermes_sessions.codex.client import AppServerClient
    from hermes_sessions.codex.launch import app_server_argv, app_server_env, session_home
    from hermes_sessions.policy import session_workdir

    workdir = session_workdir(session.id)
    sandbox = (session.model_config or {}).get("sandbox", "read-only")
    client = AppServerClient(app_server_argv(sandbox=sandbox, workdir=workdir), env=app_server_env(session_home(session.id)),
                             cwd=str(workdir), request_timeout=120)
    client.start()
    try:
        client.request("thread/resume", {"threadId": thread, "excludeTurns": True})
        for i in range(SEED_TURNS):
            client.request("turn/start", {"threadId": thread, "input": [
                {"type": "text", "text": f"turn {i}: {SEED_TEXTS[i % len(SEED_TEXTS)]}", "text_elements": []}]})
            _wait_turn(client)
            if (i + 1) % COMPACT_EVERY == 0:
                client.request("thread/compact/start", {"threadId": thread})
                _wait_turn(client)
    finally:
        client.close()


def _turns(data: bytes) -> list[bytes]:
    """``data`` (whole lines) cut after each turn's ``task_complete`` line; a tail without one is the last."""
    out, start = [], 0
    for line_end in (m.end() for m in re.finditer(rb'[^\n]*"type":"task_complete"[^\n]*\n', data)):
        out.append(data[start:line_end])
        start = line_end
    return out + ([data[start:]] if start < len(data) else [])


def _cycles(data: bytes) -> list[list[bytes]]:
    """The compaction cycles of ``data``: runs of turns, each run ending with a turn that wrote a
    ``compacted`` line."""
    cycles, run = [], []
    for turn in _turns(data):
        run.append(turn)
        if b'"type":"compacted"' in turn:
            cycles.append(run)
            run = []
    return cycles


class _Renamer:
    """Copies of whole turns for a rollout: each line with the next ordinal, every UUID but the thread's and
    every ``msg_``/``call_``/``resp_`` hex id replaced by a fresh one (the same within one copy of a cycle)."""

    def __init__(self, thread: str, next_ordinal: int, seed: int = 7) -> None:
        self.thread, self.ordinal, self.rng = thread.encode(), next_ordinal, random.Random(seed)
        self.ms = int(time.time() * 1000)
        self.uuids: dict[bytes, bytes] = {}
        self.hexes: dict[bytes, bytes] = {}

    def new_cycle(self) -> None:
        self.uuids.clear()
        self.hexes.clear()

    def _uuid(self, m: re.Match[bytes]) -> bytes:
        old = m.group(0)
        if old == self.thread:
            return old
        if old not in self.uuids:
            self.ms += 1  # UUIDv7-shaped: time-ordered as codex mints them
            r = self.rng.getrandbits(74)
            h = f"{self.ms:012x}7{r >> 62 & 0xfff:03x}{8 | (r >> 60 & 3):x}{r >> 48 & 0xfff:03x}{r & (1 << 48) - 1:012x}"
            self.uuids[old] = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}".encode()
        return self.uuids[old]

    def _hex(self, m: re.Match[bytes]) -> bytes:
        old = m.group(0)
        if old not in self.hexes:
            self.hexes[old] = b"%0*x" % (len(old), self.rng.getrandbits(4 * len(old)))
        return self.hexes[old]

    def _ordinal(self, m: re.Match[bytes]) -> bytes:
        self.ordinal += 1
        return m.group(1) + str(self.ordinal - 1).encode()

    def copy(self, turn: bytes) -> bytes:
        lines = []
        for line in turn.splitlines(keepends=True):
            line, n = _ORDINAL.subn(self._ordinal, _HEX_ID.sub(self._hex, _UUID.sub(self._uuid, line)))
            if n != 1:
                raise RuntimeError(f"a rollout line without a leading ordinal: {line[:120]!r}")
            lines.append(line)
        return b"".join(lines)


def _store(session: Any, thread: str, parts: list[bytes] | Any, digest: Any, until: int | None = None) -> int:
    """Store each of ``parts`` as the next chunk of ``thread``'s rollout (as a turn's finalize does), until the
    rollout is ``until`` bytes long or more; ``digest`` is the sha256 state of the stored bytes. Returns the
    length."""
    from django.db import transaction

    from hermes_sessions.codex.rollout_files import RolloutDelta
    from hermes_sessions.services import rollouts

    base = rollouts.rollout_state(thread_id=thread)
    assert base is not None
    length = base.length
    for part in parts:
        if until is not None and length >= until:
            break
        digest.update(part)
        delta = RolloutDelta(thread_id=thread, relpath=base.relpath, offset=length, data=part,
                             length=length + len(part), sha256=digest.hexdigest(), base=base)
        with transaction.atomic():
            rollouts.rollout_store(session=session, delta=delta)
        length += len(part)
        base = rollouts.rollout_state(thread_id=thread)
        assert base is not None
    return length


def _grow(session: Any, size: int) -> int:
    """Make the session's stored rollout a long session's of about ``size`` bytes (module docstring): real
    seed turns, then copies of their compaction cycles. Returns its length."""
    from hermes_sessions.codex.launch import session_home
    from hermes_sessions.codex.rollout_files import find_rollout
    from hermes_sessions.models import CodexBinding
    from hermes_sessions.services import rollouts

    thread = CodexBinding.objects.get(session=session, status=CodexBinding.Status.ACTIVE).thread_id
    base = rollouts.rollout_state(thread_id=thread)
    assert base is not None
    _seed_turns(session, thread)
    path = find_rollout(session_home(session.id).home, thread)
    assert path is not None
    data = path.read_bytes()
    digest = hashlib.sha256(data[: base.length])
    if digest.hexdigest() != base.sha256:
        raise RuntimeError("the session's rollout on disk does not start with the stored one")
    seeded = data[base.length:]
    length = _store(session, thread, _turns(seeded), digest)
    cycles = _cycles(seeded)
    if not cycles:
        raise RuntimeError("the seed turns wrote no compaction")
    renamer = _Renamer(thread, int(_ORDINAL.match(data.splitlines()[-1]).group(2)) + 1)  # type: ignore[union-attr]

    def copies() -> Any:
        while True:
            for cycle in cycles:
                renamer.new_cycle()
                for turn in cycle:
                    yield renamer.copy(turn)

    return _store(session, thread, copies(), digest, until=size) if length < size else length


def _forget_host(session: Any) -> None:
    """This host has not seen the session: its home gone (what the process knew of it goes with it)."""
    from hermes_sessions.codex.launch import session_home

    shutil.rmtree(session_home(session.id).home.parent, ignore_errors=True)


def run(rounds: int, big_mb: float, small_mb: float) -> dict[str, Any]:
    from django.contrib.auth import get_user_model

    from hermes_sessions import services

    user = get_user_model().objects.get(username="bench-rollout")
    sizes = {"big": int(big_mb * 1_000_000), "small": int(small_mb * 1_000_000)}
    sessions = {}
    for name, size in sizes.items():
        s = services.session_create(owner=user)
        _turn(s, user, "hello")
        sizes[name] = _grow(s, size)
        _turn(s, user, "first resume")  # restores the grown rollout once: the host has seen it
        sessions[name] = s
    seconds: dict[tuple[str, str], list[float]] = {(n, h): [] for n in sizes for h in ("seen", "unseen")}
    restore: dict[tuple[str, str], list[float]] = {k: [] for k in seconds}
    timings: dict[tuple[str, str], list[dict[str, Any]]] = {k: [] for k in seconds}
    for r in range(rounds):
        for host in ("seen", "unseen"):
            for name in (("big", "small") if r % 2 == 0 else ("small", "big")):
                if host == "unseen":
                    _forget_host(sessions[name])
                elapsed, turn_timings = _turn(sessions[name], user, f"round {r}")
                seconds[(name, host)].append(elapsed)
                restore[(name, host)].append(float(turn_timings.get("restore_ms", 0)))
                timings[(name, host)].append(turn_timings)
        print(f"  rollout: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    return {"sizes": sizes, "seconds": seconds, "restore": restore, "timings": timings, "rounds": rounds}


def print_figures(f: dict[str, Any]) -> None:
    big, small = f["sizes"]["big"], f["sizes"]["small"]
    for host in ("seen", "unseen"):
        b = statistics.median(f["seconds"][("big", host)])
        s = statistics.median(f["seconds"][("small", host)])
        rb = statistics.median(f["restore"][("big", host)])
        rs = statistics.median(f["restore"][("small", host)])
        target = "; target ≤ 1.2" if host == "seen" else ""
        print(f"cold_turn_100mb_vs_1mb_{host}: {b / s:.3f}   (median cold turn {b * 1000:.0f} ms at {big / 1e6:.0f} MB "
              f"vs {s * 1000:.0f} ms at {small / 1e6:.1f} MB, {f['rounds']} rounds; worker restore_ms {rs:.0f} → "
              f"{rb:.0f}{target})")
        print(f"cold_turn_100mb_{host}_ms: {b * 1000:.0f}")
        print(f"cold_turn_1mb_{host}_ms: {s * 1000:.0f}")
        print(f"restore_100mb_{host}_ms: {rb:.0f}")
        phases = sorted({k for t in f["timings"][("big", host)] for k, v in t.items()
                         if k.endswith("_ms") and isinstance(v, (int, float))})
        print(f"  worker timings at {big / 1e6:.0f} MB vs {small / 1e6:.1f} MB ({host}; medians, ms): " + ", ".join(
            f"{k} {statistics.median(t.get(k, 0) for t in f['timings'][('big', host)]):.0f}/"
            f"{statistics.median(t.get(k, 0) for t in f['timings'][('small', host)]):.0f}" for k in phases))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.bench_rollout", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--big-mb", type=float, default=100)
    parser.add_argument("--small-mb", type=float, default=1)
    args = parser.parse_args(argv)
    db_url = os.environ.get("DATABASE_URL", "")
    if not db_url.startswith("postgres"):
        sys.exit("the rollout bench needs DATABASE_URL=postgres://…")
    bench_db = database_beside(db_url, "_rollout_bench")
    scratch = Path(tempfile.mkdtemp(prefix="hermes-rollout-bench-"))
    try:
        with ModelStandIn() as stand_in:
            _setup(bench_db, scratch, stand_in.base_url)
            print_figures(run(args.rounds, args.big_mb, args.small_mb))
    finally:
        from django.db import connections

        connections.close_all()
        shutil.rmtree(scratch, ignore_errors=True)
        drop_database(bench_db)
    return 0


if __name__ == "__main__":
    sys.exit(main())
