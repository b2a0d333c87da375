"""Two sessions' threads in ONE app-server on one shared home stay apart when each thread carries its own
permission profile in ``thread/start`` and ``thread/resume`` ``config``, and the app-server's own default
profile (``deny_all_overrides``) holds no session's directory, so a thread started or resumed without its
``config`` reaches nobody's files (real codex 0.171.0, the model stand-in's ``RUNCMD``/``PATCHFILE``;
docs/decisions/2026-12-06-shared-app-servers.md).

The shape the decision chooses, before the worker runs it: this pins what a shared
app-server would rely on, so the decision can be taken again on a later codex. Assertions are on content:
the other session's words must not appear in anything A's commands printed, and its file must not appear.
"""
from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from devtools.bench_app_server_shapes import (
    PROFILE,
    command_output,
    shared_app_server,
    start_thread,
    thread_config,
    workdir_for,
)
from devtools.model_stand_in import ModelStandIn
from hermes_sessions.worker.warm.spares import UNLOAD_AT_ONCE
from tests.support.real_codex import use_real_codex

pytestmark = pytest.mark.e2e


@pytest.fixture
def shared(codex_dirs, settings, real_codex_bin):
    with ModelStandIn() as stand_in:
        use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
        server = shared_app_server("shared", *UNLOAD_AT_ONCE, fail_closed=True)
        try:
            yield server
        finally:
            server.close()


@pytest.mark.timeout(240)
def test_a_thread_cannot_reach_another_threads_work_dir_or_rollout_in_the_same_app_server(shared, settings):
    work = {name: workdir_for(f"sess-{name}") for name in "ab"}
    words = {name: f"{name.upper()}WORD-{uuid.uuid4().hex}" for name in "ab"}
    for name in "ab":
        (work[name] / "secret.txt").write_text(words[name])
    thread = {name: start_thread(shared, work[name], per_thread_profile=True) for name in "ab"}
    shared.turn(thread["b"], f"remember {words['b']}")  # B's words in B's rollout, in the home A's thread shares
    [b_rollout] = Path(settings.CODEX_HOMES_ROOT).rglob(f"rollout-*{thread['b']}.jsonl")
    assert words["b"] in b_rollout.read_text()
    home = b_rollout.parents[4]

    def a_runs(cmd: str) -> str:
        return command_output(shared.turn(thread["a"], f"RUNCMD {cmd}"))

    probe = (f"cat {work['b']}/secret.txt; cat {b_rollout}; grep -r {words['b'][:12]} {home} {settings.CODEX_WORK_ROOT}; "
             f"ls {home}; cat secret.txt; echo DONE")
    seen = a_runs(probe)
    assert "DONE" in seen and words["a"] in seen  # the command ran; its own work dir is readable
    assert words["b"] not in seen

    into_b, into_a = work["b"] / "from-a.txt", work["a"] / "own.txt"
    shared.turn(thread["a"], f"PATCHFILE {into_b} hello")
    shared.turn(thread["a"], f"PATCHFILE {into_a} hello")
    assert into_a.exists() and not into_b.exists()

    # Unloaded and resumed in the same app-server: the profile comes back only from the resume's own config.
    shared.request("thread/unsubscribe", {"threadId": thread["a"]})
    time.sleep(0.5)  # unloaded within ~10 ms (thread_unload_delay_secs=0, docs/codex.md §11)
    resumed = shared.request("thread/resume", {"threadId": thread["a"], "excludeTurns": True,
                                               "config": thread_config(work["a"])})
    assert resumed["activePermissionProfile"]["id"] == PROFILE
    seen = a_runs(probe)
    assert "DONE" in seen and words["a"] in seen
    assert words["b"] not in seen


@pytest.mark.timeout(240)
def test_a_thread_without_its_config_reaches_no_sessions_files(shared, settings):
    work = {name: workdir_for(f"sess-{name}") for name in "ab"}
    words = {name: f"{name.upper()}WORD-{uuid.uuid4().hex}" for name in "ab"}
    for name in "ab":
        (work[name] / "secret.txt").write_text(words[name])
    probe = f"RUNCMD cat {work['a']}/secret.txt {work['b']}/secret.txt; ls {settings.CODEX_WORK_ROOT}; echo DONE"

    bare = shared.request("thread/start", {"cwd": str(work["a"])})["thread"]["id"]
    seen = command_output(shared.turn(bare, probe))
    assert "DONE" in seen and words["a"] not in seen and words["b"] not in seen

    a = start_thread(shared, work["a"], per_thread_profile=True)
    seen = command_output(shared.turn(a, probe))
    assert words["a"] in seen and words["b"] not in seen  # the control: its config opens its own work dir
    shared.request("thread/unsubscribe", {"threadId": a})
    time.sleep(0.5)
    shared.request("thread/resume", {"threadId": a, "excludeTurns": True})  # no config: the default's profile
    seen = command_output(shared.turn(a, probe))
    assert "DONE" in seen and words["a"] not in seen and words["b"] not in seen
