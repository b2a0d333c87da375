# hermes_sessions — `make demo` and `make test` set everything up on a fresh machine (python3 + npm).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The test suite's PostgreSQL and Redis (a broker). Override on the command line if yours differ.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/hermes
TEST_BROKER_URL ?= redis://127.0.0.1:6379/15
# A queue of its own per run, so two test runs on one broker never take each other's turns.
TEST_TURN_QUEUE ?= turns-test-$(shell date +%s%N)

.PHONY: install demo test e2e bench faults stand-in lint services migrate run worker clean

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

# The seed scenario on the embedded defaults: SQLite, no broker (tasks run in-process), the local
# model stand-in, the real pinned codex binary.
demo: install
	env -u DATABASE_URL -u CELERY_BROKER_URL $(PY) manage.py migrate --noinput
	env -u DATABASE_URL -u CELERY_BROKER_URL $(PY) manage.py demo

# Starts PostgreSQL and Redis when they are installed but not running; stops with a message otherwise.
services:
	@scripts/ensure_services.sh "$(TEST_DATABASE_URL)" "$(TEST_BROKER_URL)"

lint: install
	$(VENV)/bin/ruff check .

test: install services lint
	DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) CELERY_TASK_ALWAYS_EAGER=1 HERMES_TURN_QUEUE=$(TEST_TURN_QUEUE) \
		$(VENV)/bin/pytest $(PYTEST_ARGS)

e2e: install services
	DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) CELERY_TASK_ALWAYS_EAGER=1 HERMES_TURN_QUEUE=$(TEST_TURN_QUEUE) \
		$(VENV)/bin/pytest -m e2e $(PYTEST_ARGS)

# Fault injection against the real stack (kill -9 workers, duplicate deliveries, 50 concurrent
# posts, broker restarts); prints one row per scenario, exits 0 only if nothing was lost or doubled.
faults: install services
	DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) $(PY) -m devtools.faults $(FAULTS_ARGS)

bench: install services
	DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) $(PY) -m devtools.bench $(BENCH_ARGS)

# The offline model stand-in on its own, in the foreground (for `make run` / `make worker` without an API key).
STAND_IN_PORT ?= 8765
stand-in: install
	$(PY) -m devtools.model_stand_in --port $(STAND_IN_PORT)

# Production-shaped local run (PostgreSQL + Redis): API server and a worker, in two terminals.
HTTP_BIND ?= 127.0.0.1:8000
run: install
	$(VENV)/bin/gunicorn project.wsgi --bind $(HTTP_BIND) --workers 2
# -B embeds the beat scheduler (the sweep that recovers turns of dead workers); with several
# workers run one `celery -A project beat` instead.
worker: install
	$(VENV)/bin/celery -A project worker -B -Q turns,celery --concurrency 2 --loglevel info

clean:
	rm -rf var .pytest_cache
