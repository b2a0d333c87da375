"""gunicorn settings read from the working directory by every gunicorn this project starts (``make run``,
the systemd unit's ``WorkingDirectory``, the tests' and benchmarks' servers).

No control socket: gunicorn 27 opens ``~/.gunicorn/gunicorn.ctl`` by default — one path per user, so a
second gunicorn (another checkout, a test server, a benchmark) takes it over and deletes it when it
exits. Nothing here uses it."""
control_socket_disable = True
