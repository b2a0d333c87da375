"""Settings for hermes_sessions, read from the environment.

Two shapes:

* **Embedded (the demo)**: neither ``DATABASE_URL`` nor ``CELERY_BROKER_URL`` is set. A private PostgreSQL
  under ``HERMES_VAR_DIR`` that the first connection starts (``project/embedded_postgres``), Celery tasks run
  eagerly in-process (no broker), codex pointed at the local model stand-in, and a built-in development ``SECRET_KEY``.
* **Production shape**: ``DATABASE_URL`` (PostgreSQL) and/or ``CELERY_BROKER_URL`` (Redis or RabbitMQ)
  set. ``DJANGO_SECRET_KEY`` is then required: importing these settings without it raises
  ``ImproperlyConfigured``.

Names: every environment variable lands in the setting of the same name (``HERMES_*``, ``CODEX_*``,
``CELERY_*``, ``DATABASE_*``), except Django's own settings, which are read from ``DJANGO_<SETTING>``
(``DJANGO_SECRET_KEY`` → ``SECRET_KEY``), the cookiecutter-django convention. README "Settings
(environment)" lists them all.

Importing this module has no side effects: it creates no directory. Directories are made where they
are used (the embedded PostgreSQL's backend makes and starts its data directory on first connection,
``project/beat.py`` the beat schedule's, ``codex/launch.py`` codex's). Tests use
``project/settings_test.py``.
"""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from project.log_format import LOG_FORMATS, logging_config

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str = "") -> str:
    """The variable's value; ``default`` when it is unset or empty."""
    return os.environ.get(name) or default


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if not value:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    """The integer in ``name`` (``default`` when unset or empty); ``ImproperlyConfigured`` naming the
    variable when it is not an integer or is below ``minimum``."""
    value = os.environ.get(name)
    try:
        number = int(value) if value else default
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, not {value!r}") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, not {number}")
    return number


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    try:
        return float(value) if value else default
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, not {value!r}") from None


def env_path(name: str, default: Path) -> Path:
    """An absolute path (codex needs absolute paths); nothing is created here."""
    return Path(os.environ.get(name) or default).resolve()


def env_list(name: str, default: str) -> list[str]:
    """A comma-separated list; empty items are dropped."""
    return [item.strip() for item in env_str(name, default).split(",") if item.strip()]


HERMES_VAR_DIR = env_path("HERMES_VAR_DIR", BASE_DIR / "var")  # the embedded database, codex's state, beat's schedule
DATABASE_URL = env_str("DATABASE_URL")
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL")
HERMES_EMBEDDED = not DATABASE_URL and not CELERY_BROKER_URL  # derived, not read from the environment

# Only the embedded demo may run on a key everybody can read in this file.
DEMO_SECRET_KEY = "django-insecure-hermes-sessions-embedded-demo-only"
SECRET_KEY = env_str("DJANGO_SECRET_KEY")
if not SECRET_KEY:
    if not HERMES_EMBEDDED:
        raise ImproperlyConfigured(
            "DJANGO_SECRET_KEY is not set. It is required whenever DATABASE_URL or CELERY_BROKER_URL is set "
            "(the production shape); only the embedded demo (neither set) runs on a built-in development key. "
            "Set DJANGO_SECRET_KEY to a long random value, e.g. the output of: python -c "
            "'from django.core.management.utils import get_random_secret_key; print(get_random_secret_key())'"
        )
    SECRET_KEY = DEMO_SECRET_KEY
DEBUG = env_bool("DJANGO_DEBUG", False)
# "testserver": `manage.py demo` drives the API through Django's test client, which sends that Host.
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,testserver")

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
    "hermes_sessions.middleware.RequireContentLengthMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",  # the admin's static files under gunicorn and runserver
    "django.contrib.sessions.middleware.SessionMiddleware",
    "hermes_sessions.middleware.ApiOptionalSlashMiddleware",  # before CommonMiddleware's APPEND_SLASH redirect
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

DATABASE_CONN_MAX_AGE = env_int("DATABASE_CONN_MAX_AGE", 60)  # seconds a connection is reused
DATABASES: dict[str, dict[str, Any]]
if DATABASE_URL:
    DATABASES = {"default": dict(dj_database_url.parse(DATABASE_URL))}
    if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        raise ImproperlyConfigured(f"DATABASE_URL must name a PostgreSQL database (postgres://…), not "
                                   f"{DATABASE_URL.split(':', 1)[0]}: the service runs on PostgreSQL only")
