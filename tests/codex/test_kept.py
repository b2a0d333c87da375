"""The per-process keeper of loaded threads (``worker/warm/kept.py``): its bounds (LRU, turns, private memory),
expiry, release and shutdown, the per-process singleton, and ``KeptThread.usable_for``'s reasons.

No codex runs here: a kept copy's client is a ``FakeClient`` (``alive()``, ``pid``, ``close``), which is
all the keeper uses of it; private memory is read from ``/proc`` of a real ``sleep`` process.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from hermes_sessions.codex.rollout_files import RolloutBase
from hermes_sessions.worker import process as process_mod
from hermes_sessions.worker.warm import kept as kept_mod
from hermes_sessions.worker.warm.kept import Keeper, KeptThread, keeper_make, rollout_stamp
from hermes_sessions.worker.warm.process_memory import tree_memory

THREAD = "019a0000-0000-7000-8000-000000000001"
CONFIG = {"sandbox": "workspace-write", "approval_policy": "never"}


class FakeClient:
    """What the keeper and a turn use of an ``AppServerClient``: ``alive()``, ``pid``, ``close()``,
    ``kill_nowait()`` (a time limit's end of it)."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid, self.running, self.closes = pid, True, 0

    def alive(self) -> bool:
        return self.running

    def close(self) -> None:
        self.closes += 1
        self.running = False

    def kill_nowait(self) -> None:
        self.running = False


def write_rollout_file(home: Path, thread_id: str = THREAD, data: bytes = b'{"a":1}\n') -> Path:
    path = home / "sessions" / "2026" / "11" / "30" / f"rollout-2026-11-30T00-00-00-{thread_id}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def make_kept(session_id: str = "s1", *, home: Path | None = None, thread_id: str = THREAD, generation: int = 1,
              turns: int = 1, client: FakeClient | None = None) -> KeptThread:
    client = client or FakeClient()
    home = home or Path("/nonexistent-home")
    return KeptThread(
        session_id=session_id, thread_id=thread_id, client=client, home=home,
        base=RolloutBase(thread_id=thread_id, relpath="sessions/x.jsonl", length=8, sha256="0" * 64,
                         generation=generation),
        config=dict(CONFIG), version="0.171.0", close=client.close, turns=turns,
        stamp=rollout_stamp(home, thread_id),
    )


def make_keeper(*, max_threads: int = 8, idle_seconds: float = 120.0, max_turns: int = 200,
                max_private_mb: float = 256.0) -> Keeper:
    return Keeper(max_threads=max_threads, idle_seconds=idle_seconds, max_turns=max_turns,
                  max_private_mb=max_private_mb)


@pytest.fixture
def sleeper():
    """A real small process (~1.8 MiB resident, ~0.2 MiB private), for its pid's ``/proc`` — once it runs
    ``sleep`` and has loaded it (just after its exec it holds a few KiB: seen once under load)."""
    proc = subprocess.Popen(["sleep", "30"])
    deadline = time.monotonic() + 5
    while Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep" or tree_memory(proc.pid).rss_kb < 512:
        assert time.monotonic() < deadline, "sleep did not start"
        time.sleep(0.005)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def no_keeper():
    """The process-wide keeper is made afresh by the test and dropped after it."""
    kept_mod.close_keeper()
    yield
    kept_mod.close_keeper()


# --- Keeper bounds -----------------------------------------------------------------------------------

def test_past_max_threads_the_least_recently_kept_is_closed_and_returned():
    k = make_keeper(max_threads=2)
    a, b, c = make_kept("a"), make_kept("b"), make_kept("c")
    assert k.keep(a) == [] and k.keep(b) == []
    assert k.keep(c) == [a]
    assert a.client.closes == 1 and (b.client.closes, c.client.closes) == (0, 0)
    assert [s for s, _, _ in k.kept_threads()] == ["b", "c"]


def test_keeping_a_session_again_closes_its_old_copy_and_makes_it_most_recent():
    k = make_keeper(max_threads=2)
    a1, b, a2, c = make_kept("a"), make_kept("b"), make_kept("a"), make_kept("c")
    k.keep(a1)
    k.keep(b)
    assert k.keep(a2) == [a1] and a1.client.closes == 1
    assert k.keep(c) == [b]  # b is now the least recently kept
    assert [s for s, _, _ in k.kept_threads()] == ["a", "c"] and a2.client.closes == 0


