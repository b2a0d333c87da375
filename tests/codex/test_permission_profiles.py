"""The permission profiles a session's codex runs under (``launch.py``; docs/codex.md §10), and the
runner's requests: no legacy sandbox fields, the active profile checked after thread/start and resume."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from hermes_sessions.codex.launch import (
    NO_PROJECT_DOCS,
    app_server_argv,
    permission_filesystem,
    permission_overrides,
    permission_profile,
    render_config_toml,
)


@pytest.fixture
def dirs(codex_dirs, settings, real_codex_bin):
    settings.CODEX_BIN = real_codex_bin
    settings.CODEX_APP_SERVER_COMMAND = ""
    settings.CODEX_MODEL_PROVIDER = "stand-in"
    settings.HERMES_VAR_DIR = codex_dirs / "var"
    return codex_dirs


@pytest.mark.parametrize("sandbox", ["read-only", "workspace-write", "danger-full-access"])
def test_per_session_config_selects_the_profile_before_any_table(dirs, sandbox):
    workdir = dirs / "work" / "sess-a"
    text = render_config_toml(home=dirs / "homes" / "sess-a" / "home", workdir=workdir, sandbox=sandbox)
    first_table = text.index("\n[")
    assert text.index("default_permissions") < first_table
    assert "sandbox_mode" not in text
    parsed = tomllib.loads(text)
    name = permission_profile(sandbox)
    assert parsed["default_permissions"] == name
    assert parsed["permissions"][name]["filesystem"] == permission_filesystem(sandbox, workdir)
    assert parsed["permissions"][name]["network"] == {"enabled": sandbox == "danger-full-access"}


def test_profiles_allow_only_the_basics_the_codex_install_and_the_own_workdir(dirs, settings):
    own, other = dirs / "work" / "sess-a", dirs / "work" / "sess-b"
    ro = permission_filesystem("read-only", own)
    assert ro[str(own.resolve())] == "read"
    assert ro[":minimal"] == "read"
    assert "/" not in ro and str(other) not in ro  # an allow-list: anything not named is not mounted
    assert not any(str(dirs) in path and path != str(own.resolve()) for path in ro)
    assert permission_filesystem("workspace-write", own)[str(own.resolve())] == "write"
    full = permission_filesystem("danger-full-access", own)
    assert full["/"] == "write" and full[str(own.resolve())] == "write"
    for denied in (settings.CODEX_WORK_ROOT, settings.CODEX_HOME, settings.HERMES_VAR_DIR):
        assert full[str(Path(denied).resolve())] == "none"
    base = Path(settings.BASE_DIR).resolve()
    assert full[str(base / "hermes_sessions")] == "none" and full[str(base / "project")] == "none"
    assert str(base / "node_modules") not in full  # codex re-executes its own binary in the sandbox


def test_the_app_server_command_carries_the_session_profile(dirs):
    own = dirs / "work" / "sess-a"
    argv = app_server_argv(sandbox="workspace-write", workdir=own)
    assert argv[1] == "app-server"
    assert argv[2:] == permission_overrides("workspace-write", own) + NO_PROJECT_DOCS
    assert argv[2:4] == ["-c", 'default_permissions="hermes-workspace-write"']
    fs = argv[5]
    assert fs.startswith("permissions.hermes-workspace-write.filesystem={")
    # the value is a TOML inline table codex parses (paths as quoted keys)
    assert tomllib.loads("x = " + fs.split("=", 1)[1]) == {"x": permission_filesystem("workspace-write", own)}
    assert app_server_argv()[2:] == NO_PROJECT_DOCS  # no session: no profile, only what every app-server gets


def test_requests_carry_no_legacy_sandbox_fields(scripted_codex, codex_dirs, settings, user, run_turn_now):
    from hermes_sessions import services
    from hermes_sessions.models import Turn

    session = services.session_create(owner=user)
    first = run_turn_now(session=session, text="hello", user=user)
    second = run_turn_now(session=session, text="again", user=user)
    assert first.status == second.status == Turn.Status.SUCCEEDED, (first.error, second.error)
    calls = scripted_codex.calls()
    sent = {c["method"]: c["params"] for c in calls if c["method"] in ("thread/start", "thread/resume", "turn/start")}
    assert set(sent) == {"thread/start", "thread/resume", "turn/start"}
    workdir = str((Path(settings.CODEX_WORK_ROOT) / session.id).resolve())
    # model: the operator's default (CODEX_MODEL unset: the stand-in's), the session names none
    assert sent["thread/start"] == {"cwd": workdir, "approvalPolicy": "never", "model": "mock-model"}
    assert sent["thread/resume"] == {"threadId": first.codex_thread_id, "excludeTurns": True}
    turn_start = dict(sent["turn/start"])
    assert set(turn_start) == {"threadId", "input", "cwd", "approvalPolicy", "model", "clientUserMessageId"}
    for params in sent.values():
        assert not {"sandbox", "sandboxPolicy", "sandboxMode", "permissions"} & set(params)
    for argv in scripted_codex.argvs():
        assert argv[argv.index("-c") + 1] == 'default_permissions="hermes-read-only"'


@pytest.mark.parametrize("method", ["thread/start", "thread/resume"])
def test_a_profile_mismatch_fails_the_turn_before_codex_runs_it(scripted_codex, user, run_turn_now, method):
    from hermes_sessions import services
    from hermes_sessions.models import Turn

    session = services.session_create(owner=user)
    if method == "thread/resume":
        assert run_turn_now(session=session, text="hello", user=user).status == Turn.Status.SUCCEEDED
    scripted_codex.script({method: [{"active_profile": ":read-only"}]})
    turn = run_turn_now(session=session, text="RUNCMD cat /etc/passwd", user=user)
    assert turn.status == Turn.Status.FAILED
    assert f"codex {method} reported permission profile ':read-only', not 'hermes-read-only'" in turn.error
    starts = [c for c in scripted_codex.calls() if c["method"] == "turn/start"]
    assert len(starts) == (1 if method == "thread/resume" else 0)  # the input never reached codex
    assert json.dumps(turn.error)  # a readable reason


@pytest.fixture
def fresh_sandbox_check():
    from hermes_sessions.codex import sandbox_check

    sandbox_check.reset_cache()
    yield sandbox_check
    sandbox_check.reset_cache()


def test_a_host_whose_sandbox_fails_refuses_turns_with_the_reason(scripted_codex, settings, user, run_turn_now,
                                                                    fresh_sandbox_check):
    from hermes_sessions import services
    from hermes_sessions.models import Turn

    settings.CODEX_SANDBOX_CHECK_COMMAND = json.dumps(
        ["sh", "-c", "echo 'bwrap: setting up uid map: Permission denied' >&2; exit 1"])
    session = services.session_create(owner=user)
    turn = run_turn_now(session=session, text="RUNCMD ls", user=user)
    assert turn.status == Turn.Status.FAILED
    assert turn.error.startswith("codex sandbox unavailable on this host: bwrap: setting up uid map: Permission denied")
    assert scripted_codex.calls() == []  # no app-server was even started


def test_a_check_command_that_runs_but_reads_outside_its_profile_fails(settings, fresh_sandbox_check):
    settings.CODEX_SANDBOX_CHECK_COMMAND = json.dumps(
        ["sh", "-c", f"cat ../marker.txt; echo {fresh_sandbox_check.OK_WORD}"])
    with pytest.raises(fresh_sandbox_check.SandboxUnavailable, match="could read a file outside its profile"):
        fresh_sandbox_check.check_sandbox()


def test_the_real_sandbox_check_passes_on_this_host(dirs, fresh_sandbox_check):
    fresh_sandbox_check.check_sandbox(force=True)  # codex sandbox -P hermes-read-only … really ran, fenced


def test_a_command_whose_output_is_a_bwrap_error_fails_the_turn(scripted_codex, user, run_turn_now):
    from hermes_sessions import services
    from hermes_sessions.models import Turn

    item = {"type": "commandExecution", "id": "call_1", "command": "ls", "cwd": "/", "processId": None,
            "status": "failed", "commandActions": [], "aggregatedOutput": "bwrap: Can't mount proc on /newroot/proc\n",
            "exitCode": 1, "durationMs": 3, "source": "agent"}
    scripted_codex.script({"turn/start": [{"turn_items": [item]}]})
    session = services.session_create(owner=user)
    turn = run_turn_now(session=session, text="RUNCMD ls", user=user)
    assert turn.status == Turn.Status.FAILED
    assert turn.error.startswith("codex sandbox unavailable on this host: bwrap: Can't mount proc")
