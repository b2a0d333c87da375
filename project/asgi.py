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

# A woken turn's fallback copy waits in this process until due; gunicorn's graceful stop of a uvicorn worker
# ends with SIGTERM's default action, which skips atexit: send them on SIGTERM (services/fallback_copies.py).
from hermes_sessions.services.fallback_copies import flush_on_sigterm  # noqa: E402

flush_on_sigterm()
