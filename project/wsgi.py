"""WSGI entry point (``gunicorn project.wsgi``)."""
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
application = get_wsgi_application()

from hermes_sessions.services.fallback_copies import flush_on_sigterm  # noqa: E402 — needs the app registry

flush_on_sigterm()  # a woken turn's held fallback copy goes on SIGTERM too (services/fallback_copies.py)