def test_a_copy_that_ran_max_turns_is_recycled():
    k = make_keeper(max_turns=3)
    old = make_kept("a", turns=3)
    assert k.keep(old) == [old]
    assert old.client.closes == 1 and k.kept_threads() == []
    young = make_kept("b", turns=2)
    assert k.keep(young) == [] and k.kept_threads() == [("b", THREAD, 1)]


def test_a_copy_above_max_private_memory_is_refused(sleeper):
    private_kb = tree_memory(sleeper.pid).private_kb
    assert 16 <= private_kb < 64 * 1024  # Private_Clean + Private_Dirty from /proc/<pid>/smaps_rollup
    k = make_keeper(max_private_mb=private_kb / 1024 / 2)
    big = make_kept("a", client=FakeClient(pid=sleeper.pid))
    assert k.keep(big) == [big] and big.client.closes == 1 and k.kept_threads() == []
    roomy = make_keeper(max_private_mb=256)
    ok = make_kept("b", client=FakeClient(pid=sleeper.pid))
    assert roomy.keep(ok) == [] and roomy.pids() == [sleeper.pid] and ok.private_kb == roomy.private_kb() > 0


def test_a_dead_copy_is_not_kept():
    k = make_keeper()
    dead = make_kept("a")
    dead.client.running = False
    assert k.keep(dead) == [dead] and k.kept_threads() == []


def test_keeping_off_keeps_nothing():
    for k in (make_keeper(max_threads=0), make_keeper(idle_seconds=0)):
        copy = make_kept("a")
        assert k.keep(copy) == [copy] and copy.client.closes == 1 and k.kept_threads() == []


# --- expiry, release, take, shutdown ----------------------------------------------------------------

def test_expired_closes_idle_and_dead_copies_only():
    k = make_keeper(idle_seconds=60)
    idle, dead, fresh = make_kept("idle"), make_kept("dead"), make_kept("fresh")
    for copy in (idle, dead, fresh):
        k.keep(copy)
    idle.kept_at = time.monotonic() - 61
    dead.client.running = False
    gone = k.expired()
    assert {g.session_id for g in gone} == {"idle", "dead"}
    assert idle.client.closes == 1 and dead.client.closes == 1 and fresh.client.closes == 0
    assert [s for s, _, _ in k.kept_threads()] == ["fresh"]
    assert k.expired() == []


def test_release_closes_and_returns_the_copy():
    k = make_keeper()
    copy = make_kept("a")
    k.keep(copy)
    assert k.release("a", reason="taken elsewhere") is copy and copy.client.closes == 1
    assert k.release("a", reason="again") is None and k.kept_threads() == []


def test_take_hands_the_copy_out_without_closing_it():
    k = make_keeper()
    copy = make_kept("a")
    k.keep(copy)
    assert k.take("a") is copy and copy.client.closes == 0
    assert k.take("a") is None and k.kept_threads() == [] and k.expired() == []


def test_close_all_closes_every_copy():
    k = make_keeper()
    copies = [make_kept(s) for s in ("a", "b", "c")]
    for copy in copies:
        k.keep(copy)
    assert set(map(id, k.close_all())) == set(map(id, copies))
    assert [c.client.closes for c in copies] == [1, 1, 1] and k.kept_threads() == [] and k.close_all() == []


def test_a_close_that_raises_does_not_stop_the_others():
    k = make_keeper()
    bad, good = make_kept("bad"), make_kept("good")

    def boom() -> None:
        raise OSError("no such process")

    bad.close = boom
    k.keep(bad)
    k.keep(good)
    assert len(k.close_all()) == 2 and good.client.closes == 1


# --- the per-process keeper -------------------------------------------------------------------------

@pytest.mark.parametrize("setting", ["HERMES_WARM_IDLE_SECONDS", "HERMES_WARM_MAX_THREADS"])
def test_no_keeper_when_keeping_is_off(settings, no_keeper, setting):
    setattr(settings, setting, 0)
    assert keeper_make() is None and kept_mod.keeper_if_made() is None


