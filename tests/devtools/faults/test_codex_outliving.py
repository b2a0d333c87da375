"""The harness's "no codex app-server outlives its worker" checks can fail: ``Stack.kill9_worker`` /
``codex_outliving`` report an app-server that survives its SIGKILLed worker (and one under no worker),
``invariants.codex_not_kept`` one that runs under a worker without being a thread it keeps loaded. The
app-servers are stand-ins (``sleep``) that look like codex to the scan: ``CODEX_HOME`` under the run's
root in their environment, no ``DATABASE_URL``. No stack needed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from argparse import Namespace
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from devtools.faults.invariants import codex_not_kept
from devtools.faults.supervisor import Proc, Stack, pid_alive
from hermes_sessions.models import TurnWorker, WarmThread
from tests.factories import SessionFactory

# A "worker" that spawns one "app-server" in a session of its own (so a kill of the worker's process
# group does not reach it, as with codex), with PR_SET_PDEATHSIG or without, then waits.
FAKE_WORKER = r"""
import ctypes, os, subprocess, sys, time
def pre():
    os.setsid()
    if sys.argv[1] == "1":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL
os.makedirs(sys.argv[3], exist_ok=True)
subprocess.Popen(["sleep", "60"], env={"CODEX_HOME": sys.argv[2], "PATH": "/usr/bin:/bin"}, cwd=sys.argv[3],
                 preexec_fn=pre)
print("spawned", flush=True)
time.sleep(60)
"""


@pytest.fixture
def stack(tmp_path: Path):
    st = Stack(Namespace(broker="redis"), tmp_path / "run")
    yield st
    st.stop_workers()
    st.kill_codex()


def _worker(stack: Stack, pdeathsig: bool) -> Proc:
    home = f"{stack.codex_home}/homes/sess-1/home"
    proc = Proc("worker1", [sys.executable, "-c", FAKE_WORKER, "1" if pdeathsig else "0", home,
                            os.path.join(stack.work_root, "sess-1")],
                {"PATH": "/usr/bin:/bin", "DATABASE_URL": "postgres://nowhere/x"}, stack.logdir)
    stack.workers.append(proc)
    deadline = time.monotonic() + 20
    while not stack.codex_of(proc):
        assert time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.05)
    return proc


def test_an_app_server_that_survives_its_killed_worker_is_reported(stack):
    worker = _worker(stack, pdeathsig=False)
    [pid] = stack.kill9_worker(worker, grace=1.0)
    assert pid_alive(pid) and worker not in stack.workers
    lines = stack.codex_outliving(grace=0.5)
    assert len(lines) == 1 and lines[0].startswith(f"codex pid {pid} of worker1 still running 1 s after")
    # Reported once; still running, it is still one under no worker.
    assert stack.codex_outliving(grace=0.2) == [
        f"codex pid {pid} (cwd {os.path.join(stack.work_root, 'sess-1')}) runs under no turn worker"]
    os.kill(pid, signal.SIGKILL)


def test_an_app_server_with_pdeathsig_goes_with_its_worker(stack):
    worker = _worker(stack, pdeathsig=True)
    [pid] = stack.kill9_worker(worker)
    assert not pid_alive(pid)
    assert stack.codex_outliving(grace=0.5) == []


@pytest.mark.django_db
def test_an_app_server_under_a_worker_must_be_a_thread_it_keeps(stack):
    session = SessionFactory(id="sess-1")
    workdir = os.path.join(stack.work_root, "sess-1")
    os.makedirs(workdir)
    child = subprocess.Popen(["sleep", "60"], cwd=workdir, env={"CODEX_HOME": f"{stack.codex_home}/homes/sess-1/home",
                                                              "PATH": "/usr/bin:/bin"})
    try:
        [line] = codex_not_kept(stack)  # this process as its "worker", with no heartbeat row: not kept
        assert line.startswith(f"pid {child.pid} cwd {workdir}")
        queue = "turns.faults-worker1@host"
        TurnWorker.objects.create(queue=queue, node="faults-worker1@host", pid=os.getpid(), heartbeat_at=timezone.now())
        assert len(codex_not_kept(stack)) == 1  # a worker, but no WarmThread row names it for the session
        WarmThread.objects.create(session=session, queue=queue, thread_id="t", generation=1,
                                  until=timezone.now() + timedelta(seconds=120))
        assert codex_not_kept(stack) == []  # the worker keeps the session's thread loaded
        WarmThread.objects.filter(session=session).update(queue="turns.faults-worker2@host")
        assert len(codex_not_kept(stack)) == 1  # another worker keeps it: this one should not run
    finally:
        child.kill()
        child.wait()