else:
    # The embedded default: the same backend on a private PostgreSQL that its first connection starts, data
    # directory (and Unix socket) HERMES_VAR_DIR/postgres (project/embedded_postgres).
    DATABASES = {"default": {"ENGINE": "project.embedded_postgres", "NAME": "postgres", "USER": "postgres",
                             "HOST": str(HERMES_VAR_DIR / "postgres")}}
DATABASES["default"].update(
    CONN_MAX_AGE=DATABASE_CONN_MAX_AGE,
    CONN_HEALTH_CHECKS=True,  # a persistent connection killed by a database restart is replaced, not a 500
)
# The server's TCP keepalives on our connections: a connection whose client vanished without a FIN (a network
# cut, a frozen VM — not kill -9, whose socket the kernel closes) is found dead within DATABASE_KEEPALIVES_IDLE
# + 3 × 10 s and its transaction rolled back, instead of after the OS default of 2 h while it holds a session's
# row lock (every writer of that session waits: claims, finalizes; POSTs get 503 session_locked). PGOPTIONS
# (libpq's own variable, e.g. a statement log for a diagnosis) is kept in front.
DATABASE_KEEPALIVES_IDLE = env_int("DATABASE_KEEPALIVES_IDLE", 30)
PGOPTIONS = env_str("PGOPTIONS")
# Behind PgBouncer in transaction mode (docs/operating.md "Behind PgBouncer"): DATABASE_URL names PgBouncer and
# DATABASE_LISTEN_URL names PostgreSQL itself, for every connection of our own that LISTENs or keeps state
# between transactions (hermes_sessions/listener.py: the wake listener, the event hub and its reader); unset,
# those use the default database (DATABASE_URL). Set, DATABASE_PGBOUNCER also means: no startup `options` (PgBouncer 1.18 refuses the
# connection: "unsupported startup parameter: options"; PgBouncer's own tcp_keepalive and idle_transaction_timeout
# take the keepalives' and the worker's idle-transaction bound's place), Django's server-side cursors off (a
# WITH HOLD cursor outlives its transaction, and PgBouncer hands the server connection to another client), and
# DATABASE_PREPARE_THRESHOLD 0 unless set. tests/e2e/test_pgbouncer.py runs turns through a real PgBouncer.
DATABASE_PGBOUNCER = env_bool("DATABASE_PGBOUNCER", False)
DATABASE_LISTEN_URL = env_str("DATABASE_LISTEN_URL")
if DATABASE_PGBOUNCER:
    if not DATABASE_URL:
        raise ImproperlyConfigured("DATABASE_PGBOUNCER=1 needs DATABASE_URL (PgBouncer's address); the embedded "
                                   "demo's PostgreSQL has no PgBouncer in front")
    if DATABASE_LISTEN_URL in {"", DATABASE_URL}:
        raise ImproperlyConfigured(
            "DATABASE_PGBOUNCER=1 needs DATABASE_LISTEN_URL: a direct connection to PostgreSQL (not PgBouncer) for "
            "LISTEN, which PgBouncer's transaction mode cannot carry (the wake listener and the event streams "
            "would never be woken)")
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
else:
    DATABASES["default"].setdefault("OPTIONS", {})["options"] = " ".join(filter(None, [
        PGOPTIONS.strip(),
        f"-c tcp_keepalives_idle={DATABASE_KEEPALIVES_IDLE} -c tcp_keepalives_interval=10 -c tcp_keepalives_count=3",
    ]))
# The same on our side (libpq's keepalives): a worker or API process waiting for an answer over a path cut
# without a FIN — the server gone with its host, a network partition — finds its connection dead within the
# same bound and fails that database call (the turn is retried, the request gets its 503) instead of waiting
# 2 h, stuck with its turn slot taken.
# (The embedded server's Unix socket has no keepalives; PostgreSQL and libpq ignore these there.)
DATABASES["default"].setdefault("OPTIONS", {}).update(
    keepalives=1, keepalives_idle=DATABASE_KEEPALIVES_IDLE, keepalives_interval=10, keepalives_count=3)