def test_the_keeper_is_made_once_per_process_with_the_settings(settings, no_keeper, monkeypatch):
    settings.HERMES_WARM_IDLE_SECONDS, settings.HERMES_WARM_MAX_THREADS = 30, 3
    settings.HERMES_WARM_MAX_TURNS, settings.HERMES_WARM_MAX_PRIVATE_MB = 7, 100
    settings.HERMES_WARM_MEMORY_BUDGET_MB = 300
    assert kept_mod.keeper_if_made() is None
    k = keeper_make()
    assert k is not None and keeper_make() is k and kept_mod.keeper_if_made() is k
    assert (k.max_threads, k.idle_seconds, k.max_turns, k.max_private_mb, k.budget_mb) == (3, 30.0, 7, 100.0, 300.0)
    assert k.ledger is not None and k.ledger.directory == settings.HERMES_VAR_DIR / "warm-memory"
    # After a fork the child's pid differs: the parent's keeper (and its copies) is not the child's.
    parent_pid = os.getpid()
    monkeypatch.setattr(process_mod, "_runtime", process_mod._runtime)  # the parent's comes back after the test
    monkeypatch.setattr(process_mod.os, "getpid", lambda: parent_pid + 1)
    assert kept_mod.keeper_if_made() is None
    child = keeper_make()
    assert child is not None and child is not k


def test_close_keeper_closes_this_process_copies(settings, no_keeper):
    settings.HERMES_WARM_IDLE_SECONDS, settings.HERMES_WARM_MAX_THREADS = 30, 3
    k = keeper_make()
    assert k is not None
    copy = make_kept("a")
    k.keep(copy)
    assert kept_mod.close_keeper() == [copy] and copy.client.closes == 1
    assert kept_mod.keeper_if_made() is None


# --- usable_for -------------------------------------------------------------------------------------

@pytest.fixture
def on_disk(tmp_path) -> tuple[KeptThread, Path]:
    home = tmp_path / "home"
    path = write_rollout_file(home)
    copy = make_kept("a", home=home, generation=4)
    assert copy.stamp is not None
    return copy, path


def test_usable_when_everything_matches(on_disk):
    copy, _ = on_disk
    assert copy.usable_for(thread_id=THREAD, generation=4, config=dict(CONFIG)) == ""


def test_not_usable_for_another_thread(on_disk):
    copy, _ = on_disk
    why = copy.usable_for(thread_id="019a0000-0000-7000-8000-000000000999", generation=4, config=dict(CONFIG))
    assert "bound to thread 019a0000-0000-7000-8000-000000000999" in why
    assert "bound to thread None" in copy.usable_for(thread_id=None, generation=4, config=dict(CONFIG))


def test_not_usable_when_the_generation_moved(on_disk):
    copy, _ = on_disk
    assert "generation 5" in copy.usable_for(thread_id=THREAD, generation=5, config=dict(CONFIG))
    # Not "generation None", which reads like a bug after forget_rollout.
    assert copy.usable_for(thread_id=THREAD, generation=None, config=dict(CONFIG)) == (
        "the session has no stored rollout (this copy holds generation 4)")


def test_not_usable_when_the_config_changed(on_disk):
    copy, _ = on_disk
    why = copy.usable_for(thread_id=THREAD, generation=4, config={**CONFIG, "developer_instructions": "be brief"})
    assert "settings changed" in why


def test_not_usable_when_the_process_died(on_disk):
    copy, _ = on_disk
    copy.client.running = False
    assert "exited" in copy.usable_for(thread_id=THREAD, generation=4, config=dict(CONFIG))


def test_not_usable_when_the_same_content_was_written_as_a_new_file(on_disk):
    """Another worker on this host re-made the home with the same bytes: a new inode, even with the
    same size and mtime, is not the file this app-server holds open."""
    copy, path = on_disk
    st = path.stat()
    fresh = path.with_name(".replacement")
    fresh.write_bytes(path.read_bytes())
    os.replace(fresh, path)  # both files existed at once: the inode differs
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_ino != st.st_ino
    assert "not the one this app-server wrote" in copy.usable_for(thread_id=THREAD, generation=4, config=dict(CONFIG))


def test_not_usable_when_bytes_were_appended(on_disk):
    copy, path = on_disk
    with open(path, "ab") as fh:
        fh.write(b'{"b":2}\n')
    assert "not the one this app-server wrote" in copy.usable_for(thread_id=THREAD, generation=4, config=dict(CONFIG))


def test_not_usable_when_the_file_is_gone_or_doubled(on_disk):
    copy, path = on_disk
    other = path.parent.parent / "29" / path.name
    other.parent.mkdir()
    other.write_bytes(path.read_bytes())  # two files for one thread: find_rollout refuses to pick
    assert rollout_stamp(copy.home, THREAD) is None
    assert "not the one" in copy.usable_for(thread_id=THREAD, generation=4, config=dict(CONFIG))
    other.unlink()
    path.unlink()
    assert "not the one" in copy.usable_for(thread_id=THREAD, generation=4, config=dict(CONFIG))
