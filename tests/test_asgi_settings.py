"""DATABASE_POOL: the ASGI API process's pool (CONN_MAX_AGE 0 + psycopg's pool); off, the default,
leaves Celery workers and the suite on persistent connections."""
from tests.test_settings import _settings_json

PG = {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/nowhere", "DJANGO_SECRET_KEY": "k" * 50}


def test_database_pool_turns_persistent_connections_off_and_the_pool_on(tmp_path):
    code = {**PG, "HERMES_VAR_DIR": str(tmp_path), "DATABASE_POOL": "1", "DATABASE_POOL_MAX_SIZE": "7"}
    values = _settings_json(code, "DATABASES")
    assert "'CONN_MAX_AGE': 0" in values["DATABASES"]
    assert "'pool': {'min_size': 1, 'max_size': 7, 'timeout': 10}" in values["DATABASES"]


def test_without_database_pool_connections_persist_and_no_pool(tmp_path):
    values = _settings_json({**PG, "HERMES_VAR_DIR": str(tmp_path)}, "DATABASES")
    assert "'CONN_MAX_AGE': 60" in values["DATABASES"] and "pool" not in values["DATABASES"]
