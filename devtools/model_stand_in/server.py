"""Offline stand-in for the OpenAI Responses API, used by the demo and the tests.

The real ``codex app-server`` (codex 0.169.0) is pointed at this server through
``[model_providers.<name>] base_url = "http://127.0.0.1:<port>/v1"`` with
``wire_api = "responses"`` (``docs/codex.md`` §8, codex 0.169.0). Codex then POSTs every model
call to ``{base_url}/responses`` with ``stream: true`` and reads a server-sent-event reply.

Stdlib only (``http.server``), no Django import, so it can run in-process inside a test
(:class:`ModelStandIn`) or on its own as ``python -m devtools.model_stand_in`` (:mod:`.cli`).
It binds loopback addresses only. A development tool: the app package ``hermes_sessions`` does not
ship it.
"""
from __future__ import annotations

import gzip
import ipaddress
import json
import re
import socket
import threading
import time
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

__all__ = ["CURRENT_TURN_MARKER", "ModelStandIn", "last_user_text", "message_texts", "steering_text"]

#: Shell tools codex may offer, in order of preference, with how to build their arguments.
#: codex 0.169.0 offers ``exec_command`` (arguments ``{"cmd": "..."}``); the others are fallbacks
#: for older or differently configured builds.
_SHELL_TOOLS = ("exec_command", "shell_command", "shell", "local_shell")

_TEXT_PART_TYPES = ("input_text", "output_text", "text")

_CHUNK_CHARS = 8          # characters per response.output_text.delta in normal replies
_SLOW_MIN_CHUNKS = 20     # SLOW replies are cut into at least this many deltas
_TOOL_OUTPUT_CHARS = 200  # "tool said: <output[:200]>"

#: The marker ahead of the current user's text in a rotated thread's first input: the history seed
#: (earlier turns) comes before it (``hermes_sessions.history_seed.CURRENT_TURN_MARKER``; repeated
#: here because the stand-in imports no Django, and a test checks the two agree).
CURRENT_TURN_MARKER = "[CURRENT USER TURN]"

#: ``FAIL<status>`` in the current user turn: answer the model call with that HTTP status.
_FAIL_STATUS = re.compile(r"FAIL([1-5][0-9][0-9])")
_SLOW_FOR = re.compile(r"SLOW([0-9]+(?:\.[0-9]+)?)")  # SLOW<seconds>: this reply takes that long
#: What an OpenAI-like provider says with each status (``error.type`` / ``code``); others: server_error.
_FAIL_BODIES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_denied", None),
    404: ("not_found", "model_not_found"),
    429: ("rate_limit_exceeded", "rate_limit_exceeded"),
}


# --------------------------------------------------------------------------- request parsing
def _content_text(content: Any) -> str:
    """Concatenated text of a Responses ``content`` value (a string or a list of parts)."""
    if isinstance(content, str):
        return content
    out = []
    for part in content or []:
        if isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES:
            text = part.get("text")
            if isinstance(text, str):
                out.append(text)
        elif isinstance(part, str):
            out.append(part)
    return "".join(out)


def message_texts(body: Any) -> list[tuple[str, str]]:
    """``(role, text)`` of every message item in a Responses request body's ``input``, in order.

    Items are ``{"type": "message", "role": "developer"|"user"|"assistant", "content": [...]}``
    (codex 0.169.0); ``function_call``/``function_call_output`` items are not messages and are
    left out. A body that is not a dict (e.g. an unparseable request) gives ``[]``.
    """
    if not isinstance(body, dict):
        return []
    items = body.get("input")
    if isinstance(items, str):  # the API also allows a bare string input
        return [("user", items)]
    out = []
    for item in items or []:
        if not isinstance(item, dict):
            continue
        if item.get("type", "message") != "message" or "role" not in item:
            continue
        out.append((str(item.get("role")), _content_text(item.get("content"))))
    return out


