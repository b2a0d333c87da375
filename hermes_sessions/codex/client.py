"""A JSON-RPC client for one ``codex app-server`` process over stdio.

Wire format (``docs/codex.md`` §1, observed on codex 0.169.0): one JSON object per line in both
directions, JSON-RPC 2.0 without the ``"jsonrpc"`` field. Requests ``{id, method, params}`` (``params`` is
required, even ``{}``), responses ``{id, result}`` / ``{id, error:{code, message, data?}}``, notifications
``{method, params, emittedAtMs}``. Codex also sends requests of its own (approvals): they carry ``id`` *and*
``method``, with ids from a separate sequence, and each must be answered.

Threads (``docs/contract.md`` §6, I4 "every wait ends"):

* ``stdout`` reader: frames lines (binary ``readline`` bounded by ``max_frame_bytes``), resolves responses by
  id, queues notifications, hands server requests to the dispatcher. On EOF, an oversized frame or a line that
  is not a JSON object it marks the connection failed, which fails every pending request *at once* and makes
  :meth:`AppServerClient.next_notification` raise once the queue is drained.
* ``stderr`` drain: keeps the last ``stderr_tail_lines`` lines of codex's log; the tail goes into every
  :class:`~.errors.TransportError`.
* process watcher: fails the connection if codex exits while something else keeps its stdout open.
* server-request dispatcher: runs ``server_request_handler`` off the reader thread, in arrival order, so a
  slow handler never delays responses or notifications.

Stdin writes go through a non-blocking pipe under a lock, with the request deadline, so a codex that stops
reading cannot hang the caller. The process runs in its own session / process group; :meth:`close` closes
stdin (codex exits in ~32 ms), then SIGKILLs the group and reaps the leader. The leader is reaped only in
:meth:`close` (liveness is checked with ``waitid(WNOWAIT)``), so its pid keeps naming our group until the
group kill is done and ``killpg`` can never hit a recycled process group.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import re
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from .errors import METHOD_NOT_FOUND, CodexError, RequestTimeout, TransportError, error_from_response

logger = logging.getLogger(__name__)

ServerRequestHandler = Callable[[str, dict], dict]

_STDERR_LINE_MAX_CHARS = 1000  # one huge log line must not swamp the error message
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_STDOUT_JUNK_PREVIEW_CHARS = 300


def _pipe(stream: IO[bytes] | None) -> IO[bytes]:
    """One of the process's pipes (always set: ``start`` asks for all three)."""
    if stream is None:  # pragma: no cover - Popen(stdin=PIPE, stdout=PIPE, stderr=PIPE)
        raise TransportError("codex app-server pipe missing")
    return stream


