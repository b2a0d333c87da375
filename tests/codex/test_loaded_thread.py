"""A thread kept loaded since the session's last turn runs its next turn with ``turn/start`` alone
(``TurnSpec.thread_loaded``, ``codex/runner.py``), on the pinned codex binary and the model stand-in; and
when the app-server no longer has the thread loaded, ``turn/start``'s ``thread not found`` is answered by
a ``thread/resume`` (its permission profile checked) and ``turn/start`` once more."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from devtools.model_stand_in import ModelStandIn
from hermes_sessions.codex.client import AppServerClient
from hermes_sessions.codex.launch import app_server_argv, app_server_env, permission_profile, prepare_session_home
from hermes_sessions.codex.runner import TurnSpec, drive_turn

from ..support.real_codex import use_real_codex


@pytest.fixture
def stand_in():
    with ModelStandIn() as server:
        yield server


def _client(workdir: Path, paths) -> AppServerClient:
    return AppServerClient(app_server_argv(sandbox="read-only", workdir=workdir), env=app_server_env(paths),
                           cwd=str(workdir), request_timeout=30)


def test_a_loaded_thread_runs_its_next_turn_without_resume_and_an_unloaded_one_is_resumed_first(
    codex_dirs, settings, real_codex_bin, stand_in,
):
    use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
    workdir = Path(settings.CODEX_WORK_ROOT) / "s-loaded"
    workdir.mkdir(parents=True)
    paths = prepare_session_home("s-loaded", sandbox="read-only", workdir=workdir)
    spec = TurnSpec(text="first", thread_id=None, cwd=str(workdir), sandbox="read-only",
                    permission_profile=permission_profile("read-only"), turn_timeout=60)
    with _client(workdir, paths) as client:
        client.start()
        first = drive_turn(client, spec)
        assert first.status == "completed" and first.thread_action == "started"
        sent = len(client.sent_methods)
        second = drive_turn(client, replace(spec, text="second", thread_id=first.thread_id, thread_loaded=True))
        assert second.status == "completed", second.error
        assert (second.thread_action, second.thread_id) == ("resumed", first.thread_id)
        assert client.sent_methods[sent:] == ["turn/start"]  # no thread/resume
        assert second.methods == []
        assert "echo: second" in second.final_text

    # A new app-server on the same home has the thread stored but not loaded.
    with _client(workdir, paths) as fresh:
        fresh.start()
        sent = len(fresh.sent_methods)
        third = drive_turn(fresh, replace(spec, text="third", thread_id=first.thread_id, thread_loaded=True))
        assert third.status == "completed", third.error
        assert fresh.sent_methods[sent:] == ["turn/start", "thread/resume", "turn/start"]
        assert third.thread_id == first.thread_id
        assert "echo: third" in third.final_text
