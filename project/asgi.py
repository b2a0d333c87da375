"""ASGI entry point (``make run``: gunicorn with uvicorn workers)."""
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup(set_prefix=False)

from project.asgi_handler import HermesASGIHandler  # noqa: E402 — needs the app registry

application = HermesASGIHandler()
