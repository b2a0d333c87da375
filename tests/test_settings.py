"""project/settings.py: the two shapes, the secret key rule, no side effects at import, and
environment variable names that match the settings they set.

Settings are module-level code, so each case imports them in a fresh interpreter with an
environment of its own (nothing inherited from the test run, which is in the production shape).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

BASE = Path(__file__).resolve().parent.parent
SETTINGS_SOURCE = (BASE / "project" / "settings.py").read_text()
OPERATING = (BASE / "docs" / "operating.md").read_text()
ENV_READ = re.compile(r'env_(?:str|bool|int|float|path|list)\(\s*"([A-Z0-9_]+)"')


def _run(code: str, env: dict[str, str], settings_module: str = "project.settings") -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose environment is exactly ``env`` (plus PATH and the
    settings module)."""
    full_env = {"PATH": "/usr/bin:/bin", "DJANGO_SETTINGS_MODULE": settings_module, **env}
    return subprocess.run([sys.executable, "-c", code], cwd=BASE, env=full_env, capture_output=True, text=True,
                          timeout=60)


def _settings_json(env: dict[str, str], *names: str) -> dict:
    code = (
        "import json, django; django.setup(); from django.conf import settings; "
        f"print(json.dumps({{n: str(getattr(settings, n)) for n in {list(names)!r}}}))"
    )
    result = _run(code, env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("production_env", [
    {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/nowhere"},
    {"CELERY_BROKER_URL": "redis://127.0.0.1:6379/0"},
])
def test_production_shape_without_secret_key_refuses_to_start(tmp_path, production_env):
    result = _run("import project.settings", {"HERMES_VAR_DIR": str(tmp_path / "var"), **production_env})
    assert result.returncode != 0
    assert "django.core.exceptions.ImproperlyConfigured: DJANGO_SECRET_KEY is not set" in result.stderr
    # The message says when it is needed and how to make one.
    assert "get_random_secret_key" in result.stderr


def test_production_shape_uses_the_given_secret_key_and_debug_is_off(tmp_path):
    values = _settings_json(
        {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/nowhere", "DJANGO_SECRET_KEY": "k" * 50,
         "HERMES_VAR_DIR": str(tmp_path / "var")},
        "SECRET_KEY", "DEBUG", "HERMES_EMBEDDED",
    )
    assert values == {"SECRET_KEY": "k" * 50, "DEBUG": "False", "HERMES_EMBEDDED": "False"}


def test_embedded_demo_runs_on_the_development_key_the_embedded_postgresql_and_eager_tasks(tmp_path):
    values = _settings_json(
        {"HERMES_VAR_DIR": str(tmp_path / "var")},
        "SECRET_KEY", "DEMO_SECRET_KEY", "DEBUG", "HERMES_EMBEDDED", "CELERY_TASK_ALWAYS_EAGER",
    )
    assert values["SECRET_KEY"] == values["DEMO_SECRET_KEY"]
    assert values["DEBUG"] == "False"
    assert values["HERMES_EMBEDDED"] == "True"
    assert values["CELERY_TASK_ALWAYS_EAGER"] == "True"


@pytest.mark.parametrize("env", [{}, {"CELERY_BROKER_URL": "redis://127.0.0.1:6379/0", "DJANGO_SECRET_KEY": "k" * 50}])
def test_without_database_url_the_database_is_the_embedded_postgresql_under_the_var_dir(tmp_path, env):
    code = ("import json, django; django.setup(); from django.db import connection; "
            "print(json.dumps([connection.vendor, connection.settings_dict['ENGINE'], connection.settings_dict['HOST'], "
            "connection.settings_dict['NAME']]))")
    result = _run(code, {"HERMES_VAR_DIR": str(tmp_path / "var"), **env})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["postgresql", "project.embedded_postgres", str(tmp_path / "var" / "postgres"),
                                         "postgres"]


def test_a_database_url_that_is_not_postgresql_is_refused(tmp_path):
    result = _run("import project.settings", {"DATABASE_URL": f"sqlite:///{tmp_path}/db.sqlite3",
                                             "DJANGO_SECRET_KEY": "k" * 50})
    assert result.returncode != 0
    assert "DATABASE_URL must name a PostgreSQL database" in result.stderr


@pytest.mark.parametrize("env", [
    {},
    {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/nowhere", "DJANGO_SECRET_KEY": "k" * 50},
])
def test_importing_settings_and_setting_up_django_creates_no_directory(tmp_path, env):
    var = tmp_path / "var"
    # Everything that defaults to a folder lives under HERMES_VAR_DIR (here: tmp_path/var).
    code = "import django; django.setup(); from django.conf import settings; print(settings.CODEX_HOME)"
    result = _run(code, {"HERMES_VAR_DIR": str(var), **env})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(var / "codex" / "home")
    assert list(tmp_path.iterdir()) == []


def test_the_embedded_postgresql_starts_answers_and_stops_with_its_last_process(tmp_path):
    """project/embedded_postgres: the first connection makes the data directory and starts the server; the
    last process using it stops it at exit, also when a process that used it before died without saying so."""
    var = tmp_path / "nested" / "var"
    pgdata = var / "postgres"
    code = ("import django; django.setup(); from django.db import connection; c = connection.cursor(); "
            "c.execute('SELECT 1'); print(c.fetchone()[0], connection.pg_version // 10000)")
    env = {"HERMES_VAR_DIR": str(var), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}  # useradd, as root
    first = _run(code, env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["1", "16"]
    assert (pgdata / "PG_VERSION").is_file()
    assert not (pgdata / "postmaster.pid").exists()  # stopped when the process ended
    # A process that was on the list and died without its exit handlers (SIGKILL) is not waited for.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (pgdata / ".handle_pids.json").write_text(json.dumps([int(dead.stdout)]))
    second = _run(code, env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["1", "16"]
    assert not (pgdata / "postmaster.pid").exists()
    assert json.loads((pgdata / ".handle_pids.json").read_text()) == []


def test_beat_makes_its_schedule_folder(tmp_path):
    from project.beat import PersistentScheduler
    from project.celery import app

    schedule = tmp_path / "nested" / "celerybeat-schedule"
    scheduler = PersistentScheduler(app=app, schedule_filename=str(schedule))
    try:
        assert schedule.parent.is_dir()
    finally:
        scheduler.close()


def test_the_test_settings_have_a_fixed_key_and_a_fast_hasher():
    from project import settings_test

    assert settings.SECRET_KEY == settings_test.TEST_SECRET_KEY
    assert settings.PASSWORD_HASHERS == ["django.contrib.auth.hashers.MD5PasswordHasher"]


def test_every_environment_variable_lands_in_the_setting_of_its_name():
    """``NAME`` sets ``settings.NAME``; Django's own settings are read from ``DJANGO_<SETTING>``."""
    names = set(ENV_READ.findall(SETTINGS_SOURCE))
    assert len(names) > 30  # the pattern still finds the reads
    assert not re.search(r"os\.environ", SETTINGS_SOURCE.split("HERMES_VAR_DIR = ", 1)[1]), \
        "read the environment through the env_* helpers, so this test sees every name"
    for name in names:
        setting = name.removeprefix("DJANGO_")
        assert re.search(rf"^{setting} = .*env_\w+\(\s*\"{name}\"", SETTINGS_SOURCE, re.M), \
            f"{name} must be read into the setting {setting}"
        assert hasattr(settings, setting), setting


def test_every_environment_variable_is_in_the_settings_table():
    names = set(ENV_READ.findall(SETTINGS_SOURCE)) | {"OPENAI_API_KEY", "CODEX_PASS_ENV", "CODEX_RUST_LOG"}
    table = OPERATING.split("## 3. Settings (environment)", 1)[1]
    missing = sorted(n for n in names if f"| `{n}`" not in table)
    assert missing == [], f"docs/operating.md 'Settings (environment)' lacks {missing}"


@pytest.mark.django_db
def test_postgresql_finds_a_vanished_client_within_a_minute_not_two_hours():
    """A connection whose worker vanished without a FIN keeps its transaction, and the session row lock it
    holds, until the server's TCP keepalives find it dead: the OS default waits 2 h before the first probe.
    Every connection asks for 30 s + 3 × 10 s (settings ``DATABASE_KEEPALIVES_IDLE``; seen while testing a
    claim whose connection was cut mid-transaction)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'), "
                       "current_setting('tcp_keepalives_count')")
        assert cursor.fetchone() == ("30", "10", "3")


@pytest.mark.django_db
def test_our_side_of_each_connection_probes_it_too():
    """A process waiting for an answer over a path cut without a FIN (the server's host gone, a partition) found
    it dead only after the OS default of 2 h: libpq's keepalives ask for the same 30 s + 3 × 10 s."""
    from django.db import connection

    connection.ensure_connection()
    params = connection.connection.info.get_parameters()
    assert (params.get("keepalives"), params.get("keepalives_idle"), params.get("keepalives_interval"),
            params.get("keepalives_count")) == ("1", "30", "10", "3")


def test_pgoptions_for_a_diagnosis_is_kept_in_front_of_the_keepalives(tmp_path):
    env = {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/nowhere", "DJANGO_SECRET_KEY": "k" * 50,
           "HERMES_VAR_DIR": str(tmp_path), "PGOPTIONS": "-c log_min_duration_statement=0"}
    values = _settings_json(env, "DATABASES")
    assert ("'options': '-c log_min_duration_statement=0 -c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 "
            "-c tcp_keepalives_count=3'") in values["DATABASES"]


PGBOUNCER_ENV = {"DATABASE_URL": "postgres://hermes@pgbouncer:6432/hermes", "DJANGO_SECRET_KEY": "k" * 50,
                 "DATABASE_PGBOUNCER": "1", "DATABASE_LISTEN_URL": "postgres://hermes@postgres:5432/hermes"}


def test_behind_pgbouncer_nothing_is_prepared_no_server_side_cursor_and_no_startup_options(tmp_path):
    """PgBouncer 1.18 in transaction mode refuses a connection with startup ``options`` and cannot keep a
    prepared statement or a WITH HOLD cursor between transactions (docs/operating.md "Behind PgBouncer")."""
    code = ("import json, django; django.setup(); from django.conf import settings; from django.db import connection; "
            "p = connection.get_connection_params(); "
            "print(json.dumps([settings.DATABASE_PREPARE_THRESHOLD, "
            "settings.DATABASES['default']['DISABLE_SERVER_SIDE_CURSORS'], 'options' in p, p['prepare_threshold'], "
            "p['keepalives_idle']]))")
    result = _run(code, {**PGBOUNCER_ENV, "HERMES_VAR_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [0, True, False, None, 30]
    # PgBouncer ≥ 1.21 with max_prepared_statements can keep them: an explicit threshold is obeyed.
    values = _settings_json({**PGBOUNCER_ENV, "HERMES_VAR_DIR": str(tmp_path), "DATABASE_PREPARE_THRESHOLD": "2"},
                            "DATABASE_PREPARE_THRESHOLD")
    assert values == {"DATABASE_PREPARE_THRESHOLD": "2"}
    # Without PgBouncer: the keepalives go in the startup options, server-side cursors stay available.
    direct = _settings_json({"DATABASE_URL": PGBOUNCER_ENV["DATABASE_URL"], "DJANGO_SECRET_KEY": "k" * 50,
                             "HERMES_VAR_DIR": str(tmp_path)}, "DATABASES", "DATABASE_PREPARE_THRESHOLD")
    assert "tcp_keepalives_idle=30" in direct["DATABASES"] and "'DISABLE_SERVER_SIDE_CURSORS': False" in direct["DATABASES"]
    assert direct["DATABASE_PREPARE_THRESHOLD"] == "2"


@pytest.mark.parametrize("listen_url", [None, PGBOUNCER_ENV["DATABASE_URL"]])
def test_behind_pgbouncer_without_a_direct_listen_url_settings_refuse_to_start(tmp_path, listen_url):
    """A LISTEN through PgBouncer's transaction mode is never woken: refused at start, not found in production."""
    env = {**PGBOUNCER_ENV, "HERMES_VAR_DIR": str(tmp_path)}
    env.pop("DATABASE_LISTEN_URL")
    if listen_url:
        env["DATABASE_LISTEN_URL"] = listen_url
    result = _run("import project.settings", env)
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and "DATABASE_LISTEN_URL" in result.stderr, result.stderr


@pytest.mark.parametrize(("value", "says"), [("0", "HERMES_WORKER_TURNS must be at least 1, not 0"),
                                             ("-1", "HERMES_WORKER_TURNS must be at least 1, not -1"),
                                             ("abc", "HERMES_WORKER_TURNS must be an integer, not 'abc'"),
                                             ("1.5", "HERMES_WORKER_TURNS must be an integer, not '1.5'")])
def test_a_worker_turns_setting_that_could_run_no_turn_is_refused_at_start(tmp_path, value, says):
    """A worker with no turn permits would start, say it is ready, and never run a turn: refused at
    start, naming the variable."""
    result = _run("import project.settings", {"HERMES_WORKER_TURNS": value, "HERMES_VAR_DIR": str(tmp_path)})
    assert result.returncode != 0
    assert f"ImproperlyConfigured: {says}" in result.stderr, result.stderr
