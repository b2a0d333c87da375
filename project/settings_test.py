"""Settings for the test suite (pytest.ini's ``DJANGO_SETTINGS_MODULE``).

The suite runs in the production shape (``make test`` sets ``DATABASE_URL`` and ``CELERY_BROKER_URL``),
where ``project.settings`` refuses to start without ``DJANGO_SECRET_KEY``. The suite uses a fixed test key;
it is also put in the environment (unless one is set) *before* importing them, only so that import
passes that check. The Celery worker that ``tests/e2e`` starts inherits this environment, including
``DJANGO_SETTINGS_MODULE`` (set by pytest-django), so it runs on these settings too.
"""
from __future__ import annotations

import os

TEST_SECRET_KEY = "django-insecure-hermes-sessions-test-suite-only"
os.environ.setdefault("DJANGO_SECRET_KEY", TEST_SECRET_KEY)

from project.settings import *  # noqa: E402, F403
from project.settings import env_bool, env_float  # noqa: E402

SECRET_KEY = TEST_SECRET_KEY
DEBUG = False
# Hashing is not what the suite tests; the default (PBKDF2, ~1e6 iterations) costs ~0.3 s per user.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# Tasks run in the test process unless a test starts a real worker (tests/e2e). The worker process
# it starts sets CELERY_TASK_ALWAYS_EAGER=0 and must see it, so the environment still decides.
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", True)
# No process of the suite writes metric reports unless a test asks (tests/e2e/test_metrics.py starts its
# servers and workers with HERMES_METRICS_REPORT_SECONDS set): the test process's own counts stay in memory.
HERMES_METRICS_REPORT_SECONDS = env_float("HERMES_METRICS_REPORT_SECONDS", 0.0)