# The statements of the warm path's pipelined transactions (hermes_sessions/services/pipelining.py: the
# enqueue, the claim, the finalize) are bound server-side and prepared on a connection once it has run them
# this many times, so PostgreSQL stops parsing and planning them on every turn (parse + plan were ~70 % of
# the server's time on those statements, statement log of make bench-warm). Django's own queries keep its
# default (client-side binding, nothing prepared). 0: no prepared statements — the default with
# DATABASE_PGBOUNCER (PgBouncer's transaction mode before 1.21 cannot keep them: another client's transaction
# finds the statement missing, or its own name taken).
DATABASE_PREPARE_THRESHOLD = env_int("DATABASE_PREPARE_THRESHOLD", 0 if DATABASE_PGBOUNCER else 2)
# ASGI (make run): psycopg's connection pool with CONN_MAX_AGE = 0 — persistent connections are not
# supported under ASGI and leak (../shared/pitfalls.md, Django #37066). Off by default: Celery's prefork
# workers and the test suite keep DATABASE_CONN_MAX_AGE (a pool must not be shared across a fork). The embedded
# default has no pool (its backend, project/embedded_postgres, is the one without).
DATABASE_POOL = env_bool("DATABASE_POOL", False)
DATABASE_POOL_MAX_SIZE = env_int("DATABASE_POOL_MAX_SIZE", 20)  # connections per API process
if DATABASE_POOL and DATABASE_URL:
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    # Django's PostgreSQL backend and pool, which after one broken connection checks the others at once
    # instead of psycopg_pool's 1 s, 2 s, 4 s … between checks (project/postgresql_pool_backend).
    DATABASES["default"]["ENGINE"] = "project.postgresql_pool_backend"
    DATABASES["default"]["OPTIONS"]["pool"] = {"min_size": 1, "max_size": DATABASE_POOL_MAX_SIZE, "timeout": 10}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# Served straight from the apps' static folders (WhiteNoise with finders), so no collectstatic step
# is needed and nothing is read from STATIC_ROOT; set DJANGO_STATIC_ROOT only to run collectstatic.
STATIC_ROOT = env_str("DJANGO_STATIC_ROOT") or None
WHITENOISE_USE_FINDERS = True

# Largest request body the API accepts (bytes); bigger bodies get 413.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("DJANGO_DATA_UPLOAD_MAX_MEMORY_SIZE", 1024 * 1024)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",  # Authorization: Token <key>
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PARSER_CLASSES": ["hermes_sessions.api.parsers.SafeJSONParser"],
    # DRF's two defaults, the JSON one safe for a lone surrogate quoted back in a 400 (api/renderers.py).
    "DEFAULT_RENDERER_CLASSES": [
        "hermes_sessions.api.renderers.SafeJSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "EXCEPTION_HANDLER": "hermes_sessions.api.errors.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "hermes_sessions API",
    "DESCRIPTION": "Durable agent sessions whose turns run through the OpenAI Codex app-server.",
    "VERSION": "0.1.0",
    # Operation ids and tags are named from the path after /api/ (``sessions_create``, tag ``sessions``):
    # auto-detection would also count the views outside /api/ (GET /metrics is a DRF view, not in the
    # schema) and name them ``api_sessions_create`` (tests/e2e/test_generated_client.py imports them).
    "SCHEMA_PATH_PREFIX": r"/api/",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # The server-sent-event endpoints are async Django views, not DRF views: this hook documents them.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "hermes_sessions.api.schema.add_event_streams",
    ],
    # The schema documents the API, not itself (GET /api/ links it); tests/api/test_contract.py.
    "SERVE_INCLUDE_SCHEMA": False,
    # An approval's status and kind are other enums than a turn's status and a notice's kind; the latter
    # keep the names they had before approvals (generated clients use them).
    "ENUM_NAME_OVERRIDES": {
        "StatusEnum": "hermes_sessions.models.Turn.Status",
        "KindEnum": "hermes_sessions.models.Notice.Kind",
        "ApprovalStatusEnum": "hermes_sessions.models.Approval.Status",
        "ApprovalKindEnum": "hermes_sessions.models.Approval.Kind",
    },
}
# Seconds between heartbeats (": heartbeat" comment lines) on an idle event stream; each tick also
# re-reads the table (api/streams.py).
HERMES_SSE_HEARTBEAT_SECONDS = env_float("HERMES_SSE_HEARTBEAT_SECONDS", 15.0)

