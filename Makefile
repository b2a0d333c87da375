# hermes_sessions — `make demo` and `make test` set everything up on a fresh machine (python3 + npm).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The test suite's PostgreSQL and Redis (a broker). Override on the command line if yours differ.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/hermes
TEST_BROKER_URL ?= redis://127.0.0.1:6379/15
# A queue of its own per run, so two test runs on one broker never take each other's turns.
TEST_TURN_QUEUE ?= turns-test-$(shell date +%s%N)
# DATABASE_URL set means the production shape, where settings refuse to start without a secret key;
# the test-only processes (faults, bench) get this one. pytest uses project/settings_test.py's.
TEST_SECRET_KEY ?= django-insecure-hermes-sessions-test-suite-only

.PHONY: install demo demo-admin test e2e bench bench-warm bench-approvals bench-admin bench-streams faults stand-in lint services chromium pgbouncer migrate run worker clean codex-bump

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund
	touch $@

install: $(VENV)/.installed node_modules/.installed

migrate: install
	$(PY) manage.py migrate --noinput

# The seed scenario on the embedded defaults: a private PostgreSQL under var/postgres that the first
# connection starts and the last process using it stops (project/embedded_postgres), no broker (tasks run
# in-process), the local model stand-in, the real pinned codex binary. Never DATABASE_URL's database.
demo: install
	env -u DATABASE_URL -u CELERY_BROKER_URL $(PY) manage.py migrate --noinput
	env -u DATABASE_URL -u CELERY_BROKER_URL $(PY) manage.py demo

# The admin on the demo's database (the embedded PostgreSQL under HERMES_VAR_DIR), even when DATABASE_URL or
# CELERY_BROKER_URL is exported for the production shape: user demo, password demo (HTTP_BIND=… to move it).
demo-admin: install
	@echo "the demo's admin: http://$(HTTP_BIND)/admin/ (user demo, password demo)"
	env -u DATABASE_URL -u CELERY_BROKER_URL $(PY) manage.py runserver --noreload $(HTTP_BIND)

# Starts PostgreSQL and Redis when they are installed but not running; stops with a message otherwise.
services:
	@scripts/ensure_services.sh "$(TEST_DATABASE_URL)" "$(TEST_BROKER_URL)"

# Debian's Chromium for the browser tests (tests/browser): installed with apt-get when missing.
chromium:
	@scripts/ensure_chromium.sh

# Debian's PgBouncer for the tests behind it in transaction mode (tests/e2e/test_pgbouncer.py, which starts a
# private one): installed with apt-get when missing; silent when present.
pgbouncer:
	@scripts/ensure_pgbouncer.sh

# ruff (ruff.toml: pycodestyle, pyflakes, isort, bugbear, Django, blind-except, complexity) over the
# whole tree; mypy (mypy.ini: django-stubs, DRF stubs, celery-types) over hermes_sessions/ and project/.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: install services chromium pgbouncer lint
	DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) CELERY_TASK_ALWAYS_EAGER=1 HERMES_TURN_QUEUE=$(TEST_TURN_QUEUE) \
		$(VENV)/bin/pytest $(PYTEST_ARGS)

e2e: install services pgbouncer
	DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) CELERY_TASK_ALWAYS_EAGER=1 HERMES_TURN_QUEUE=$(TEST_TURN_QUEUE) \
		$(VENV)/bin/pytest -m e2e $(PYTEST_ARGS)

# Fault injection against the real stack (kill -9 workers, duplicate deliveries, 50 concurrent
# posts, broker restarts); prints one row per scenario, exits 0 only if nothing was lost or doubled.
faults: install services
	DJANGO_SECRET_KEY=$(TEST_SECRET_KEY) DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) $(PY) -m devtools.faults $(FAULTS_ARGS)

