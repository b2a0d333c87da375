"""Settings for hermes_sessions, read from the environment.

With nothing set, the project runs as the demo needs it: SQLite under ``var/``, Celery tasks run
eagerly in-process (no broker), codex pointed at the local model stand-in. Production and the test
suite set ``DATABASE_URL`` (PostgreSQL) and ``CELERY_BROKER_URL`` (Redis or RabbitMQ).
"""
from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("HERMES_VAR_DIR", BASE_DIR / "var")).resolve()


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "dev-only-insecure-key-change-me")
DEBUG = env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = [h for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,testserver").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI served from here, not a CDN
    "hermes_sessions",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "hermes_sessions.middleware.RejectNulMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",  # the admin's static files under gunicorn and runserver
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"
ASGI_APPLICATION = "project.asgi.application"

if not os.environ.get("DATABASE_URL"):
    VAR_DIR.mkdir(parents=True, exist_ok=True)  # the embedded SQLite default lives here
DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'db.sqlite3'}",
        conn_max_age=int(os.environ.get("DATABASE_CONN_MAX_AGE", "60")),
        conn_health_checks=True,  # a persistent connection killed by a database restart is replaced, not a 500
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # The embedded default: writers wait for each other (BEGIN IMMEDIATE + a busy timeout) rather
    # than failing with "database is locked" when the API and an eager turn write at once.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL;",
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
# Serve straight from the apps' static folders, so no collectstatic step is needed to run.
WHITENOISE_USE_FINDERS = True
try:
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns when it is missing
except OSError:
    pass

# Largest request body the API accepts (bytes); bigger bodies are refused.
DATA_UPLOAD_MAX_MEMORY_SIZE = int(os.environ.get("HERMES_MAX_BODY_BYTES", str(1024 * 1024)))

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PARSER_CLASSES": ["hermes_sessions.api.parsers.SafeJSONParser"],
    "EXCEPTION_HANDLER": "hermes_sessions.api.errors.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "hermes_sessions API",
    "DESCRIPTION": "Durable agent sessions whose turns run through the OpenAI Codex app-server.",
    "VERSION": "0.1.0",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# --- Celery -------------------------------------------------------------------------------------
# No broker configured: run tasks eagerly in the caller's process (demo / quick local use).
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "")
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", not CELERY_BROKER_URL)
CELERY_TASK_EAGER_PROPAGATES = False
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_DEFAULT_QUEUE = "celery"
HERMES_TURN_QUEUE = os.environ.get("HERMES_TURN_QUEUE", "turns")
# Turns get a queue of their own; the sweep stays on the default queue ("celery") so that long
# turns occupying every turn slot never delay crash recovery. Workers consume both (-Q turns,celery).
CELERY_TASK_ROUTES = {"hermes_sessions.tasks.run_turn": {"queue": HERMES_TURN_QUEUE}}
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A POST must not hang on a dead broker: try briefly, then leave the turn to the sweep.
CELERY_BROKER_CONNECTION_TIMEOUT = 2
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
# Redis redelivers an unacknowledged task after this many seconds; it must exceed the longest turn.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": int(os.environ.get("HERMES_VISIBILITY_TIMEOUT", "3600"))}
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
CELERY_BEAT_SCHEDULE = {
    "sweep-turns": {"task": "hermes_sessions.tasks.sweep_turns", "schedule": float(os.environ.get("HERMES_SWEEP_SECONDS", "10"))},
}

# --- Codex app-server ---------------------------------------------------------------------------
# The native binary shipped by the pinned npm package (package.json); the node wrapper is avoided
# because killing it orphans the real app-server (shared/codex/protocol.md §10.5).
CODEX_BIN = os.environ.get("CODEX_BIN", "")  # empty: located under node_modules at first use
CODEX_NODE_MODULES = Path(os.environ.get("CODEX_NODE_MODULES", BASE_DIR / "node_modules")).resolve()
# Full argv override (JSON list). Tests point this at the scripted app-server stand-in.
CODEX_APP_SERVER_COMMAND = os.environ.get("CODEX_APP_SERVER_COMMAND", "")
CODEX_HOME = Path(os.environ.get("CODEX_HOME", VAR_DIR / "codex" / "home")).resolve()
# Names this CODEX_HOME in bindings. Workers that share one CODEX_HOME (one host, or one shared
# filesystem) must share this id; the default is host:path.
CODEX_HOME_ID = os.environ.get("CODEX_HOME_ID", "")  # empty: f"{hostname}:{CODEX_HOME}"
# HOME given to codex, so the operator's own ~/.codex never leaks in.
CODEX_USER_HOME = Path(os.environ.get("CODEX_USER_HOME", VAR_DIR / "codex" / "user_home")).resolve()
# Per-session working directories are created under this root.
CODEX_WORK_ROOT = Path(os.environ.get("CODEX_WORK_ROOT", VAR_DIR / "codex" / "work")).resolve()
# "stand-in": the local Responses-API stand-in this project ships; "openai": api.openai.com with
# OPENAI_API_KEY; "config": use the operator's CODEX_CONFIG_TOML file as is.
CODEX_MODEL_PROVIDER = os.environ.get("CODEX_MODEL_PROVIDER", "stand-in")
CODEX_MODEL = os.environ.get("CODEX_MODEL", "")
CODEX_STAND_IN_URL = os.environ.get("CODEX_STAND_IN_URL", "http://127.0.0.1:8765/v1")
CODEX_CONFIG_TOML = os.environ.get("CODEX_CONFIG_TOML", "")
CODEX_REQUEST_TIMEOUT = env_float("CODEX_REQUEST_TIMEOUT", 30.0)  # seconds, each JSON-RPC request
CODEX_TURN_TIMEOUT = env_float("CODEX_TURN_TIMEOUT", 600.0)  # seconds, turn/start → turn/completed
CODEX_MAX_FRAME_BYTES = int(os.environ.get("CODEX_MAX_FRAME_BYTES", str(64 * 1024 * 1024)))
HISTORY_SEED_MAX_CHARS = int(os.environ.get("HERMES_HISTORY_SEED_MAX_CHARS", "32000"))

# --- Durability (see hermes_sessions/services/recovery.py) --------------------------------------
HERMES_LEASE_SECONDS = env_float("HERMES_LEASE_SECONDS", 30.0)  # a running turn's claim, renewed by its worker
HERMES_HEARTBEAT_SECONDS = env_float("HERMES_HEARTBEAT_SECONDS", 1.0)  # renewal and cancel-check interval
HERMES_SWEEP_SECONDS = env_float("HERMES_SWEEP_SECONDS", 10.0)
HERMES_MAX_ATTEMPTS = int(os.environ.get("HERMES_MAX_ATTEMPTS", "3"))  # claims of one turn before it fails
HERMES_REDISPATCH_SECONDS = env_float("HERMES_REDISPATCH_SECONDS", 60.0)  # queued this long at the head: send again
# Backoff (seconds) for retryable codex failures before turn/start (active writer, transport blip).
HERMES_RETRY_DELAYS = tuple(float(x) for x in os.environ.get("HERMES_RETRY_DELAYS", "0.5,1,2,4,8").split(",") if x)
HERMES_RETRY_DEADLINE = env_float("HERMES_RETRY_DEADLINE", 60.0)  # seconds per claim; see services/retry_policy.py
HERMES_IDEMPOTENCY_TTL = int(os.environ.get("HERMES_IDEMPOTENCY_TTL", str(24 * 3600)))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"hermes_sessions": {"handlers": ["console"], "level": os.environ.get("HERMES_LOG_LEVEL", "INFO")}},
}