def last_user_text(body: Any) -> str:
    """Text of the last user-authored message in ``body["input"]``, or ``""``.

    codex injects its own ``user`` messages wrapped in tags — ``<environment_context>…``,
    ``<user_instructions>…`` (AGENTS.md) and the like; any user message whose text starts with
    ``<`` is treated as injected and skipped.
    """
    last = ""
    for role, text in message_texts(body):
        if role == "user" and not text.lstrip().startswith("<"):
            last = text
    return last


def steering_text(body: Any) -> str:
    """The text of the CURRENT user turn, the only text whose words steer the stand-in.

    It is the last user message (:func:`last_user_text`), but when that message is a rotated thread's
    seeded first input — earlier turns replayed ahead of ``[CURRENT USER TURN]`` — only the text after
    the last marker: a ``SLOW`` or ``FAIL500`` in the replayed history must not steer an unrelated turn.
    """
    text = last_user_text(body)
    marker = "\n%s\n" % CURRENT_TURN_MARKER
    if marker in text:
        return text.rsplit(marker, 1)[1]
    return text


def _last_item(body: dict) -> dict:
    items = body.get("input")
    if isinstance(items, list) and items and isinstance(items[-1], dict):
        return items[-1]
    return {}


def _tool_output_text(output: Any) -> str:
    """A ``function_call_output.output`` as text: a string, or a list of content parts."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _content_text(output)
    return json.dumps(output)


def _tool_names(body: dict) -> list[str]:
    names = []
    for tool in body.get("tools") or []:
        if isinstance(tool, dict):
            name = tool.get("name") or (tool.get("function") or {}).get("name") or tool.get("type")
            if name:
                names.append(str(name))
    return names


def _shell_call(body: dict, cmd: str) -> tuple[str, dict]:
    """(tool name, arguments) for running ``cmd`` with the shell tool the request offered."""
    names = _tool_names(body)
    tool = next((t for t in _SHELL_TOOLS if t in names), "exec_command")
    if tool == "exec_command":
        return tool, {"cmd": cmd}
    if tool == "shell_command":
        return tool, {"command": cmd}
    return tool, {"command": ["bash", "-lc", cmd]}


def _steered_call(body: dict, steer: str) -> tuple[str, dict] | None:
    """(tool, arguments) of the function call a magic word asks for, or ``None`` (``ModelStandIn``'s docstring)."""
    if "RUNCMD" in steer:
        return _shell_call(body, steer.split("RUNCMD", 1)[1].strip() or "echo hi")
    if "PATCHFILE" in steer:
        name, _, text = (steer.split("PATCHFILE", 1)[1].strip() or "patched.txt").partition(" ")
        patch = f"*** Begin Patch\n*** Add File: {name}\n+{text or 'patched'}\n*** End Patch\n"
        if "apply_patch" in _tool_names(body):
            return "apply_patch", {"input": patch}
        return _shell_call(body, f"apply_patch <<'EOF'\n{patch}EOF\n")
    if "ASKUSER" in steer:
        question = steer.split("ASKUSER", 1)[1].strip() or "Which one?"
        return "request_user_input", {"questions": [{
            "id": "q1", "header": "Question", "question": question,
            "options": [{"label": "yes", "description": "Say yes"}, {"label": "no", "description": "Say no"}]}]}
    return None


def _usage(n_in: int, n_out: int) -> dict:
    return {
        "input_tokens": n_in,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n_in + n_out,
    }


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _ClientGone(Exception):
    """The HTTP client closed the connection mid-stream (e.g. codex ``turn/interrupt``)."""


# --------------------------------------------------------------------------- HTTP plumbing
class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False        # stop() must not wait for a SLOW stream to finish
    allow_reuse_address = True
    stand_in: "ModelStandIn"


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "HermesModelStandIn/1.0"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    @property
    def _stand_in(self) -> "ModelStandIn":
        return self.server.stand_in

    # ---- helpers
    def _path(self) -> str:
        return urlsplit(self.path).path

    def _read_raw(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size_line = self.rfile.readline()
                if not size_line:
                    break
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            raw = b"".join(chunks)
        else:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length > 0 else b""
        encoding = (self.headers.get("Content-Encoding") or "").lower().strip()
        if encoding == "gzip":
            raw = gzip.decompress(raw)
        elif encoding == "deflate":
            raw = zlib.decompress(raw)
        elif encoding not in ("", "identity"):
            raise ValueError("unsupported Content-Encoding %r" % encoding)
        return raw

    def _send_json(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _sse_start(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _sse(self, event: dict) -> None:
        payload = "event: %s\ndata: %s\n\n" % (event["type"], json.dumps(event))
        try:
            self.wfile.write(payload.encode("utf-8"))
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
            raise _ClientGone() from exc

    # ---- verbs
    def do_GET(self) -> None:
        path = self._path()
        if path == "/__requests":
            return self._send_json(200, self._stand_in.requests())
        if path.rstrip("/") == "/v1/models":
            return self._send_json(200, {"object": "list", "data": [], "models": []})
        return self._send_json(404, {"error": {"message": "not found: GET " + path, "type": "not_found"}})

    def do_POST(self) -> None:
        path = self._path()
        error = None
        try:
            raw = self._read_raw()
        except (ValueError, OSError, EOFError, zlib.error) as exc:  # bad chunking / compression: a malformed body
            raw, error = b"", "unreadable body: %s" % exc
        if path == "/__reset":
            self._stand_in.reset()
            return self._send_json(200, {"ok": True})
        if path.rstrip("/") != "/v1/responses":
            return self._send_json(404, {"error": {"message": "not found: POST " + path, "type": "not_found"}})

        body: Any = None
        if error is None:
            try:
                body = json.loads(raw.decode("utf-8"))
                if not isinstance(body, dict):
                    error = "request body must be a JSON object, got %s" % type(body).__name__
            except (UnicodeDecodeError, ValueError) as exc:
                error = "malformed JSON body: %s" % exc
        entry: dict[str, Any] = {
            "t": time.time(),
            "path": path,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": body if error is None else None,
        }
        if error is not None:
            entry["error"] = error
            entry["raw"] = raw[:2000].decode("utf-8", "replace")
        self._stand_in._record(entry)
        if error is not None:
            return self._send_json(400, {"error": {"message": error, "type": "invalid_request_error"}})
        try:
            self._respond(body)
        except _ClientGone:
            self.close_connection = True

    # ---- the model
    def _send_failure(self, status: int) -> None:
        kind, code = _FAIL_BODIES.get(status, ("server_error", None))
        error = {"message": "model stand-in: forced HTTP %d (FAIL%d)" % (status, status), "type": kind, "code": code}
        self._send_json(status, {"error": error})

    def _respond(self, body: dict) -> None:
        user = last_user_text(body)
        steer = steering_text(body)  # steering words count only in the current user turn
        last = _last_item(body)
        after_tool = last.get("type") in ("function_call_output", "custom_tool_call_output")
        fail = _FAIL_STATUS.search(steer)
        if fail and not after_tool:
            return self._send_failure(int(fail.group(1)))
        resp_id = "resp_" + uuid.uuid4().hex[:16]
        n_in = max(1, len(json.dumps(body.get("input") or [])) // 4)
        self._sse_start()
        self._sse({"type": "response.created", "response": {"id": resp_id}})

        call = None if after_tool else _steered_call(body, steer)
        if call is not None:
            tool, args = call
            call_id = "call_" + uuid.uuid4().hex[:12]
            item = {"type": "function_call", "id": "fc_" + call_id, "call_id": call_id,
                    "name": tool, "arguments": json.dumps(args)}
            self._sse({"type": "response.output_item.added", "output_index": 0, "item": item})
            self._sse({"type": "response.output_item.done", "output_index": 0, "item": item})
            self._sse({"type": "response.completed", "response": {"id": resp_id, "usage": _usage(n_in, 5)}})
            return

        if after_tool:
            reply = "tool said: " + _tool_output_text(last.get("output"))[:_TOOL_OUTPUT_CHARS]
        else:
            reply = "echo: " + user
        slow = "SLOW" in steer and not after_tool
        msg_id = "msg_" + uuid.uuid4().hex[:16]
        self._sse({"type": "response.output_item.added", "output_index": 0, "item": {
            "type": "message", "role": "assistant", "id": msg_id, "status": "in_progress", "content": []}})
        if slow:
            size = max(1, -(-len(reply) // _SLOW_MIN_CHUNKS))
        else:
            size = _CHUNK_CHARS
        chunks = [reply[i:i + size] for i in range(0, len(reply), size)] or [""]
        slow_for = _SLOW_FOR.search(steer)
        seconds = float(slow_for.group(1)) if slow_for else self._stand_in.slow_seconds
        delay = seconds / len(chunks) if slow else 0.0
        for chunk in chunks:
            self._sse({"type": "response.output_text.delta", "item_id": msg_id, "output_index": 0,
                       "content_index": 0, "delta": chunk})
            if delay and self._stand_in._stopping.wait(delay):
                raise _ClientGone()  # the stand-in is shutting down: drop the stream
        self._sse({"type": "response.output_item.done", "output_index": 0, "item": {
            "type": "message", "role": "assistant", "id": msg_id, "status": "completed",
            "content": [{"type": "output_text", "text": reply, "annotations": []}]}})
        n_out = max(1, len(reply) // 4)
        self._sse({"type": "response.completed", "response": {"id": resp_id, "usage": _usage(n_in, n_out)}})


# --------------------------------------------------------------------------- public API
class ModelStandIn:
    """A Responses-API stand-in on a loopback address that codex uses as its model server.

    Endpoints (everything answers JSON unless noted; unknown paths answer 404 JSON):

    * ``POST /v1/responses`` (codex 0.169.0 sends ``stream: true``) → ``text/event-stream``; each
      event is ``event: <type>\\ndata: <json>\\n\\n``, in this order (``docs/codex.md`` §8)::

          response.created            {"response": {"id": "resp_…"}}
          response.output_item.added  assistant message, status in_progress, empty content
          response.output_text.delta  the reply text in chunks (8 characters each)
          response.output_item.done   assistant message, status completed, full output_text
          response.completed          {"response": {"id", "usage": {input_tokens, …, total_tokens}}}

      The reply is ``"echo: <last user text>"``; the last user text skips codex's injected
      user messages that start with ``<`` (``<environment_context>`` …). Token counts are
      rough estimates (characters / 4).
    * ``GET /v1/models`` → ``{"object": "list", "data": [], "models": []}``.
    * ``GET /__requests`` → JSON list of the recorded requests (see :meth:`requests`).
    * ``POST /__reset`` → clears the record, answers ``{"ok": true}``.

    Magic words steer it only in the current user turn (:func:`steering_text`: the last user text, and
    in a rotated thread's seeded input only what follows ``[CURRENT USER TURN]``, never the replayed
    history):

    * ``SLOW`` — the reply is cut into at least 20 deltas spread over ``slow_seconds`` seconds
      (for interrupt tests); a client that disconnects midway is tolerated. ``SLOW<n>`` (``SLOW15``,
      ``SLOW2.5``): over ``n`` seconds instead, for this reply only.
    * ``RUNCMD <cmd>`` — the answer is a ``function_call`` to the shell tool the request offered
      (``exec_command`` with arguments ``{"cmd": "<cmd>"}`` in codex 0.169.0), then
      ``response.completed``. Codex runs the tool and POSTs again with a ``function_call_output``
      as the last input item; that request is answered ``"tool said: <output[:200]>"``.
    * ``PATCHFILE <name> <text>`` — a patch adding file ``<name>`` with the line ``<text>``: through the
      ``apply_patch`` tool when the request offers it, else ``apply_patch`` run by the shell tool (codex
      turns either into a ``fileChange`` item, approved by ``item/fileChange/requestApproval``).
    * ``ASKUSER <question>`` — a call of the ``request_user_input`` tool with one question (id ``q1``,
      options ``yes`` / ``no``): codex asks ``item/tool/requestUserInput``. Both are answered, once the
      tool's output comes back, as ``RUNCMD``'s are.
    * ``FAIL<status>`` (``FAIL500``, ``FAIL401``, ``FAIL429``, … any 100–599) — the model call is
      answered with that HTTP status and ``{"error": {"message", "type", "code"}}`` shaped like
      OpenAI's (401 ``invalid_api_key``, 429 ``rate_limit_exceeded``, 5xx ``server_error``).

    A body that is not a JSON object is recorded (``body: None`` plus ``error`` and ``raw``
    keys) and answered with HTTP 400; the server keeps running.

    Use as a context manager or call :meth:`start` / :meth:`stop`::

        with ModelStandIn() as model:
            ...  # config.toml: base_url = model.base_url
            assert model.requests()
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, log_path: str | None = None,
                 slow_seconds: float = 20.0):
        """``port=0`` picks a free port. ``log_path``: each recorded request is appended to it as
        one JSON line. ``slow_seconds``: how long a ``SLOW`` reply takes, in seconds.
        Raises ``ValueError`` for a host that is not a loopback address."""
        if not _is_loopback(host):
            raise ValueError("model stand-in binds loopback addresses only, not %r" % (host,))
        self.host = "127.0.0.1" if host == "localhost" else host
        self._requested_port = int(port)
        self.log_path = log_path
        self.slow_seconds = float(slow_seconds)
        self._lock = threading.Lock()
        self._requests: list[dict] = []
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle
    def start(self) -> "ModelStandIn":
        """Bind and serve in a daemon thread; returns ``self``. Calling it again is a no-op."""
        if self._server is not None:
            return self
        cls = _Server6 if ":" in self.host else _Server
        server = cls((self.host, self._requested_port), _Handler)
        server.stand_in = self
        self._stopping.clear()
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="model-stand-in", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket; aborts running ``SLOW`` streams. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "ModelStandIn":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- addresses
    @property
    def port(self) -> int:
        """The bound TCP port (raises ``RuntimeError`` before :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("model stand-in is not running")
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1`` — the provider ``base_url`` for codex's config.toml
        (codex POSTs ``{base_url}/responses``)."""
        host = "[%s]" % self.host if ":" in self.host else self.host
        return "http://%s:%d/v1" % (host, self.port)

    # ---- record
    def _record(self, entry: dict) -> None:
        with self._lock:
            self._requests.append(entry)
            if self.log_path:
                with open(self.log_path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(entry) + "\n")

    def requests(self) -> list[dict]:
        """The recorded ``POST /v1/responses`` requests, oldest first, each
        ``{"t": <epoch seconds>, "path": "/v1/responses", "headers": {<lower-case name>: value},
        "body": <parsed JSON object>}`` (malformed bodies: ``body`` is ``None`` and the entry has
        ``error`` and ``raw`` too). Returns a copy of the list."""
        with self._lock:
            return list(self._requests)

    def user_texts(self, request: dict) -> list[tuple[str, str]]:
        """``(role, text)`` of every input message of one recorded request, in order — developer
        prompts, codex's ``<environment_context>`` and earlier turns' user/assistant messages
        included (so "turn 2's request carries turn 1's exchange" can be asserted)."""
        return message_texts(request.get("body"))

    def reset(self) -> None:
        """Forget the recorded requests (the log file is left alone)."""
        with self._lock:
            self._requests.clear()
