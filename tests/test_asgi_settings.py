"""DATABASE_POOL: the ASGI API process's pool (CONN_MAX_AGE 0 + psycopg's pool); off, the default,
leaves Celery workers and the suite on persistent connections."""
import pytest

from tests.test_settings import _settings_json

PG = {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/nowhere", "DJANGO_SECRET_KEY": "k" * 50}


def test_database_pool_turns_persistent_connections_off_and_the_pool_on(tmp_path):
    code = {**PG, "HERMES_VAR_DIR": str(tmp_path), "DATABASE_POOL": "1", "DATABASE_POOL_MAX_SIZE": "7"}
    values = _settings_json(code, "DATABASES")
    assert "'CONN_MAX_AGE': 0" in values["DATABASES"]
    assert "'pool': {'min_size': 1, 'max_size': 7, 'timeout': 10}" in values["DATABASES"]
    assert "'CONN_HEALTH_CHECKS': True" in values["DATABASES"]  # Django then gives the pool its connection check
    assert "'ENGINE': 'project.postgresql_pool_backend'" in values["DATABASES"]  # … whose failure sweeps the pool


def test_without_database_pool_connections_persist_and_no_pool(tmp_path):
    values = _settings_json({**PG, "HERMES_VAR_DIR": str(tmp_path)}, "DATABASES")
    assert "'CONN_MAX_AGE': 60" in values["DATABASES"] and "pool" not in values["DATABASES"]


def _run_pooled(tmp_path, code: str, *, max_size: int) -> str:
    """Run ``code`` in a process with the ASGI shape's pool on the test database; its stdout."""
    import os
    import subprocess
    import sys

    from django.conf import settings

    env = {"PATH": "/usr/bin:/bin", "DJANGO_SETTINGS_MODULE": "project.settings", "DJANGO_SECRET_KEY": "k" * 50,
           "DATABASE_URL": _test_db_url(), "DATABASE_POOL": "1", "HERMES_VAR_DIR": str(tmp_path),
           "DATABASE_POOL_MAX_SIZE": str(max_size), "HOME": os.environ.get("HOME", "/")}
    done = subprocess.run([sys.executable, "-c", code], cwd=settings.BASE_DIR, env=env, capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _test_db_url() -> str:
    from django.conf import settings

    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.mark.django_db  # the test database exists (its URL is the subprocess's)
def test_a_pool_whose_every_connection_postgresql_dropped_serves_the_next_requests_at_once(tmp_path):
    """After one pg_terminate_backend of the API's pooled connections, psycopg_pool's
    own check discards them one at a time with 1 s, 2 s, 4 s … between checks, so requests answered 503
    after the pool's 10 s timeout while PostgreSQL was up. Six pooled connections, all dropped: each of
    the next six requests gets a connection within a second (psycopg_pool's own check: ~7 s for the first)."""
    code = "\n".join([
        "import threading, time, django, psycopg",
        "django.setup()",
        "from django.db import connection, connections",
        "pool = connection.pool",
        "pool.open(); pool.wait()",
        "held = [pool.getconn() for _ in range(6)]",
        "pids = [c.info.backend_pid for c in held]",
        "for c in held: pool.putconn(c)",
        f"with psycopg.connect({_test_db_url()!r}, autocommit=True) as other:",
        "    for pid in pids: other.execute('select pg_terminate_backend(%s)', (pid,))",
        "time.sleep(0.2)",
        "for i in range(6):",
        "    t0 = time.monotonic()",
        "    with connection.cursor() as c:",
        "        c.execute('select 1')",
        "        assert c.fetchone()[0] == 1",
        "    connection.close()",
        "    print(f'request {i}: {time.monotonic() - t0:.2f}')",
    ])
    out = _run_pooled(tmp_path, code, max_size=6)
    waits = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if line.startswith("request ")]
    assert len(waits) == 6 and max(waits) < 1.0, out


@pytest.mark.django_db  # the test database exists (its URL is the subprocess's)
def test_a_pooled_connection_postgresql_dropped_is_replaced_not_handed_out(tmp_path):
    """After pg_terminate_backend of the API's idle pooled connections, the first request on each must not
    get a 500 (logged nowhere): with the pool's check the next query works."""
    import os
    import subprocess
    import sys

    from django.conf import settings

    db = settings.DATABASES["default"]
    url = f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    code = "\n".join([
        "import django, psycopg",
        "django.setup()",
        "from django.db import connection",
        "with connection.cursor() as c:",
        "    c.execute('select pg_backend_pid()')",
        "    pid = c.fetchone()[0]",
        "connection.close()  # back to the pool, idle",
        f"with psycopg.connect({url!r}, autocommit=True) as other:",
        # With a timeout it returns once the backend is gone (PostgreSQL 14+): its goodbye is on the socket then.
        # Without one it returned at the signal, and under load the pool could hand the connection out first.
        "    other.execute('select pg_terminate_backend(%s, 5000)', (pid,))",
        "with connection.cursor() as c:",
        "    c.execute('select 1')",
        "    print('ok', c.fetchone()[0])",
    ])
    env = {"PATH": "/usr/bin:/bin", "DJANGO_SETTINGS_MODULE": "project.settings", "DJANGO_SECRET_KEY": "k" * 50,
           "DATABASE_URL": url, "DATABASE_POOL": "1", "HERMES_VAR_DIR": str(tmp_path),
           "DATABASE_POOL_MAX_SIZE": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=settings.BASE_DIR, env={**env, "HOME": os.environ.get("HOME", "/")},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok 1"), done.stderr[-2000:]
