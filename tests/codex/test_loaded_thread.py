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


def _record_turn_starts(client: AppServerClient) -> list[dict]:
    """The params of every ``turn/start`` ``client`` sends from now on."""
    sent: list[dict] = []
    request = client.request

    def recording(method, params=None, **kwargs):
        if method == "turn/start":
            sent.append(dict(params or {}))
        return request(method, params, **kwargs)

    client.request = recording  # type: ignore[method-assign]
    return sent


OVERRIDES = {"cwd", "approvalPolicy", "model"}


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
        starts = _record_turn_starts(client)
        first = drive_turn(client, spec)
        assert first.status == "completed" and first.thread_action == "started"
        sent = len(client.sent_methods)
        second = drive_turn(client, replace(spec, text="second", thread_id=first.thread_id, thread_loaded=True))
        assert second.status == "completed", second.error
        assert (second.thread_action, second.thread_id) == ("resumed", first.thread_id)
        assert client.sent_methods[sent:] == ["turn/start"]  # no thread/resume
        assert second.methods == []
        assert "echo: second" in second.final_text
        # The session's cwd and approval policy went with the first turn/start and stick: the kept
        # thread's turn/start carries neither (each costs codex time, docs in runner._turn_params).
        assert {"cwd", "approvalPolicy"} <= set(starts[0]) and not OVERRIDES & set(starts[1])

    # A new app-server on the same home has the thread stored but not loaded.
    with _client(workdir, paths) as fresh:
        fresh.start()
        starts = _record_turn_starts(fresh)
        sent = len(fresh.sent_methods)
        third = drive_turn(fresh, replace(spec, text="third", thread_id=first.thread_id, thread_loaded=True))
        assert third.status == "completed", third.error
        assert fresh.sent_methods[sent:] == ["turn/start", "thread/resume", "turn/start"]
        assert third.thread_id == first.thread_id
        assert "echo: third" in third.final_text
        # After the resume the overrides go again: a plain resume does not carry them.
        assert not OVERRIDES & set(starts[0]) and {"cwd", "approvalPolicy"} <= set(starts[1])


def test_a_kept_threads_turn_without_overrides_still_runs_commands_in_the_sessions_cwd_unasked(
    codex_dirs, settings, real_codex_bin, stand_in,
):
    """The overrides left out of a kept thread's ``turn/start`` are still in force: the command runs in
    the session's work dir, not the app-server's own cwd, and with approval policy ``never`` (no
    approval request; the client would decline one and the command would not run)."""
    use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
    root = Path(settings.CODEX_WORK_ROOT)
    workdir, elsewhere = root / "s-kept-cwd", root / "elsewhere"
    workdir.mkdir(parents=True)
    elsewhere.mkdir(parents=True)
    paths = prepare_session_home("s-kept-cwd", sandbox="read-only", workdir=workdir)
    spec = TurnSpec(text="first", thread_id=None, cwd=str(workdir), sandbox="read-only",
                    permission_profile=permission_profile("read-only"), turn_timeout=60)
    asked: list[str] = []

    def decline(method: str, params: dict) -> dict:
        asked.append(method)
        raise LookupError(method)  # the client answers codex with an error: the command would not run

    client = AppServerClient(app_server_argv(sandbox="read-only", workdir=workdir), env=app_server_env(paths),
                             cwd=str(elsewhere), request_timeout=30, server_request_handler=decline)
    with client:
        client.start()
        first = drive_turn(client, spec)
        assert first.status == "completed", first.error
        kept = drive_turn(client, replace(spec, text="RUNCMD pwd", thread_id=first.thread_id, thread_loaded=True))
        assert kept.status == "completed", kept.error
        assert asked == [], "an approval was asked for"
        tool_output = [m["content"] for m in kept.messages if m.get("role") == "tool"]
        assert tool_output and str(workdir) in tool_output[0] and str(elsewhere) not in tool_output[0]
