"""DATABASE_POOL: the ASGI API process's pool (CONN_MAX_AGE 0 + psycopg's pool); off, the default,
leaves Celery workers and the suite on persistent connections."""
from tests.test_settings import _settings_json

PG = {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/nowhere", "DJANGO_SECRET_KEY": "k" * 50}


def test_database_pool_turns_persistent_connections_off_and_the_pool_on(tmp_path):
    code = {**PG, "HERMES_VAR_DIR": str(tmp_path), "DATABASE_POOL": "1", "DATABASE_POOL_MAX_SIZE": "7"}
    values = _settings_json(code, "DATABASES")
    assert "'CONN_MAX_AGE': 0" in values["DATABASES"]
    assert "'pool': {'min_size': 1, 'max_size': 7, 'timeout': 10}" in values["DATABASES"]
    assert "'CONN_HEALTH_CHECKS': True" in values["DATABASES"]  # Django then gives the pool its connection check


def test_without_database_pool_connections_persist_and_no_pool(tmp_path):
    values = _settings_json({**PG, "HERMES_VAR_DIR": str(tmp_path)}, "DATABASES")
    assert "'CONN_MAX_AGE': 60" in values["DATABASES"] and "pool" not in values["DATABASES"]


def test_a_pooled_connection_postgresql_dropped_is_replaced_not_handed_out(tmp_path):
    """Found by an adversary: after pg_terminate_backend of the API's idle pooled connections, the first
    request on each got a 500 (and the 500 was logged nowhere). With the pool's check the next query works."""
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
        "    other.execute('select pg_terminate_backend(%s)', (pid,))",
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
