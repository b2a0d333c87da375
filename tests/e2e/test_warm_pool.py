"""Spare app-servers (``HERMES_WARM_POOL``, ``hermes_sessions/worker/warm/spares.py``) on the pinned codex binary
with the model stand-in: turns run on them through the real task code with the session's history and
permission profile; none outlives its pool or its worker process (close, kill -9); a dead or stale
spare is never handed out."""
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from devtools.model_stand_in import ModelStandIn
from hermes_sessions import services
from hermes_sessions.codex import sandbox_check
from hermes_sessions.models import Message, Turn
from hermes_sessions.worker.warm.spares import SparePool, close_spare_pool, spare_pool
from tests.support.real_codex import use_real_codex

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
BASE = Path(__file__).resolve().parents[2]


@pytest.fixture
def real_codex(codex_dirs, settings, real_codex_bin):
    settings.HERMES_VAR_DIR = codex_dirs
    sandbox_check.reset_cache()
    with ModelStandIn() as stand_in:
        use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
        yield stand_in
        close_spare_pool()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def _exited_child(pid: int, timeout: float = 10.0) -> bool:
    """Our child ``pid`` has exited, all its threads included (``waitid`` reports it; not reaped). A
    zombie *leader* in ``/proc`` can precede that while codex's other threads are still exiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None and info.si_pid == pid:
            return True
        time.sleep(0.02)
    return False


def _spares(settings) -> list[Path]:
    return sorted(Path(settings.CODEX_HOMES_ROOT).glob(".spare-*"))


def test_off_by_default(settings, real_codex, user, run_turn_now):
    assert settings.HERMES_WARM_POOL == 0 and spare_pool() is None
    turn = run_turn_now(session=services.session_create(owner=user), text="hello", user=user)
    assert turn.status == Turn.Status.SUCCEEDED and "spare" not in turn.timings


def test_turns_run_on_spares_with_the_sessions_history_and_profile(settings, real_codex, user, run_turn_now):
    settings.HERMES_WARM_POOL = 1
    pool = spare_pool()
    assert pool is not None and pool.wait_ready(1, timeout=60)
    other = services.session_create(owner=user)
    secret = f"OTTER-{uuid.uuid4().hex}"
    (Path(settings.CODEX_WORK_ROOT) / other.id).mkdir(parents=True)
    (Path(settings.CODEX_WORK_ROOT) / other.id / "notes.txt").write_text(secret)

    me = services.session_create(owner=user, model_config={"sandbox": "workspace-write"})
    first = run_turn_now(session=me, text="my code word is amber", user=user)
    assert first.status == Turn.Status.SUCCEEDED, first.error
    assert first.timings.get("spare") == 1 and first.thread_action == "started"
    assert pool.wait_ready(1, timeout=60)  # replaced after use
    name = f"made-{uuid.uuid4().hex}"
    second = run_turn_now(session=me, user=user, text=(
        f"RUNCMD echo hi > {name}; cat {settings.CODEX_WORK_ROOT}/{other.id}/notes.txt; echo DONE"))
    assert second.status == Turn.Status.SUCCEEDED, second.error
    assert second.timings.get("spare") == 1 and second.thread_action == "resumed"
    assert second.codex_thread_id == first.codex_thread_id
    seen = "\n".join(Message.objects.filter(session=me, role="tool").values_list("content", flat=True))
    assert "DONE" in seen and secret not in seen  # its own profile: the other session is not there
    assert (Path(settings.CODEX_WORK_ROOT) / me.id / name).exists()  # workspace-write on the spare
    assert "my code word is amber" in str(real_codex.requests()[-1])  # the restored history reached the model
    # The spare that ran a turn is gone with its home; only the fresh ones remain.
    assert pool.wait_ready(1, timeout=60)
    assert len(_spares(settings)) == pool.ready()
    # And a cold turn after spare turns resumes the same thread from PostgreSQL.
    close_spare_pool()
    settings.HERMES_WARM_POOL = 0
    third = run_turn_now(session=me, text="and again", user=user)
    assert third.status == Turn.Status.SUCCEEDED and "spare" not in third.timings
    assert third.codex_thread_id == first.codex_thread_id and third.thread_action == "resumed"


def test_close_leaves_no_app_server_and_no_home(settings, real_codex):
    pool = SparePool(2, max_age=600)
    try:
        assert pool.wait_ready(2, timeout=60)
        pids = pool.pids()
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    finally:
        pool.close()
    assert _gone(pids, timeout=5)
    assert _spares(settings) == []


def test_a_dead_or_stale_spare_is_never_handed_out(settings, real_codex):
    pool = SparePool(1, max_age=600)
    try:
        assert pool.wait_ready(1, timeout=60)
        [dead] = pool.pids()
        os.kill(dead, signal.SIGKILL)
        assert _exited_child(dead)
        spare = pool.take()
        assert spare is None or (spare.client.pid != dead and spare.client.alive())
        if spare is not None:
            spare.discard()
        assert pool.wait_ready(1, timeout=60) and dead not in pool.pids()
    finally:
        pool.close()
    stale = SparePool(1, max_age=1.0)
    try:
        assert stale.wait_ready(1, timeout=60)
        [old] = stale.pids()
        time.sleep(1.2)
        spare = stale.take()
        assert spare is None or spare.client.pid != old
        if spare is not None:
            spare.discard()
        assert _gone([old])
    finally:
        stale.close()


def test_kill_9_of_the_worker_process_takes_its_spares(settings, real_codex, tmp_path):
    """A worker process killed with SIGKILL runs no cleanup: PR_SET_PDEATHSIG kills its spares; the next
    pool on the host removes their homes."""
    script = textwrap.dedent(f"""
        import os, sys, time, django
        django.setup()
        from django.conf import settings
        settings.CODEX_HOMES_ROOT = {str(settings.CODEX_HOMES_ROOT)!r}
        settings.CODEX_BIN = {settings.CODEX_BIN!r}
        settings.CODEX_APP_SERVER_COMMAND = ""
        settings.CODEX_MODEL_PROVIDER = "stand-in"
        settings.CODEX_STAND_IN_URL = {settings.CODEX_STAND_IN_URL!r}
        from hermes_sessions.worker.warm.spares import SparePool
        pool = SparePool(2, max_age=600)
        assert pool.wait_ready(2, timeout=60)
        print(" ".join(map(str, pool.pids())), flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings_test"}
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=BASE, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline() if owner.stdout else ""
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids), line
        owner.kill()
        owner.wait(timeout=10)
        assert _gone(pids), "a spare app-server outlived its worker process"
    finally:
        if owner.poll() is None:
            owner.kill()
    assert len(_spares(settings)) == 2  # nobody cleaned up…
    SparePool(0, max_age=600).close()  # …until the next pool on this host starts
    assert _spares(settings) == []
