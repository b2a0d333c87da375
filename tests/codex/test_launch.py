"""How the worker launches codex: config.toml and an allow-listed environment (issue 3 §9)."""
import pytest

from hermes_sessions.codex.launch import (
    NO_PROJECT_DOCS,
    app_server_argv,
    app_server_env,
    ensure_codex_home,
    render_config_toml,
)

SECRETS = {
    "DATABASE_URL": "postgres://u:S3CR3T@db/hermes",
    "CELERY_BROKER_URL": "redis://:S3CR3T@redis/0",
    "DJANGO_SECRET_KEY": "S3CR3T",
    "AWS_SECRET_ACCESS_KEY": "S3CR3T",
    "ANTHROPIC_API_KEY": "S3CR3T",
    "OPENAI_API_KEY": "sk-S3CR3T",
}


@pytest.fixture
def worker_env(monkeypatch, codex_dirs, settings, real_codex_bin):
    settings.CODEX_BIN = real_codex_bin
    settings.CODEX_APP_SERVER_COMMAND = ""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)


def test_worker_secrets_never_reach_codex(worker_env, settings):
    settings.CODEX_MODEL_PROVIDER = "stand-in"
    env = app_server_env()
    assert not set(SECRETS) & set(env)
    assert not any("S3CR3T" in value for value in env.values())
    assert env["CODEX_HOME"] == str(settings.CODEX_HOME) and env["HOME"] == str(settings.CODEX_USER_HOME)


def test_only_the_model_providers_key_is_passed(worker_env, settings):
    settings.CODEX_MODEL_PROVIDER = "openai"
    env = app_server_env()
    assert env["OPENAI_API_KEY"] == "sk-S3CR3T"
    assert not (set(SECRETS) - {"OPENAI_API_KEY"}) & set(env)
    assert 'env_key = "OPENAI_API_KEY"' in render_config_toml()


def test_operator_can_grant_extra_variables_explicitly(worker_env, settings, monkeypatch):
    monkeypatch.setenv("CODEX_PASS_ENV", "ANTHROPIC_API_KEY")
    assert app_server_env()["ANTHROPIC_API_KEY"] == "S3CR3T"


def test_config_is_offline_and_written_atomically(codex_dirs, settings):
    settings.CODEX_MODEL_PROVIDER = "stand-in"
    settings.CODEX_STAND_IN_URL = "http://127.0.0.1:9/v1"
    home = ensure_codex_home()
    text = (home / "config.toml").read_text()
    for line in ('plugins = false', 'unbounded_connection_retries = false', 'request_max_retries = 0',
                 'base_url = "http://127.0.0.1:9/v1"', 'approval_policy = "never"'):
        assert line in text
    # No legacy sandbox: it would replace the permission profiles (docs/codex.md §10).
    assert "sandbox_mode" not in text
    assert home.is_absolute()
    assert sorted(p.name for p in home.iterdir()) == ["config.toml"]


def test_each_session_gets_a_fresh_home_of_its_own(codex_dirs, settings):
    settings.CODEX_MODEL_PROVIDER = "stand-in"
    from hermes_sessions.codex.launch import prepare_session_home, session_home

    paths = prepare_session_home("sess-a")
    assert paths == session_home("sess-a")
    assert paths.home == (settings.CODEX_HOMES_ROOT / "sess-a" / "home").resolve() and paths.home.is_absolute()
    (paths.home / "sessions").mkdir()
    (paths.home / "sessions" / "leftover.jsonl").write_text("old")
    again = prepare_session_home("sess-a")  # the next turn: wiped and made again
    assert sorted(p.name for p in again.home.iterdir()) == ["config.toml"] and again.user_home.is_dir()
    env = app_server_env(again)
    assert (env["CODEX_HOME"], env["HOME"]) == (str(again.home), str(again.user_home))
    assert session_home("sess-b").home.parent != again.home.parent


def test_a_home_written_into_while_it_is_wiped_is_wiped_again_not_a_failed_turn(codex_dirs, settings, monkeypatch):
    """``make faults`` db-down-during-restore failed a turn with "[Errno 17] File exists": something (an exiting
    app-server of an earlier run of the session on this host) wrote into the home while ``rmtree`` removed it,
    so ``rmtree(ignore_errors=True)`` left it and the ``mkdir`` that followed raised. Removed again instead."""
    import shutil

    from hermes_sessions.codex import launch

    paths = launch.prepare_session_home("sess-race")
    (paths.home / "stale.sqlite").write_text("old")
    real_rmtree, calls = shutil.rmtree, []

    def rmtree_raced(path, ignore_errors=False):
        real_rmtree(path, ignore_errors=ignore_errors)
        calls.append(path)
        if len(calls) == 1:  # the exiting process writes its last file after the removal
            (paths.home).mkdir(parents=True)
            (paths.home / "late.sqlite-wal").write_text("late")

    monkeypatch.setattr(launch.shutil, "rmtree", rmtree_raced)
    again = launch.prepare_session_home("sess-race")
    assert len(calls) == 2
    assert sorted(p.name for p in again.home.iterdir()) == ["config.toml"]