# Move the codex pin (docs/operating.md "Moving the codex pin"): pin @openai/codex at VERSION in package.json and
# package-lock.json, then run the codex contract test (tests/codex, against the new binary's own schema)
# and the real-binary end-to-end tests. `make faults` comes after, by hand (~4 min).
codex-bump: $(VENV)/.installed services
	@test -n "$(VERSION)" || { echo "usage: make codex-bump VERSION=x.y.z"; exit 2; }
	npm install --save-exact --no-audit --no-fund @openai/codex@$(VERSION)
	touch node_modules/.installed
	node_modules/@openai/codex-linux-*/vendor/*/bin/codex --version
	DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) CELERY_TASK_ALWAYS_EAGER=1 HERMES_TURN_QUEUE=$(TEST_TURN_QUEUE) \
		$(VENV)/bin/pytest tests/codex -q $(PYTEST_ARGS)
	DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) CELERY_TASK_ALWAYS_EAGER=1 HERMES_TURN_QUEUE=$(TEST_TURN_QUEUE) \
		$(VENV)/bin/pytest -m e2e -q $(PYTEST_ARGS)
	@echo "codex $(VERSION): contract and end-to-end tests pass. Now run 'make faults'; if it passes too, commit"
	@echo "package.json and package-lock.json. If anything failed: git checkout package.json package-lock.json && npm ci."

bench: install services
	DJANGO_SECRET_KEY=$(TEST_SECRET_KEY) DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) $(PY) -m devtools.bench $(BENCH_ARGS)

# The warm path alone, quickly (~20 s): consecutive turns on the warm stack against the warm direct turn,
# with the phase and timings medians (devtools/bench_warm.py; BENCH_WARM_ARGS="--turns 60 --spy 20").
bench-warm: install services
	DJANGO_SECRET_KEY=$(TEST_SECRET_KEY) DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) $(PY) -m devtools.bench_warm $(BENCH_WARM_ARGS)

# Turns that wait for a person (~2-4 min): 20 approval turns waiting at once on two workers while 10 other
# sessions' turns run; what the waiting turns hold (worker slots, app-servers and their memory, threads,
# PostgreSQL connections), then every approval accepted (devtools/bench_approvals.py;
# BENCH_APPROVALS_ARGS="--concurrency 16 --waiting 20 --others 10"). Exits 1 if a turn failed or was lost.
bench-approvals: install services
	DJANGO_SECRET_KEY=$(TEST_SECRET_KEY) DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) $(PY) -m devtools.bench_approvals $(BENCH_APPROVALS_ARGS)

# Open event streams held by one ASGI worker while ordinary API requests are timed (docs/benchmarks.md).
bench-streams: install services
	DJANGO_SECRET_KEY=$(TEST_SECRET_KEY) DATABASE_URL=$(TEST_DATABASE_URL) $(PY) -m devtools.bench_streams $(BENCH_STREAMS_ARGS)

# The admin and the transcript API at a million messages (docs/benchmarks.md): seeds its own scratch
# database beside TEST_DATABASE_URL (dropped afterwards), times pages over HTTP on gunicorn; exits 1 if a
# median misses its target. ~3 min.
bench-admin: install services
	DJANGO_SECRET_KEY=$(TEST_SECRET_KEY) DATABASE_URL=$(TEST_DATABASE_URL) $(PY) -m devtools.bench_admin $(BENCH_ADMIN_ARGS)

# The offline model stand-in on its own, in the foreground (for `make run` / `make worker` without an API key).
# Its port and the workers' CODEX_STAND_IN_URL go together: STAND_IN_PORT=9000 ⇔ CODEX_STAND_IN_URL=http://127.0.0.1:9000/v1.
STAND_IN_PORT ?= 8765
stand-in: install
	$(PY) -m devtools.model_stand_in --port $(STAND_IN_PORT)

# Production-shaped local run (PostgreSQL + Redis): API server and a worker, in two terminals.
HTTP_BIND ?= 127.0.0.1:8000
# ASGI (uvicorn workers under gunicorn) so open event streams hold no sync worker; psycopg's pool with
# CONN_MAX_AGE = 0 (DATABASE_POOL). No --max-requests: recycling a worker would cut its open streams.
HTTP_WORKERS ?= 2
run: install
	DATABASE_POOL=$${DATABASE_POOL:-1} $(VENV)/bin/gunicorn project.asgi:application -k uvicorn_worker.UvicornWorker \
		--bind $(HTTP_BIND) --workers $(HTTP_WORKERS) --graceful-timeout 10
# -B embeds the beat scheduler (the sweep that recovers turns of dead workers); with several
# workers run one `celery -A project beat` instead. The worker consumes the turn queue, HERMES_TURN_QUEUE
# (from the environment or `make worker HERMES_TURN_QUEUE=…`; default "turns", as project/settings.py),
# and Celery's default queue "celery", where beat sends the sweep.
# One pool process (-c 1) so the worker keeps threads loaded between turns and gets its own route (session
# affinity, docs/architecture.md "Warm turns"). It runs HERMES_WORKER_TURNS turns at once of sessions whose
# threads it keeps, but takes one delivery at a time from the shared queue (new and cold turns): for more of
# those at once run more workers, each its WORKER_NAME.
WORKER_NAME ?= hermes@%h
WORKER_CONCURRENCY ?= 1
WORKER_BEAT ?= -B
worker: install
	$(VENV)/bin/celery -A project worker $(WORKER_BEAT) -Q $(or $(strip $(HERMES_TURN_QUEUE)),turns),celery -n '$(WORKER_NAME)' --concurrency $(WORKER_CONCURRENCY) --loglevel info

clean:
	rm -rf var .pytest_cache