class AppServerClient:
    """One ``codex app-server`` process and the JSON-RPC conversation with it.

    Meant for one calling thread (plus the client's own reader threads). Typical use::

        with AppServerClient([codex, "app-server"], env=env, cwd=cwd) as client:
            client.start()
            thread = client.request("thread/start", {"cwd": cwd})["thread"]
            client.request("turn/start", {"threadId": thread["id"], "input": [...]})
            while (note := client.next_notification(timeout=1.0)) is None or note["method"] != "turn/completed":
                ...
    """

    def __init__(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        request_timeout: float = 30.0,
        max_frame_bytes: int = 64 * 1024 * 1024,
        server_request_handler: ServerRequestHandler | None = None,
        client_name: str = "hermes_sessions",
        client_version: str = "0.1.0",
        stderr_tail_lines: int = 40,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        # ``preexec_fn`` runs in the child before exec (spares: ``warm.die_with_parent``).
        self._preexec_fn = preexec_fn
        self._argv = list(argv)
        self._env = dict(env)
        self._cwd = cwd
        self._request_timeout = request_timeout
        self._max_frame_bytes = max_frame_bytes
        self._server_request_handler = server_request_handler
        self._client_name = client_name
        self._client_version = client_version

        self._proc: subprocess.Popen[bytes] | None = None
        self._cv = threading.Condition()  # guards everything below up to _closed
        self._next_id = 1
        self._pending: dict[int, dict | None] = {}  # request id -> response message (None while waiting)
        self._notifications: collections.deque[dict] = collections.deque()
        self._failure: TransportError | None = None  # set once; the connection is unusable from then on
        self._sent_methods: list[str] = []
        self._closed = False

        self._write_lock = threading.Lock()
        self._reap_lock = threading.Lock()  # orders the group kill before the leader's reaping
        self._stderr_lock = threading.Lock()
        self._stderr_lines: collections.deque[str] = collections.deque(maxlen=max(1, stderr_tail_lines))
        self._server_requests: queue.Queue[dict | None] = queue.Queue()
        self._stdout_thread: threading.Thread | None = None
        self._stderr_thread: threading.Thread | None = None
        self._dispatch_thread: threading.Thread | None = None
        self._watch_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> dict:
        """Spawn the process and do the handshake; return the ``initialize`` result.

        Result shape (0.169.0): ``{"userAgent", "codexHome", "platformFamily", "platformOs"}``.
        Raises :class:`CodexError` if the process cannot be spawned (bad binary or cwd: retrying will not
        help), :class:`TransportError` / :class:`JsonRpcError` if the handshake fails; the process is gone
        by then.
        """
        return self.finish_start(self.launch())

    def spawn(self) -> None:
        """Spawn the process (a fork + exec: a few ms), nothing more; ``launch`` goes on from there. For a
        spare started in short steps on the worker's scheduler thread (``worker/scheduler.py``). Raises
        :class:`CodexError` if the process cannot be spawned."""
        if self._proc is not None or self._closed:
            raise CodexError("AppServerClient.start() may be called once")
        try:
            self._proc = subprocess.Popen(
                self._argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env,
                cwd=self._cwd,
                start_new_session=True,  # own process group: close() can kill codex and its children
                close_fds=True,
                preexec_fn=self._preexec_fn,
            )
        except OSError as exc:
            self._closed = True
            raise CodexError(f"could not start codex app-server {self._argv!r} in {self._cwd!r}: {exc}") from exc
        os.set_blocking(_pipe(self._proc.stdin).fileno(), False)

    def launch(self) -> PendingRequest:
        """Spawn the process (unless ``spawn`` did), start the reader threads and send ``initialize``
        without waiting for its answer, which the stdout reader takes in; ``finish_start`` completes the
        handshake once ``PendingRequest.answered``. For a spare started on the worker's scheduler thread,
        whose jobs must not block (``worker/scheduler.py``). Raises as ``start`` does."""
        if self._proc is None:
            self.spawn()
        if self._stdout_thread is not None:
            raise CodexError("AppServerClient.start() may be called once")
        self._stdout_thread = self._spawn_thread(self._read_stdout, "stdout")
        self._stderr_thread = self._spawn_thread(self._drain_stderr, "stderr")
        self._dispatch_thread = self._spawn_thread(self._dispatch_server_requests, "server-requests")
        self._watch_thread = self._spawn_thread(self._watch_process, "watch")
        try:
            return self.send_request(
                "initialize",
                {
                    "clientInfo": {
                        "name": self._client_name,
                        "title": self._client_name,
                        "version": self._client_version,
                    }
                },
            )
        except BaseException:
            self.close()
            raise

    def finish_start(self, initialize: PendingRequest) -> dict:
        """Read ``initialize``'s answer (``launch``'s; waits for it unless ``answered``), send
        ``initialized`` and return the result; on any error the process is closed and the error raised."""
        try:
            result = initialize.result()
            self.notify("initialized")
        except BaseException:
            self.close()
            raise
        return result

    def close(self, timeout: float = 2.0) -> None:
        """Stop the process and every client thread. Idempotent; safe to call from a failed start.

        Closes stdin (codex 0.169 exits ~32 ms later), waits up to ``timeout`` seconds, SIGKILLs the
        process group (codex and anything it spawned), reaps the leader and joins the threads. Pending
        requests fail with :class:`TransportError`.
        """
        with self._cv:
            if self._closed and self._proc is None:
                return
            already = self._closed
            self._closed = True
            if self._failure is None:
                self._failure = TransportError("the codex app-server client was closed")
            self._cv.notify_all()
        proc = self._proc
        if already or proc is None:
            return
        # A writer stuck on a full pipe holds the lock; then skip the polite close, the kill unblocks it.
        self._close_stdin(lock_timeout=0.2)
        self._wait_leader_exit(timeout)
        self._kill_group()
        with self._reap_lock:
            try:
                proc.wait(timeout=10)  # reaps the leader; only now may its pid (our pgid) be reused
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                logger.error("codex app-server pid %s survived SIGKILL", proc.pid)
        self._close_stdin(lock_timeout=timeout)  # if a stuck writer kept it open, it got EPIPE by now
        self._server_requests.put(None)
        for thread, stream in (
            (self._stdout_thread, proc.stdout),
            (self._stderr_thread, proc.stderr),
            (self._dispatch_thread, None),
            (self._watch_thread, None),
        ):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
            if thread is not None and thread.is_alive():
                # Something outside our process group still holds the pipe open. Closing a buffered stream
                # would block on the reader's lock, so leave it to the daemon thread.
                logger.warning("codex app-server pid %s: %s still running after close()", proc.pid, thread.name)
            elif stream is not None:
                try:
                    stream.close()
                except (OSError, ValueError):
                    pass

    def kill(self) -> None:
        """SIGKILL the process group at once, then ``close``: for an app-server that must not go on with
        what it was sent (an early ``turn/start`` whose claim failed, ``worker/warm/early_start.py``). Closing
        stdin first would leave codex ~32 ms to act on it."""
        if self._proc is not None:
            self._kill_group()
        self.close(timeout=1.0)

    def kill_nowait(self) -> None:
        """SIGKILL the process group and return at once; ``close`` (later, off the caller's path) reaps it
        and joins the reader threads. For a spare retired on the worker's scheduler thread, whose jobs must
        not block (``worker/scheduler.py``). Pending requests fail as the stdout reader sees EOF."""
        self._kill_group()

    def pause(self) -> bool:
        """SIGSTOP the app-server process (all its threads stop where they are); ``resume`` goes on. For an
        early ``turn/start`` whose claim is late (``worker/warm/early_start.py``): codex must not reach the model
        before the claim holds — its own threads are what ask the model and start commands. Not the group:
        a sandbox helper codex is starting then (``bwrap … --die-with-parent``) could be stopped before it
        registered to die with its parent, and a worker killed meanwhile would leave it stopped for ever
        under init (``tests/e2e/test_early_start_kill.py``). Returns whether a running process was signalled."""
        return self._signal(signal.SIGSTOP, group=False)

    def resume(self) -> bool:
        """SIGCONT the process group after ``pause`` (the group: whatever was stopped in it goes on). Returns
        whether a running process was signalled."""
        return self._signal(signal.SIGCONT, group=True)

    def _signal(self, sig: int, *, group: bool) -> bool:
        proc = self._proc
        with self._reap_lock:  # never after the leader was reaped: its pid (our pgid) could be reused
            if proc is None or proc.returncode is not None:
                return False
            try:
                (os.killpg if group else os.kill)(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return False
        return True

    def __enter__(self) -> AppServerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ JSON-RPC

    def request(self, method: str, params: dict | None = None, *, timeout: float | None = None) -> dict:
        """Send ``method`` and wait for its response; return ``result``.

        ``params`` defaults to ``{}`` (codex 0.169 rejects a request without ``params``). ``timeout`` (seconds)
        defaults to ``request_timeout``. Raises the :class:`~.errors.JsonRpcError` subclass that
        :func:`~.errors.error_from_response` picks for an error response (``ThreadGone``, ``ThreadBusy``, …),
        :class:`RequestTimeout` past the deadline (the process is left running: the caller decides), and
        :class:`TransportError` as soon as the process is gone or the stream is broken.
        """
        return self.send_request(method, params, timeout=timeout).result()

    def send_request(self, method: str, params: dict | None = None, *, timeout: float | None = None) -> PendingRequest:
        """Send ``method`` without waiting for its answer; ``PendingRequest.result()`` waits for it (until
        ``timeout`` seconds, default ``request_timeout``, from now) and raises as ``request`` does. For work
        done while codex handles the request (the woken turn's claim beside its ``turn/start``,
        ``worker/warm/early_start.py``). Raises ``TransportError`` / ``RequestTimeout`` if it cannot be sent."""
        timeout = self._request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cv:
            self._raise_if_unusable(method, sent=False)
            request_id = self._next_id
            self._next_id += 1
            self._pending[request_id] = None  # registered before sending: a fast answer is not lost
        try:
            self._send(
                {"id": request_id, "method": method, "params": {} if params is None else params},
                deadline=deadline,
                what=method,
                timeout=timeout,
            )
        except BaseException:
            with self._cv:
                self._pending.pop(request_id, None)
            raise
        with self._cv:
            self._sent_methods.append(method)
        return PendingRequest(self, request_id, method, deadline, timeout)

    def _await(self, request_id: int, method: str, deadline: float, timeout: float) -> dict:
        """``PendingRequest.result``: wait for ``request_id``'s answer until ``deadline`` (monotonic)."""
        with self._cv:
            while True:
                response = self._pending.get(request_id)
                if response is not None:
                    del self._pending[request_id]
                    break
                if request_id not in self._pending:  # answered and taken already, or given up on
                    raise CodexError(f"the answer to {method!r} (id {request_id}) was already read")
                if self._failure is not None:
                    del self._pending[request_id]
                    self._raise_if_unusable(method)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    del self._pending[request_id]  # a late answer is then ignored as an unknown id
                    raise RequestTimeout(method, timeout, stderr_tail=self.stderr_tail())
                self._cv.wait(remaining)
        if "error" in response:
            raise error_from_response(method, response["error"])
        result = response.get("result")
        return {} if result is None else result

    def notify(self, method: str, params: dict | None = None) -> None:
        """Send a notification (no answer). ``params`` is left out when None, as codex's own clients do."""
        with self._cv:
            self._raise_if_unusable(method)
        message: dict[str, Any] = {"method": method}
        if params is not None:
            message["params"] = params
        self._send(message, deadline=time.monotonic() + self._request_timeout, what=method)

    def next_notification(self, timeout: float) -> dict | None:
        """Return the next server notification (``{"method", "params", "emittedAtMs"}``) in arrival order.

        Returns None if none arrived within ``timeout`` seconds. Raises :class:`TransportError` once the
        connection has failed (process exit, stdout EOF, bad frame, close) *and* the queue is drained, so a
        caller looping on this never waits forever.
        """
        deadline = time.monotonic() + timeout
        with self._cv:
            if self._proc is None and not self._notifications:
                raise TransportError("the codex app-server client was not started")
            while True:
                if self._notifications:
                    return self._notifications.popleft()
                if self._failure is not None:
                    raise TransportError(
                        f"no more notifications: {self._failure.reason}", stderr_tail=self._failure.stderr_tail
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cv.wait(remaining)

    # ------------------------------------------------------------------ introspection

    @property
    def sent_methods(self) -> list[str]:
        """Every request method sent, in order, ``initialize`` included (a copy)."""
        with self._cv:
            return list(self._sent_methods)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        """True while the app-server process is running (does not reap it)."""
        return self._proc is not None and self._proc.returncode is None and self._leader_status() is None

    def stderr_tail(self) -> str:
        """The last ``stderr_tail_lines`` lines of codex's stderr (plus any rejected stdout line), joined."""
        with self._stderr_lock:
            return "\n".join(self._stderr_lines)

    # ------------------------------------------------------------------ internals: writing

    def _started(self) -> subprocess.Popen[bytes]:
        """The process; only called once ``start`` has spawned it."""
        if self._proc is None:
            raise TransportError("the codex app-server client was not started")
        return self._proc

    def _raise_if_unusable(self, method: str, *, sent: bool = True) -> None:
        # Caller holds self._cv. ``sent``: whether ``method`` was written already (``TransportError.sent``).
        if self._proc is None:
            raise TransportError(f"cannot send {method!r}: the codex app-server client was not started", sent=False)
        if self._failure is not None:
            raise TransportError(f"{method!r} failed: {self._failure.reason}", stderr_tail=self._failure.stderr_tail,
                                 sent=sent)

    def _send(self, message: dict, *, deadline: float, what: str, timeout: float | None = None) -> None:
        """Write one frame before ``deadline``. A frame half-written at the deadline poisons the stream, so
        that case fails the connection (and kills the process) besides raising."""
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode("utf-8")
        with self._write_lock:
            proc = self._started()
            view = memoryview(data)
            try:
                fd = _pipe(proc.stdin).fileno()
                poller = select.poll()
                poller.register(fd, select.POLLOUT)
                while view:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    if not poller.poll(remaining * 1000):
                        continue
                    try:
                        written = os.write(fd, view)
                    except BlockingIOError:
                        continue
                    view = view[written:]
            except (OSError, ValueError) as exc:  # BrokenPipeError, or stdin already closed by close()
                raise TransportError(
                    f"could not write {what!r} to codex app-server (pid {proc.pid}): {exc}",
                    stderr_tail=self.stderr_tail(), sent=len(view) < len(data),
                ) from exc
        if view:
            wait = timeout if timeout is not None else self._request_timeout
            if len(view) < len(data):
                self._fail(f"stopped reading stdin mid-frame while {what!r} was sent", kill=True)
            raise RequestTimeout(what, wait, stderr_tail=self.stderr_tail())

    # ------------------------------------------------------------------ internals: reading

    def _close_stdin(self, *, lock_timeout: float) -> None:
        if not self._write_lock.acquire(timeout=lock_timeout):
            return
        try:
            _pipe(self._started().stdin).close()
        except OSError:
            pass
        finally:
            self._write_lock.release()

    def _spawn_thread(self, target: Callable[[], None], role: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=f"codex-app-server-{self._started().pid}-{role}", daemon=True)
        thread.start()
        return thread

    def _read_stdout(self) -> None:
        stdout = _pipe(self._started().stdout)
        limit = self._max_frame_bytes
        while True:
            try:
                line = stdout.readline(limit + 1)
            except (OSError, ValueError):  # pipe closed under us by close()
                line = b""
            if not line:
                self._fail("closed its stdout (EOF)")
                return
            if len(line) > limit and not line.endswith(b"\n"):
                self._fail(f"sent a frame too large (over {limit} bytes); killed it", kill=True)
                return
            line = line.strip()
            if not line:
                continue
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if not isinstance(message, dict):
                # codex writes only JSON objects to stdout (its logs go to stderr). Anything else means the
                # stream is corrupt or something else writes to it; no later frame can be trusted, so fail
                # closed: kill the process and fail the pending requests and the turn (retryable).
                preview = line[:_STDOUT_JUNK_PREVIEW_CHARS].decode("utf-8", "replace")
                self._remember_stderr(f"[stdout, not a JSON object] {preview}")
                self._fail(f"wrote a line to stdout that is not a JSON object: {preview!r}; killed it", kill=True)
                return
            self._dispatch(message)

    def _dispatch(self, message: dict) -> None:
        if "id" in message and "method" in message:
            self._server_requests.put(message)
        elif "id" in message:
            with self._cv:
                request_id = message["id"]
                if isinstance(request_id, int) and self._pending.get(request_id, False) is None:
                    self._pending[request_id] = message
                    self._cv.notify_all()
                else:
                    logger.debug("ignoring codex response to unknown or expired id %r", request_id)
        elif "method" in message:
            with self._cv:
                self._notifications.append(message)
                self._cv.notify_all()
        else:
            logger.warning("ignoring codex message with neither id nor method: %.200r", message)

    def _drain_stderr(self) -> None:
        stderr = _pipe(self._started().stderr)
        while True:
            try:
                chunk = stderr.readline(8192)
            except (OSError, ValueError):
                return
            if not chunk:
                return
            self._remember_stderr(chunk.decode("utf-8", "replace").rstrip("\r\n"))

    def _remember_stderr(self, text: str) -> None:
        text = _ANSI_ESCAPE.sub("", text)  # codex colours its log lines; the tail ends up in error texts
        if len(text) > _STDERR_LINE_MAX_CHARS:
            text = text[:_STDERR_LINE_MAX_CHARS] + "…"
        with self._stderr_lock:
            self._stderr_lines.append(text)

    def _dispatch_server_requests(self) -> None:
        while (message := self._server_requests.get()) is not None:
            self._answer_server_request(message)

    def _answer_server_request(self, message: dict) -> None:
        """Answer one codex request. Every request gets an answer, or codex waits forever (approvals leave
        the thread ``waitingOnApproval``)."""
        method = str(message.get("method"))
        params = message.get("params")
        params = params if isinstance(params, dict) else {}
        answer: dict[str, Any]
        try:
            if self._server_request_handler is None:
                raise LookupError("no server_request_handler configured")
            result = self._server_request_handler(method, params)
            if not isinstance(result, dict):
                raise TypeError(f"handler returned {type(result).__name__}, not dict")
            answer = {"id": message["id"], "result": result}
        except Exception as exc:  # noqa: BLE001 — the handler is pluggable; whatever it raises, codex gets an answer (I4)
            logger.info("answering codex %s with an error: %s", method, exc)
            answer = {
                "id": message["id"],
                "error": {"code": METHOD_NOT_FOUND, "message": f"hermes_sessions does not handle {method}"},
            }
        try:
            self._send(answer, deadline=time.monotonic() + self._request_timeout, what=f"answer to {method}")
        except TransportError as exc:
            logger.info("could not answer codex %s: %s", method, exc.reason)

    # ------------------------------------------------------------------ internals: failure and processes

    def _fail(self, reason: str, *, kill: bool = False) -> None:
        """Mark the connection failed (first reason wins) and wake every waiter."""
        if kill:
            self._kill_group()
        # Let codex finish dying and its last stderr lines arrive: they usually say why.
        self._wait_leader_exit(0.5)
        if self._stderr_thread is not None and self._stderr_thread is not threading.current_thread():
            self._stderr_thread.join(0.5)
        status = self._leader_status()
        pid = self._started().pid
        if status is None:
            where = f"codex app-server (pid {pid})"
        elif status[0] == "exit":
            where = f"codex app-server (pid {pid}, exit code {status[1]})"
        else:
            where = f"codex app-server (pid {pid}, killed by signal {status[1]})"
        error = TransportError(f"{where} {reason}", stderr_tail=self.stderr_tail())
        with self._cv:
            if self._failure is None:
                self._failure = error
            self._cv.notify_all()

    def _watch_process(self) -> None:
        # stdout EOF normally reports a death. If codex dies while a process it started in another session
        # still holds the pipe, there is no EOF: fail the connection from here so no wait outlives codex.
        try:
            os.waitid(os.P_PID, self._started().pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # already reaped by close()
            return
        reader = self._stdout_thread
        if reader is None:  # pragma: no cover - started before this thread
            return
        reader.join(1.0)
        if reader.is_alive():
            self._fail("exited, but a process it started still holds its stdout open")

    def _leader_status(self) -> tuple[str, int] | None:
        """``("exit", code)`` / ``("signal", n)`` once the leader has exited, else None. Does not reap."""
        proc = self._started()
        if proc.returncode is not None:
            rc = proc.returncode
            return ("exit", rc) if rc >= 0 else ("signal", -rc)
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere (should not happen)
            return ("exit", -1)
        if info is None or info.si_pid == 0:
            return None
        if info.si_code == os.CLD_EXITED:
            return ("exit", info.si_status)
        return ("signal", info.si_status)

    def _wait_leader_exit(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._leader_status() is None and time.monotonic() < deadline:
            time.sleep(0.005)

    def _kill_group(self) -> None:
        # The leader is never reaped before this (see module docstring), so pgid == our pid is still ours.
        proc = self._proc
        with self._reap_lock:
            if proc is None or proc.returncode is not None:
                return
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class PendingRequest:
    """A request ``AppServerClient.send_request`` sent; ``result()`` waits for its answer once."""

    def __init__(self, client: AppServerClient, request_id: int, method: str, deadline: float, timeout: float) -> None:
        self.method, self.request_id = method, request_id
        self._client, self._deadline, self._timeout = client, deadline, timeout

    def result(self) -> dict:
        """The answer's ``result``; raises as ``AppServerClient.request`` does (``RequestTimeout`` at the
        deadline set when it was sent, moved on by ``extend``)."""
        return self._client._await(self.request_id, self.method, self._deadline, self._timeout)

    def answered(self) -> bool:
        """Whether ``result()`` would return (or raise) without waiting: the answer is in, the process is
        gone or the deadline passed."""
        client = self._client
        with client._cv:
            return (client._pending.get(self.request_id) is not None or self.request_id not in client._pending
                    or client._failure is not None or time.monotonic() >= self._deadline)

    def extend(self, seconds: float) -> None:
        """Move the deadline ``seconds`` later: for time codex could not answer in because it was stopped
        (``AppServerClient.pause``; an early ``turn/start`` whose claim held late must not then time out)."""
        self._deadline += max(seconds, 0.0)