def test_a_home_that_keeps_being_written_into_fails_with_the_os_error(codex_dirs, settings, monkeypatch):
    import shutil

    from hermes_sessions.codex import launch

    paths = launch.prepare_session_home("sess-busy")
    real_rmtree = shutil.rmtree

    def rmtree_always_raced(path, ignore_errors=False):
        real_rmtree(path, ignore_errors=ignore_errors)
        paths.home.mkdir(parents=True)

    monkeypatch.setattr(launch.shutil, "rmtree", rmtree_always_raced)
    monkeypatch.setattr(launch.time, "sleep", lambda s: None)
    with pytest.raises(FileExistsError):
        launch.prepare_session_home("sess-busy")


def test_a_kept_rollout_keeps_codex_state_of_it_and_nothing_else(codex_dirs):
    """``keep`` (the rollout this process holds): the file and codex's sqlite projection of the rollouts
    (``state_*``, ``thread_history_*`` with their WAL, shm and journal files) stay as they were; its logs,
    its other databases, skills and whatever else the last run left go. Without ``keep`` all of it goes."""
    from hermes_sessions.codex import launch

    paths = launch.prepare_session_home("sess-keep")
    rollout = paths.home / "sessions" / "2026" / "12" / "06" / "rollout-2026-12-06T00-00-00-t.jsonl"
    rollout.parent.mkdir(parents=True)
    rollout.write_text("rollout")
    kept = ["state_5.sqlite", "state_5.sqlite-wal", "state_5.sqlite-shm", "thread_history_1.sqlite",
            "thread_history_1.sqlite-journal"]
    gone = ["logs_2.sqlite", "logs_2.sqlite-wal", "goals_1.sqlite", "installation_id", "state_5.sqlite-old",
            "skills/.system/x/SKILL.md", "sessions/2026/12/05/rollout-2026-12-05T00-00-00-other.jsonl"]
    for name in kept + gone:
        (paths.home / name).parent.mkdir(parents=True, exist_ok=True)
        (paths.home / name).write_text(name)
    (paths.user_home / "leftover").write_text("x")

    again = launch.prepare_session_home("sess-keep", keep=rollout)
    assert rollout.read_text() == "rollout"
    assert all((again.home / name).read_text() == name for name in kept)
    assert not any((again.home / name).exists() for name in gone)
    assert not (again.user_home / "leftover").exists() and (again.home / "config.toml").exists()

    wiped = launch.prepare_session_home("sess-keep")
    assert sorted(p.name for p in wiped.home.iterdir()) == ["config.toml"]


def test_every_app_server_reads_no_project_docs(worker_env, settings, tmp_path):
    """codex 0.171.0 (docs/codex.md §11): under an allow-list profile each AGENTS.md / `.git` lookup at
    thread/resume runs in a sandboxed helper process of its own; ``project_doc_max_bytes=0`` on the
    command line of every app-server (a session's cold one, a spare, the tools') turns the lookups off."""
    assert NO_PROJECT_DOCS == ["-c", "project_doc_max_bytes=0"]
    cold = app_server_argv(sandbox="read-only", workdir=tmp_path / "work" / "s1")
    spare = app_server_argv()
    for argv in (cold, spare):
        assert argv[argv.index("project_doc_max_bytes=0") - 1] == "-c"
    settings.CODEX_APP_SERVER_COMMAND = '["python", "stand_in.py"]'
    assert app_server_argv()[-2:] == NO_PROJECT_DOCS


def test_project_docs_can_be_asked_for(settings):
    """``CODEX_PROJECT_DOCS``: codex's own AGENTS.md lookup, as before ``NO_PROJECT_DOCS`` (the bench's baseline)."""
    settings.CODEX_PROJECT_DOCS = True
    assert "project_doc_max_bytes=0" not in app_server_argv()
    settings.CODEX_PROJECT_DOCS = False
    assert app_server_argv()[-2:] == NO_PROJECT_DOCS
