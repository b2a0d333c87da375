"""ASGI entry point (``make run``: gunicorn with uvicorn workers)."""
import os
import warnings

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup(set_prefix=False)

from project.asgi_handler import HermesASGIHandler  # noqa: E402 — needs the app registry

# WhiteNoise 6 answers a static file (the admin's CSS) with a synchronous file iterator, which Django's ASGI
# handler reads through a thread, warning once per process; harmless for files this small, and our own
# streams (the SSE views) iterate asynchronously.
warnings.filterwarnings("ignore", message="StreamingHttpResponse must consume synchronous iterators", category=Warning)

application = HermesASGIHandler()
