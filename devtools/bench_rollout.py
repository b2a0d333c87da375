"""A cold turn of a session whose rollout is 100 MB against one whose rollout is 1 MB, on a host that has seen
the rollout (it restored or read it last: ``rollout_files.held_prefix``) and on one that has not (the
session's home wiped, nothing known), with the real pinned codex, the model stand-in and PostgreSQL.

Each session starts with a real turn (its thread and rollout made by codex); its stored rollout is then
grown to the size with whole lines copied from that turn's own rollout — its ``event_msg`` lines, which
codex reads back on ``thread/resume`` but does not send to the model (as after a compaction, the model's
history stays that of the real turns) — stored as one chunk per ~64 KB, as turns append them. Every timed
turn is cold (``HERMES_WARM_IDLE_SECONDS=0``): claim, restore, spawn, ``thread/resume``, the turn, capture,
finalize, timed in this process with the task run eagerly (no broker, no HTTP: the part that grows with
the rollout is the worker's). Rounds alternate the sizes.

Printed (``bench_figures.parse_figures``): ``cold_turn_100mb_vs_1mb_seen`` (target ≤ 1.2) and
``cold_turn_100mb_vs_1mb_unseen``, the medians behind them and the worker's ``restore_ms``. Needs
``DATABASE_URL`` (a ``*_rollout_bench`` database is made beside it and dropped after). Run alone:
``python -m devtools.bench_rollout [--rounds N] [--big-mb 100] [--small-mb 1]``; ``make bench`` runs it
with ``--rollout-rounds``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from devtools.databases import create_database, database_beside, drop_database
from devtools.model_stand_in import ModelStandIn

CHUNK = 64 * 1024  # bytes of grown rollout per stored chunk (a turn's worth of lines)


def _setup(db_url: str, scratch: Path, stand_in_url: str) -> Any:
    os.environ.update({
        "DATABASE_URL": db_url, "CELERY_TASK_ALWAYS_EAGER": "1", "CODEX_MODEL_PROVIDER": "stand-in",
        "CODEX_STAND_IN_URL": stand_in_url, "CODEX_HOMES_ROOT": str(scratch / "homes"),
        "CODEX_WORK_ROOT": str(scratch / "work"), "CODEX_HOME": str(scratch / "codex_home"),
        "CODEX_USER_HOME": str(scratch / "user_home"), "HERMES_WARM_IDLE_SECONDS": "0", "HERMES_WARM_POOL": "0",
        "HERMES_LOG_LEVEL": "WARNING"})
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


def _grow(session: Any, size: int) -> int:
    """Grow the session's stored rollout to about ``size`` bytes (module docstring); returns its length."""
    from django.db import transaction

    from hermes_sessions.codex.launch import session_home
    from hermes_sessions.codex.rollout_files import RolloutDelta, find_rollout
    from hermes_sessions.models import CodexBinding
    from hermes_sessions.services import rollouts

    thread = CodexBinding.objects.get(session=session, status=CodexBinding.Status.ACTIVE).thread_id
    base = rollouts.rollout_state(thread_id=thread)
    path = find_rollout(session_home(session.id).home, thread)
    assert base is not None and path is not None
    data = path.read_bytes()
    lines = [ln + b"\n" for ln in data.splitlines() if json.loads(ln).get("type") == "event_msg"]
    assert lines, "the real turn's rollout has no event_msg lines to copy"
    block = b"".join(lines)
    digest = hashlib.sha256(data)
    length = len(data)
    while length < size:
        part = (block * (CHUNK // len(block) + 1))[:CHUNK]
        part = part[: part.rfind(b"\n") + 1]
        digest.update(part)
        delta = RolloutDelta(thread_id=thread, relpath=base.relpath, offset=length, data=part,
                             length=length + len(part), sha256=digest.hexdigest(), base=base)
        with transaction.atomic():
            rollouts.rollout_store(session=session, delta=delta)
        length += len(part)
        base = rollouts.rollout_state(thread_id=thread)
        assert base is not None
    return length


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
