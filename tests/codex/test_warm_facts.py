"""The facts warm turns rest on, probed on the pinned codex binary with the model stand-in
(``docs/codex.md`` §11): an app-server spawned and initialized on an empty home (no session known yet)
later serves a session whose config and rollout were written into that home *after* ``initialize``;
``thread/unsubscribe`` with ``thread_unload_delay_secs = 0`` unloads the thread at once; a resume under the
session's allow-list profile runs no sandboxed project-doc (AGENTS.md) lookups with ``launch.NO_PROJECT_DOCS``.

Timings are printed (``-s``) for docs/codex.md, never asserted: this machine's load swings them."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

from devtools.model_stand_in import ModelStandIn
from hermes_sessions.codex.client import AppServerClient
from hermes_sessions.codex.errors import ThreadBusy
from hermes_sessions.codex.launch import (
    NO_PROJECT_DOCS,
    SessionHome,
    app_server_argv,
    app_server_env,
    permission_profile,
    prepare_session_home,
    write_home_config,
)
from hermes_sessions.codex.rollout_files import find_rollout
from hermes_sessions.codex.runner import TurnSpec, drive_turn

from ..support.real_codex import use_real_codex

UNLOAD_AT_ONCE = ["-c", "thread_unload_delay_secs=0"]


@pytest.fixture
def stand_in():
    with ModelStandIn() as server:
        yield server


def _ms(since: float) -> float:
    return round((time.monotonic() - since) * 1000, 1)


def _spec(workdir: Path, text: str, thread_id: str | None) -> TurnSpec:
    return TurnSpec(text=text, thread_id=thread_id, cwd=str(workdir), sandbox="workspace-write",
                    permission_profile=permission_profile("workspace-write"), turn_timeout=60)


def _wait_for(client: AppServerClient, method: str, timeout: float = 10.0) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        note = client.next_notification(timeout=0.5)
        if note is not None:
            seen.append(note["method"])
            if note["method"] == method:
                return seen
    pytest.fail(f"no {method} within {timeout} s (saw {seen})")


def test_a_rollout_restored_after_initialize_resumes_under_the_session_profile_and_unsubscribe_unloads(
    codex_dirs, settings, real_codex_bin, stand_in,
):
    use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
    workdir = Path(settings.CODEX_WORK_ROOT) / "s-warm"
    workdir.mkdir(parents=True)
    secret = Path(settings.CODEX_WORK_ROOT) / "s-other" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("OTHER-SESSION-SECRET")

    # Turn 1, the cold way (the session's own home, the profile on the command line too).
    paths = prepare_session_home("s-warm", sandbox="workspace-write", workdir=workdir)
    with AppServerClient(app_server_argv(sandbox="workspace-write", workdir=workdir), env=app_server_env(paths),
                         cwd=str(workdir), request_timeout=30) as cold:
        cold.start()
        thread_id = drive_turn(cold, _spec(workdir, "remember amber", None)).thread_id
    rollout = find_rollout(paths.home, thread_id)
    assert rollout is not None
    relpath, data = rollout.relative_to(paths.home), rollout.read_bytes()

    # A spare: an empty home with a config naming no session and no profile, no per-session -c.
    spare = SessionHome(home=Path(settings.CODEX_HOMES_ROOT) / ".spare-probe" / "home",
                        user_home=Path(settings.CODEX_HOMES_ROOT) / ".spare-probe" / "user_home")
    spare.home.mkdir(parents=True)
    spare.user_home.mkdir()
    write_home_config(spare.home)
    t0 = time.monotonic()
    with AppServerClient(app_server_argv() + UNLOAD_AT_ONCE, env=app_server_env(spare),
                         cwd=str(spare.user_home), request_timeout=30) as warm:
        warm.start()
        spawn_ms = _ms(t0)
        # Only now is the session known: its config (profile for its work dir) and rollout go in.
        write_home_config(spare.home, sandbox="workspace-write", workdir=workdir)
        (spare.home / relpath).parent.mkdir(parents=True, exist_ok=True)
        (spare.home / relpath).write_bytes(data)
        t1 = time.monotonic()
        resumed = warm.request("thread/resume", {"threadId": thread_id, "excludeTurns": True})
        resume_ms = _ms(t1)
        assert resumed["activePermissionProfile"]["id"] == "hermes-workspace-write"

        # The profile is the session's, read from the config written after spawn: its work dir is
        # writable, another session's directory does not exist inside the sandbox.
        wrote = drive_turn(warm, _spec(workdir, "RUNCMD touch warm-ok.txt", thread_id))
        assert wrote.status == "completed", wrote.error
        assert (workdir / "warm-ok.txt").exists()
        denied = drive_turn(warm, _spec(workdir, f"RUNCMD cat {secret}", thread_id))
        assert "OTHER-SESSION-SECRET" not in str(denied.messages)
        recalled = drive_turn(warm, _spec(workdir, "what did I ask you to remember?", thread_id))
        assert recalled.status == "completed"
        assert "remember amber" in str(stand_in.requests()[-1]), "the restored history reached the model"

        loaded = []
        for i in range(3):
            t2 = time.monotonic()
            assert drive_turn(warm, _spec(workdir, f"warm {i}", thread_id)).status == "completed"
            loaded.append(_ms(t2))

        # While the spare holds the thread, no other app-server on that home may resume it.
        with AppServerClient(app_server_argv(), env=app_server_env(spare), cwd=str(spare.user_home),
                             request_timeout=30) as other:
            other.start()
            with pytest.raises(ThreadBusy):
                other.request("thread/resume", {"threadId": thread_id, "excludeTurns": True})
            t3 = time.monotonic()
            assert warm.request("thread/unsubscribe", {"threadId": thread_id}) == {"status": "unsubscribed"}
            seen = _wait_for(warm, "thread/closed")
            unload_ms = _ms(t3)
            other.request("thread/resume", {"threadId": thread_id, "excludeTurns": True})  # at the first try
        assert warm.alive()  # the spare itself lives on, ready for another thread
    print(f"\nspawn+initialize {spawn_ms} ms; resume on the spare {resume_ms} ms; turns on the loaded thread "
          f"{loaded} ms; unsubscribe→thread/closed {unload_ms} ms ({seen})")


def _logging_bwrap(real_codex_bin: str, where: Path) -> tuple[Path, Path]:
    """A ``bwrap`` that notes its first argument in a log, then runs codex's bundled one. Codex 0.171.0
    finds bwrap on ``PATH`` (``app_server_env`` puts the bundled one there), so a directory ahead of it
    sees every sandbox codex builds. Returns (the directory to put first on PATH, the log)."""
    real = Path(real_codex_bin).resolve().parent.parent / "codex-resources" / "bwrap"
    assert real.exists(), real
    where.mkdir(parents=True)
    log = where / "bwrap.log"
    script = where / "bwrap"
    script.write_text(f'#!/bin/sh\necho "$1" >> "{log}"\nexec "{real}" "$@"\n')
    script.chmod(0o755)
    return where, log


def test_a_resume_under_the_profile_runs_no_sandboxed_project_doc_lookups(
    codex_dirs, settings, real_codex_bin, stand_in,
):
    """codex 0.171.0 (docs/codex.md §11): under an allow-list permission profile, every path codex stats
    while setting up a resumed thread is stat'ed by a sandboxed helper process of its own
    (``codex-linux-sandbox`` → ``bwrap --help`` probe → bwrap → ``codex --codex-run-as-fs-helper``), one
    ``bwrap --help`` each. Without ``project_doc_max_bytes=0`` the project-doc search adds one per path:
    ``AGENTS.override.md``, ``AGENTS.md`` and a ``.git`` marker in the work dir and each of its ancestors,
    one after the other — most of the resume's cost. With it (``launch.NO_PROJECT_DOCS``, on every
    app-server's command line) only the repo-skills lookup (``<cwd>/.agents/skills``, 2 helpers) is left.
    The profile is still the session's. Counts, not milliseconds: this machine's load swings those."""
    use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
    workdir = Path(settings.CODEX_WORK_ROOT) / "s-docs"
    workdir.mkdir(parents=True)
    paths = prepare_session_home("s-docs", sandbox="read-only", workdir=workdir)
    with AppServerClient(app_server_argv(sandbox="read-only", workdir=workdir), env=app_server_env(paths),
                         cwd=str(workdir), request_timeout=30) as cold:
        cold.start()
        thread_id = drive_turn(cold, TurnSpec(text="hello", thread_id=None, cwd=str(workdir), sandbox="read-only",
                                              permission_profile=permission_profile("read-only"),
                                              turn_timeout=60)).thread_id
    rollout = find_rollout(paths.home, thread_id)
    assert rollout is not None
    relpath, data = rollout.relative_to(paths.home), rollout.read_bytes()
    wrapper_dir, log = _logging_bwrap(real_codex_bin, Path(settings.CODEX_HOMES_ROOT) / ".bwrap-log")

    assert app_server_argv()[-2:] == NO_PROJECT_DOCS
    variants = {"without": app_server_argv()[:-2], "with": app_server_argv()}
    helpers: dict[str, list[int]] = {name: [] for name in variants}
    resume_ms: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(2):
        for name, argv in (variants.items() if round_ == 0 else reversed(variants.items())):
            root = Path(settings.CODEX_HOMES_ROOT) / f".probe-{name}-{round_}"
            home = SessionHome(home=root / "home", user_home=root / "user_home")
            home.home.mkdir(parents=True)
            home.user_home.mkdir()
            write_home_config(home.home, sandbox="read-only", workdir=workdir)
            (home.home / relpath).parent.mkdir(parents=True, exist_ok=True)
            (home.home / relpath).write_bytes(data)
            env = app_server_env(home)
            env["PATH"] = f"{wrapper_dir}:{env['PATH']}"
            with AppServerClient(argv, env=env, cwd=str(workdir), request_timeout=30) as client:
                client.start()
                log.write_text("")  # only what the resume does
                t0 = time.monotonic()
                resumed = client.request("thread/resume", {"threadId": thread_id, "excludeTurns": True})
                resume_ms[name].append(_ms(t0))
                assert resumed["activePermissionProfile"]["id"] == "hermes-read-only"
                helpers[name].append(log.read_text().split().count("--help"))
    print(f"\nsandboxed helpers during resume {helpers}; resume ms {resume_ms} "
          f"(medians {statistics.median(resume_ms['without'])} / {statistics.median(resume_ms['with'])})")
    # Without the setting: AGENTS.override.md, AGENTS.md and at least the work dir's own `.git` on top.
    assert min(helpers["without"]) >= max(helpers["with"]) + 3, helpers
    assert max(helpers["with"]) <= 2, helpers  # only the repo-skills lookup is left