# --- Celery -------------------------------------------------------------------------------------
# No broker configured: run tasks eagerly in the caller's process (demo / quick local use).
# (CELERY_BROKER_URL is read at the top: it decides the shape.)
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", not CELERY_BROKER_URL)
CELERY_TASK_EAGER_PROPAGATES = False
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_DEFAULT_QUEUE = "celery"
HERMES_TURN_QUEUE = env_str("HERMES_TURN_QUEUE", "turns")
# Turns get a queue of their own; the sweep stays on the default queue ("celery") so that long
# turns occupying every turn slot never delay crash recovery. Workers consume both (`make worker`: -Q <HERMES_TURN_QUEUE>,celery).
CELERY_TASK_ROUTES = {"hermes_sessions.tasks.run_turn": {"queue": HERMES_TURN_QUEUE}}
CELERY_TASK_ACKS_LATE = True
# Celery's Django fix-up closes every database connection before and after each task unless this is set
# (celery/fixups/django.py): a new connection per turn, ~3-8 ms on the warm path. Set, it closes them only
# every 2 × N tasks; project/celery.py closes them as Django closes a request's instead — when unusable
# (after an error: a restarted PostgreSQL) or older than DATABASE_CONN_MAX_AGE.
CELERY_DB_REUSE_MAX = 1_000_000
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A worker outlives its broker: it reconnects for as long as the broker is away (Celery's default gives
# up after 100 tries and ends the worker), and a lost connection's clean-up cannot end it
# (project/broker.py: the Celery 5.7 / kombu 5.7 Redis fault, README "Fault injection").
CELERY_BROKER_CONNECTION_RETRY = True
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
CELERY_WORKER_CONSUMER = "project.broker:Consumer"
CELERY_BROKER_TRANSPORT = ("project.broker:RedisTransport"
                           if CELERY_BROKER_URL.startswith(("redis://", "rediss://")) else None)
# A running turn keeps running when the broker connection drops: its lease in PostgreSQL, not the
# broker's acknowledgement, decides who owns it (a redelivered copy finds it running and does nothing).
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
# A POST must not hang on a dead broker: try briefly, then leave the turn to the sweep.
CELERY_BROKER_CONNECTION_TIMEOUT = 2
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
# Redis redelivers an unacknowledged task after this many seconds; it must exceed the longest turn.
HERMES_VISIBILITY_TIMEOUT = env_int("HERMES_VISIBILITY_TIMEOUT", 3600)
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": HERMES_VISIBILITY_TIMEOUT}
# The sweep's interval (seconds); see "Durability" below.
HERMES_SWEEP_SECONDS = env_float("HERMES_SWEEP_SECONDS", 10.0)
CELERY_BEAT_SCHEDULE_FILENAME = str(HERMES_VAR_DIR / "celerybeat-schedule")
CELERY_BEAT_SCHEDULER = "project.beat:PersistentScheduler"  # makes the schedule file's folder
CELERY_BEAT_SCHEDULE = {
    "sweep-turns": {"task": "hermes_sessions.tasks.sweep_turns", "schedule": HERMES_SWEEP_SECONDS},
}

# --- Webhooks (docs/operating.md, "Webhooks") ----------------------------------------------------
# Deliveries are claimed by every worker's sweep round (and beat's sweep) and sent by the task
# deliver_webhooks on this queue (workers consume `celery`; a worker of its own: -Q <this queue>).
HERMES_WEBHOOK_QUEUE = env_str("HERMES_WEBHOOK_QUEUE", "celery")
CELERY_TASK_ROUTES["hermes_sessions.tasks.deliver_webhooks"] = {"queue": HERMES_WEBHOOK_QUEUE}
HERMES_WEBHOOK_TIMEOUT_SECONDS = env_float("HERMES_WEBHOOK_TIMEOUT_SECONDS", 10.0)  # one attempt, connect included
HERMES_WEBHOOK_RETRY_SECONDS = env_float("HERMES_WEBHOOK_RETRY_SECONDS", 86_400.0)  # give up this long after the event
HERMES_WEBHOOK_BACKOFF_SECONDS = env_float("HERMES_WEBHOOK_BACKOFF_SECONDS", 5.0)  # after the 1st failure; doubles
HERMES_WEBHOOK_BACKOFF_MAX_SECONDS = env_float("HERMES_WEBHOOK_BACKOFF_MAX_SECONDS", 3_600.0)
HERMES_WEBHOOK_DISABLE_AFTER = env_int("HERMES_WEBHOOK_DISABLE_AFTER", 20)  # consecutive failed attempts; 0: never
HERMES_WEBHOOK_BATCH = env_int("HERMES_WEBHOOK_BATCH", 10)  # deliveries per task
# SSRF: targets must resolve to public addresses only, unless allowed here (an operator's choice).
HERMES_WEBHOOK_ALLOW_PRIVATE = env_bool("HERMES_WEBHOOK_ALLOW_PRIVATE", False)
HERMES_WEBHOOK_ALLOWED_NETWORKS = env_list("HERMES_WEBHOOK_ALLOWED_NETWORKS", "")  # CIDRs, e.g. 10.1.2.0/24

# --- Codex app-server ---------------------------------------------------------------------------
# The native binary shipped by the pinned npm package (package.json); the node wrapper is avoided
# because killing it orphans the real app-server process it starts.
CODEX_BIN = env_str("CODEX_BIN")  # empty: located under node_modules at first use
CODEX_NODE_MODULES = env_path("CODEX_NODE_MODULES", BASE_DIR / "node_modules")
# Full argv override (JSON list). Tests point this at the scripted app-server stand-in.
CODEX_APP_SERVER_COMMAND = env_str("CODEX_APP_SERVER_COMMAND")
# Each turn's app-server gets CODEX_HOMES_ROOT/<session id>/home (its CODEX_HOME, wiped and restored
# from PostgreSQL at every turn) and .../user_home (its HOME). Same absolute path on every host.
CODEX_HOMES_ROOT = env_path("CODEX_HOMES_ROOT", HERMES_VAR_DIR / "codex" / "homes")
# The legacy shared home: rollouts written before PostgreSQL kept them are imported from here (on first
# use, or all at once by `manage.py import_rollouts`); tools that drive codex outside a session use it.
CODEX_HOME = env_path("CODEX_HOME", HERMES_VAR_DIR / "codex" / "home")
# HOME given to codex run on the shared CODEX_HOME (tools), so the operator's own ~/.codex never leaks in.
CODEX_USER_HOME = env_path("CODEX_USER_HOME", HERMES_VAR_DIR / "codex" / "user_home")
# Per-session working directories are created under this root.
CODEX_WORK_ROOT = env_path("CODEX_WORK_ROOT", HERMES_VAR_DIR / "codex" / "work")
# "stand-in": the local Responses-API stand-in this project ships; "openai": api.openai.com with
# OPENAI_API_KEY; "config": use the operator's CODEX_CONFIG_TOML file as is.
CODEX_MODEL_PROVIDER = env_str("CODEX_MODEL_PROVIDER", "stand-in")
CODEX_MODEL = env_str("CODEX_MODEL")
CODEX_STAND_IN_URL = env_str("CODEX_STAND_IN_URL", "http://127.0.0.1:8765/v1")
CODEX_CONFIG_TOML = env_str("CODEX_CONFIG_TOML")
CODEX_REQUEST_TIMEOUT = env_float("CODEX_REQUEST_TIMEOUT", 30.0)  # seconds, each JSON-RPC request
CODEX_TURN_TIMEOUT = env_float("CODEX_TURN_TIMEOUT", 600.0)  # seconds, turn/start → turn/completed
# Seconds a turn's approvals may wait for a person, all together (worker/approvals.py); then codex is
# answered decline and the approval is expired. Not counted in CODEX_TURN_TIMEOUT; the worker's time limits add it.
HERMES_APPROVAL_TIMEOUT_SECONDS = env_float("HERMES_APPROVAL_TIMEOUT_SECONDS", 900.0)
# Turns of one worker process that may wait for a person at once without holding its turn permit ("parked",
# hermes_sessions/worker/runners.py): each keeps its app-server (~22 MB private) and a runner thread. Past it a
# waiting turn keeps its permit. 0: no turn parks.
HERMES_MAX_PARKED_TURNS = env_int("HERMES_MAX_PARKED_TURNS", 32)
# Let the model ask questions (codex's request_user_input) outside Plan mode; they are put to a person
# (item/tool/requestUserInput) in sessions whose approval_policy is not "never" (codex/launch.py).
CODEX_USER_INPUT_IN_DEFAULT_MODE = env_bool("CODEX_USER_INPUT_IN_DEFAULT_MODE", False)
CODEX_MAX_FRAME_BYTES = env_int("CODEX_MAX_FRAME_BYTES", 64 * 1024 * 1024)
# JSON list replacing the start-up sandbox check command (hermes_sessions/codex/sandbox_check.py); tests only.
CODEX_SANDBOX_CHECK_COMMAND = env_str("CODEX_SANDBOX_CHECK_COMMAND")
# Let codex read AGENTS.md project docs from a session's work dir (off: -c project_doc_max_bytes=0, which
# saves a sandboxed helper process per looked-up path at every resume; docs/codex.md §11).
CODEX_PROJECT_DOCS = env_bool("CODEX_PROJECT_DOCS", False)
# Tail cap (characters) of the transcript a fresh thread is seeded with (hermes_sessions/history_seed.py).
HERMES_HISTORY_SEED_MAX_CHARS = env_int("HERMES_HISTORY_SEED_MAX_CHARS", 32000)
# Spare app-servers per worker process, spawned and initialized ahead of need (hermes_sessions/worker/warm/spares.py);
# 0 (default): every turn spawns its own. Spares older than HERMES_WARM_POOL_MAX_AGE seconds are replaced.
HERMES_WARM_POOL = env_int("HERMES_WARM_POOL", 0)
HERMES_WARM_POOL_MAX_AGE = env_float("HERMES_WARM_POOL_MAX_AGE", 600.0)
# Session affinity (hermes_sessions/worker/warm/kept.py, worker/affinity.py): after a turn, a worker with one pool
# process (-c 1, or -P solo) keeps the app-server with the thread loaded for HERMES_WARM_IDLE_SECONDS
# (0: close it after every turn) and the session's next turn wakes that worker by PostgreSQL NOTIFY while its
# heartbeat is fresh; a turn it has not claimed HERMES_AFFINITY_DEADLINE seconds later is dispatched to the shared
# queue by the sweep, for any worker to take (cold). docs/architecture.md §4 has the delivery table.
HERMES_WARM_IDLE_SECONDS = env_float("HERMES_WARM_IDLE_SECONDS", 120.0)
# Kept threads are bounded by the host's memory: HERMES_WARM_MEMORY_BUDGET_MB of private memory (USS, with children)
# of the kept app-servers of every worker process on the host (hermes_sessions/worker/warm/memory_budget.py; 0: no
# budget), least recently used closed first; HERMES_WARM_MAX_THREADS per worker process is the safety cap.
HERMES_WARM_MEMORY_BUDGET_MB = env_int("HERMES_WARM_MEMORY_BUDGET_MB", 1024)
HERMES_WARM_MAX_THREADS = env_int("HERMES_WARM_MAX_THREADS", 32)  # kept app-servers per worker process (LRU)
HERMES_WARM_MAX_TURNS = env_int("HERMES_WARM_MAX_TURNS", 200)  # turns one kept app-server runs before it is recycled
HERMES_WARM_MAX_PRIVATE_MB = env_int("HERMES_WARM_MAX_PRIVATE_MB", 256)  # a kept app-server above this private size is closed
HERMES_AFFINITY_DEADLINE = env_float("HERMES_AFFINITY_DEADLINE", 2.0)
# Turns one worker process with a route (the one pool process of a -c 1 worker) runs at once: its Celery
# delivery's and its woken ones together (hermes_sessions/worker/wake.py, TurnSlots). A woken turn waits at most
# HERMES_AFFINITY_DEADLINE for one of these permits; each running turn holds a runner thread with a database
# connection of its own (docs/operating.md, "PostgreSQL connections"). 1: one turn at a time.
HERMES_WORKER_TURNS = env_int("HERMES_WORKER_TURNS", 8, minimum=1)  # 0 would take no turn at all: refused at start
# A woken worker sends turn/start to the session's kept thread while it claims the turn, instead of after the
# claim (the wake carries the input; the app-server is killed if the claim fails); 0: claim first
# (hermes_sessions/worker/warm/early_start.py).
HERMES_EARLY_START = env_bool("HERMES_EARLY_START", True)
HERMES_WORKER_HEARTBEAT_SECONDS = env_float("HERMES_WORKER_HEARTBEAT_SECONDS", 2.0)  # a warm worker's heartbeat row
HERMES_WORKER_STALE_SECONDS = env_float("HERMES_WORKER_STALE_SECONDS", 10.0)  # older: not routed to; swept

# --- Durability (see hermes_sessions/worker/recovery.py) --------------------------------------
# A turn's POST waits at most this long (ms) for its session's row lock — held by another writer of the session,
# e.g. manage.py prune_sessions on a long session or a delete — then answers 503 session_locked (Retry-After):
# without it, POSTs piling up behind a long-held lock each would hold a pooled connection until the pool's
# 10 s timeout.
HERMES_POST_LOCK_TIMEOUT_MS = env_int("HERMES_POST_LOCK_TIMEOUT_MS", 3000)
# A worker's transaction left idle this long is ended by PostgreSQL (project/celery.py): a frozen worker must
# not hold a session's row locks. Well above any gap inside our transactions (milliseconds), below the lease.
HERMES_WORKER_IDLE_IN_TRANSACTION_SECONDS = env_float("HERMES_WORKER_IDLE_IN_TRANSACTION_SECONDS", 10.0)
HERMES_LEASE_SECONDS = env_float("HERMES_LEASE_SECONDS", 30.0)  # a running turn's claim, renewed by its worker
HERMES_HEARTBEAT_SECONDS = env_float("HERMES_HEARTBEAT_SECONDS", 1.0)  # renewal and cancel-check interval
HERMES_MAX_ATTEMPTS = env_int("HERMES_MAX_ATTEMPTS", 3)  # claims of one turn before it fails
HERMES_REDISPATCH_SECONDS = env_float("HERMES_REDISPATCH_SECONDS", 60.0)  # dispatched this long ago, still queued at the head: again
# Backoff (seconds) for retryable codex failures before turn/start (active writer, transport blip).
HERMES_RETRY_DELAYS = tuple(float(x) for x in env_list("HERMES_RETRY_DELAYS", "0.5,1,2,4,8"))
HERMES_RETRY_DEADLINE = env_float("HERMES_RETRY_DEADLINE", 60.0)  # seconds per claim; see worker/retry_policy.py
HERMES_IDEMPOTENCY_TTL = env_int("HERMES_IDEMPOTENCY_TTL", 24 * 3600)  # seconds an Idempotency-Key is kept

# Metrics (GET /metrics, hermes_sessions/metrics/): each process writes what it counted to PostgreSQL every
# HERMES_METRICS_REPORT_SECONDS (MetricReport); any API process serves the sum. A report older than three
# intervals no longer counts for gauges; one older than HERMES_METRICS_RETIRE_SECONDS is folded into the
# deployment's retired total. /metrics answers staff (token or admin session) and clients whose address is
# in HERMES_METRICS_ALLOW (comma-separated networks, e.g. 127.0.0.1/32; empty: staff only).
HERMES_METRICS_REPORT_SECONDS = env_float("HERMES_METRICS_REPORT_SECONDS", 5.0)
HERMES_METRICS_RETIRE_SECONDS = env_float("HERMES_METRICS_RETIRE_SECONDS", 3600.0)
HERMES_METRICS_ALLOW = env_list("HERMES_METRICS_ALLOW", "")
for _network in HERMES_METRICS_ALLOW:
    try:
        ipaddress.ip_network(_network, strict=False)
    except ValueError as _exc:
        raise ImproperlyConfigured(f"HERMES_METRICS_ALLOW: {_network!r} is not a network ({_exc}); "
                                   "give addresses or networks such as 127.0.0.1/32,10.0.0.0/8") from None

HERMES_LOG_LEVEL = env_str("HERMES_LOG_LEVEL", "INFO")  # the hermes_sessions loggers
# text: lines for a person; json: one JSON object per line from every logger of every process
# (project/log_format.py; gunicorn.conf.py and project/celery.py follow it).
HERMES_LOG_FORMAT = env_str("HERMES_LOG_FORMAT", "text")
if HERMES_LOG_FORMAT not in LOG_FORMATS:
    raise ImproperlyConfigured(f"HERMES_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, not {HERMES_LOG_FORMAT!r}")
# hermes_sessions.turns: one INFO line per turn end (services/turn_log.py). Celery's routine lines about
# the sweep task are dropped (project/logfilters.py): the sweep logs a line only when it acts.
LOGGING = logging_config(HERMES_LOG_FORMAT, HERMES_LOG_LEVEL)
