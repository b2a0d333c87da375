"""gunicorn settings read from the working directory by every gunicorn this project starts (``make run``,
the systemd unit's ``WorkingDirectory``, the tests' and benchmarks' servers).

No control socket: gunicorn 27 opens ``~/.gunicorn/gunicorn.ctl`` by default — one path per user, so a
second gunicorn (another checkout, a test server, a benchmark) takes it over and deletes it when it
exits. Nothing here uses it.

``HERMES_LOG_FORMAT=json``: gunicorn's and uvicorn's lines as JSON objects, as Django's
(``project/log_format.py``)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the checkout: project.log_format

from project.log_format import gunicorn_logconfig_dict  # noqa: E402

control_socket_disable = True
logconfig_dict = gunicorn_logconfig_dict(os.environ.get("HERMES_LOG_FORMAT", "text"))
