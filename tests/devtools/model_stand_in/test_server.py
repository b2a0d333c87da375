"""Tests for devtools.model_stand_in (the offline Responses-API stand-in).

Everything goes over real HTTP (urllib) against an in-process server on 127.0.0.1:0; the last
test drives the real codex 0.169.0 ``app-server`` binary against it. No database access.
"""
from __future__ import annotations

import http.client
import json
import queue
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from devtools.model_stand_in import CURRENT_TURN_MARKER, ModelStandIn, last_user_text, steering_text
from hermes_sessions.history_seed import CURRENT_TURN_MARKER as SERVICE_MARKER
from hermes_sessions.history_seed import seeded_input

ENV_CONTEXT = "<environment_context>\n  <cwd>/tmp/x</cwd>\n  <shell>bash</shell>\n</environment_context>"


# --------------------------------------------------------------------------- helpers
def msg(role: str, text: str) -> dict:
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def codex_like_body(*items: dict, tools=("exec_command", "write_stdin")) -> dict:
    """A request body shaped like codex 0.169.0's (docs/codex.md §8)."""
    return {
        "model": "mock-model",
        "input": [msg("developer", "You are a coding agent."), msg("user", ENV_CONTEXT), *items],
        "tools": [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in tools],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
    }


def http(method: str, url: str, data: bytes | None = None, timeout: float = 10.0):
    """(status, content-type, body bytes); HTTP errors are returned, not raised."""
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers.get("Content-Type"), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type"), err.read()


def parse_sse(raw: bytes) -> list[tuple[str, dict]]:
    """[(event name, data JSON)] of an SSE stream; checks `event:` matches data["type"]."""
    events = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(fields["data"])
        assert fields["event"] == data["type"]
        events.append((fields["event"], data))
    return events


def post_responses(model: ModelStandIn, body: dict):
    status, ctype, raw = http("POST", model.base_url + "/responses", json.dumps(body).encode())
    return status, ctype, raw


@pytest.fixture
def model(tmp_path):
    with ModelStandIn(log_path=str(tmp_path / "requests.jsonl"), slow_seconds=1.0) as stand_in:
        yield stand_in


# --------------------------------------------------------------------------- HTTP behaviour
def test_echo_reply_is_the_protocol_sse_sequence(model):
    status, ctype, raw = post_responses(model, codex_like_body(msg("user", "hello one, and a longer line")))
    assert status == 200
    assert ctype.startswith("text/event-stream")
    events = parse_sse(raw)
    names = [name for name, _ in events]
    n_deltas = names.count("response.output_text.delta")
    assert n_deltas >= 2  # the reply is streamed in chunks
    assert names == (["response.created", "response.output_item.added"]
                     + ["response.output_text.delta"] * n_deltas
                     + ["response.output_item.done", "response.completed"])

    created, added, *deltas, done, completed = [data for _, data in events]
    resp_id = created["response"]["id"]
    item = added["item"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["status"] == "in_progress" and item["content"] == []
    assert all(d["item_id"] == item["id"] and d["output_index"] == 0 and d["content_index"] == 0 for d in deltas)
    assert "".join(d["delta"] for d in deltas) == "echo: hello one, and a longer line"
    assert done["item"]["id"] == item["id"] and done["item"]["status"] == "completed"
    assert done["item"]["content"] == [
        {"type": "output_text", "text": "echo: hello one, and a longer line", "annotations": []}]
    assert completed["response"]["id"] == resp_id
    usage = completed["response"]["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


def test_environment_context_and_wrapped_messages_are_skipped(model):
    body = codex_like_body(msg("user", "first question"), msg("assistant", "echo: first question"),
                           msg("user", "second question"), msg("user", "<user_instructions>x</user_instructions>"))
    assert last_user_text(body) == "second question"
    _, _, raw = post_responses(model, body)
    done = [d for n, d in parse_sse(raw) if n == "response.output_item.done"][0]
    assert done["item"]["content"][0]["text"] == "echo: second question"

    # only the injected environment context: nothing to echo, but still a valid reply
    _, _, raw = post_responses(model, codex_like_body())
    done = [d for n, d in parse_sse(raw) if n == "response.output_item.done"][0]
    assert done["item"]["content"][0]["text"] == "echo: "


def test_runcmd_two_step_flow(model):
    first = codex_like_body(msg("user", "RUNCMD ls -la /tmp"))
    status, _, raw = post_responses(model, first)
    assert status == 200
    events = parse_sse(raw)
    assert [n for n, _ in events] == ["response.created", "response.output_item.added",
                                      "response.output_item.done", "response.completed"]
    call = events[2][1]["item"]
    assert call["type"] == "function_call"
    assert call["name"] == "exec_command"
    assert json.loads(call["arguments"]) == {"cmd": "ls -la /tmp"}
    assert call["call_id"]

    long_output = "line of output " * 40
    follow_up = dict(first)
    follow_up["input"] = first["input"] + [
        {k: call[k] for k in ("type", "id", "name", "arguments", "call_id")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": long_output},
    ]
    _, _, raw = post_responses(model, follow_up)
    events = parse_sse(raw)
    assert [n for n, _ in events][-2:] == ["response.output_item.done", "response.completed"]
    text = events[-2][1]["item"]["content"][0]["text"]
    assert text == "tool said: " + long_output[:200]
    assert len(model.requests()) == 2


def test_runcmd_uses_the_shell_tool_offered(model):
    _, _, raw = post_responses(model, codex_like_body(msg("user", "RUNCMD echo hi"), tools=("shell_command",)))
    call = [d for n, d in parse_sse(raw) if n == "response.output_item.done"][0]["item"]
    assert call["name"] == "shell_command"
    assert json.loads(call["arguments"]) == {"command": "echo hi"}


def test_fail500(model):
    status, ctype, raw = post_responses(model, codex_like_body(msg("user", "please FAIL500 now")))
    assert status == 500
    assert ctype == "application/json"
    assert json.loads(raw)["error"]["type"] == "server_error"
    assert len(model.requests()) == 1  # still recorded


@pytest.mark.parametrize(("status", "kind", "code"), [
    (401, "invalid_request_error", "invalid_api_key"),
    (429, "rate_limit_exceeded", "rate_limit_exceeded"),
    (503, "server_error", None),
])
def test_fail_answers_the_chosen_http_status(model, status, kind, code):
    got, ctype, raw = post_responses(model, codex_like_body(msg("user", f"please FAIL{status} now")))
    assert (got, ctype) == (status, "application/json")
    error = json.loads(raw)["error"]
    assert (error["type"], error["code"]) == (kind, code)
    assert f"forced HTTP {status}" in error["message"]


def test_the_marker_is_the_one_the_service_seeds_with():
    assert CURRENT_TURN_MARKER == SERVICE_MARKER


@pytest.fixture
def slow_model():
    with ModelStandIn(slow_seconds=4.0) as stand_in:
        yield stand_in


def _timed_reply(model: ModelStandIn, body: dict) -> tuple[float, int, list[tuple[str, dict]]]:
    start = time.monotonic()
    status, _, raw = post_responses(model, body)
    return time.monotonic() - start, status, (parse_sse(raw) if status == 200 else [])


def test_steering_words_of_earlier_turns_in_a_resumed_history_do_not_steer(slow_model):
    """codex replays a resumed thread's turns as separate messages: only the last user message steers."""
    body = codex_like_body(msg("user", "SLOW one"), msg("assistant", "echo: SLOW one"),
                           msg("user", "FAIL500 two"), msg("user", "RUNCMD echo three"),
                           msg("assistant", "tool said: three"), msg("user", "plain four"))
    elapsed, status, events = _timed_reply(slow_model, body)
    done = [d for n, d in events if n == "response.output_item.done"]
    assert status == 200 and elapsed < 2.0, (status, elapsed)
    assert [d["item"]["type"] for d in done] == ["message"]
    assert done[0]["item"]["content"][0]["text"] == "echo: plain four"


def test_steering_words_in_a_rotated_threads_replayed_history_do_not_steer(slow_model):
    """After a rotation the first input carries the history ahead of [CURRENT USER TURN] (one user
    message): a SLOW, FAIL500 or RUNCMD in that history must not steer the unrelated turn (it once made
    it take 21 s)."""
    seed = "Prior conversation …\n\n[USER]\nSLOW please\n\n[USER]\nFAIL500\n\n[USER]\nRUNCMD rm -rf x"
    text = seeded_input(seed, "what is new?")
    assert steering_text(codex_like_body(msg("user", text))) == "what is new?"
    elapsed, status, events = _timed_reply(slow_model, codex_like_body(msg("user", text)))
    done = [d for n, d in events if n == "response.output_item.done"]
    assert status == 200 and elapsed < 2.0, (status, elapsed)
    assert [d["item"]["type"] for d in done] == ["message"]  # no function_call from the old RUNCMD


def test_a_steering_word_in_the_current_turn_of_a_seeded_input_still_steers(slow_model):
    text = seeded_input("Prior conversation …\n\n[USER]\nhello", "SLOW now")
    elapsed, status, _ = _timed_reply(slow_model, codex_like_body(msg("user", text)))
    assert status == 200 and elapsed >= 3.5, elapsed
    status, _, _ = post_responses(slow_model, codex_like_body(msg("user", seeded_input("[USER]\nhi", "FAIL500"))))
    assert status == 500


def test_slow_spreads_deltas_and_survives_a_disconnect(model):
    start = time.monotonic()
    _, _, raw = post_responses(model, codex_like_body(msg("user", "SLOW")))
    elapsed = time.monotonic() - start
    deltas = [d for n, d in parse_sse(raw) if n == "response.output_text.delta"]
    assert "".join(d["delta"] for d in deltas) == "echo: SLOW"
    assert len(deltas) >= 5
    assert 0.8 <= elapsed < 5  # slow_seconds=1.0 in the fixture

    # A client that hangs up mid-stream must not break the server.
    model.slow_seconds = 3.0
    body = json.dumps(codex_like_body(msg("user", "SLOW and then gone"))).encode()
    with socket.create_connection(("127.0.0.1", model.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        received, deadline = b"", time.monotonic() + 5
        while b"response.output_text.delta" not in received and time.monotonic() < deadline:
            received += sock.recv(65536)  # read until the first delta, however the bytes are split
        assert b"response.output_text.delta" in received
    status, _, raw = post_responses(model, codex_like_body(msg("user", "still alive")))
    assert status == 200 and b"echo: still alive" in raw


def test_slow_with_seconds_takes_that_long_for_this_reply_only(model):
    """``SLOW<n>``: ``n`` seconds instead of ``slow_seconds`` (1.0 in the fixture) — make faults'
    freeze-warm-holder keeps some workers busy longer than others."""
    start = time.monotonic()
    _, _, raw = post_responses(model, codex_like_body(msg("user", "busy SLOW2.5")))
    assert 2.3 <= time.monotonic() - start < 6
    assert b"echo: busy SLOW2.5" in raw
    start = time.monotonic()
    post_responses(model, codex_like_body(msg("user", "SLOW")))
    assert 0.8 <= time.monotonic() - start < 2.3  # the next plain SLOW: slow_seconds again


def test_requests_endpoint_log_file_and_reset(model, tmp_path):
    post_responses(model, codex_like_body(msg("user", "one")))
    post_responses(model, codex_like_body(msg("user", "one"), msg("assistant", "echo: one"), msg("user", "two")))

    recorded = model.requests()
    assert [r["path"] for r in recorded] == ["/v1/responses", "/v1/responses"]
    assert set(recorded[0]) >= {"t", "path", "headers", "body"}
    assert recorded[0]["t"] <= recorded[1]["t"]
    assert recorded[0]["headers"]["content-type"] == "application/json"
    assert recorded[1]["body"]["prompt_cache_key"] == "thread-1"
    texts = model.user_texts(recorded[1])
    assert texts[0][0] == "developer"
    assert ("user", ENV_CONTEXT) in texts
    assert texts[-3:] == [("user", "one"), ("assistant", "echo: one"), ("user", "two")]

    status, _, raw = http("GET", "http://127.0.0.1:%d/__requests" % model.port)
    assert status == 200
    over_http = json.loads(raw)
    assert [r["body"]["input"][-1] for r in over_http] == [r["body"]["input"][-1] for r in recorded]

    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert [json.loads(line)["body"]["input"][-1] for line in lines] == [r["body"]["input"][-1] for r in recorded]

    status, _, raw = http("POST", "http://127.0.0.1:%d/__reset" % model.port, b"")
    assert status == 200 and json.loads(raw) == {"ok": True}
    assert model.requests() == []
    assert json.loads(http("GET", "http://127.0.0.1:%d/__requests" % model.port)[2]) == []
    post_responses(model, codex_like_body(msg("user", "three")))
    assert model.user_texts(model.requests()[0])[-1] == ("user", "three")
    model.reset()
    assert model.requests() == []


def test_models_and_unknown_paths(model):
    status, _, raw = http("GET", model.base_url + "/models")
    assert status == 200 and json.loads(raw) == {"object": "list", "data": [], "models": []}
    for method, path in (("GET", "/nope"), ("POST", "/v1/chat/completions"), ("GET", "/v1/responses")):
        status, ctype, raw = http(method, "http://127.0.0.1:%d%s" % (model.port, path),
                                  b"{}" if method == "POST" else None)
        assert status == 404, path
        assert ctype == "application/json"
        assert "error" in json.loads(raw)
    assert model.requests() == []


def test_malformed_body_is_recorded_answered_400_and_server_survives(model):
    for bad in (b"{not json", b"\xff\xfe\x00", b"[1, 2, 3]", b""):
        status, _, raw = http("POST", model.base_url + "/responses", bad)
        assert status == 400, bad
        assert json.loads(raw)["error"]["type"] == "invalid_request_error"
    recorded = model.requests()
    assert len(recorded) == 4
    assert all(r["body"] is None and r["error"] for r in recorded)
    assert model.user_texts(recorded[0]) == []
    status, _, raw = post_responses(model, codex_like_body(msg("user", "after the garbage")))
    assert status == 200 and b"echo: after the garbage" in raw


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.com", "", "::"])
def test_non_loopback_host_is_refused(host):
    with pytest.raises(ValueError):
        ModelStandIn(host=host)


def test_lifecycle_port_base_url_and_idempotent_stop():
    stand_in = ModelStandIn()
    with pytest.raises(RuntimeError):
        _ = stand_in.port
    assert stand_in.start() is stand_in
    port = stand_in.port
    assert port > 0
    assert stand_in.base_url == "http://127.0.0.1:%d/v1" % port
    stand_in.stop()
    stand_in.stop()
    with pytest.raises(OSError):
        http("GET", "http://127.0.0.1:%d/v1/models" % port, timeout=2)


def test_stop_does_not_wait_for_a_slow_stream():
    stand_in = ModelStandIn(slow_seconds=30).start()
    result = {}

    def slow_request():
        try:
            result["r"] = post_responses(stand_in, codex_like_body(msg("user", "SLOW")))
        except (OSError, http.client.HTTPException) as exc:  # the stream is cut: either is fine
            result["r"] = exc

    t = threading.Thread(target=slow_request, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not stand_in.requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    start = time.monotonic()
    stand_in.stop()
    assert time.monotonic() - start < 3
    t.join(5)
    assert not t.is_alive()


# --------------------------------------------------------------------------- the real codex
class _AppServer:
    """Just enough JSON-RPC over stdio (JSONL, no "jsonrpc" field) to run one turn."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for raw in self.proc.stdout:
            raw = raw.strip()
            if raw:
                self.lines.put(json.loads(raw))
        self.lines.put(None)  # EOF

    def send(self, obj: dict) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def wait_for(self, predicate, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "timed out; seen: %s" % json.dumps(self.seen[-10:])[:3000]
            try:
                message = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            assert message is not None, "codex exited early; seen: %s" % json.dumps(self.seen[-10:])[:3000]
            self.seen.append(message)
            if "id" in message and "method" in message:  # unexpected server request: decline it
                self.send({"id": message["id"], "error": {"code": -32601, "message": "not supported in test"}})
                continue
            if predicate(message):
                return message

    def call(self, method: str, params: dict) -> dict:
        request_id = self._next_id
        self._next_id += 1
        self.send({"method": method, "id": request_id, "params": params})
        reply = self.wait_for(lambda m: m.get("id") == request_id and "method" not in m)
        assert "error" not in reply, reply
        return reply["result"]


def test_real_codex_app_server_turn_goes_through_the_stand_in(model, codex_dirs, settings, real_codex_bin):
    """The real binary with the config.toml and environment the worker gives it (codex/launch.py)."""
    from hermes_sessions.codex.launch import STAND_IN_KEY_ENV, app_server_env, ensure_codex_home

    settings.CODEX_BIN = real_codex_bin
    settings.CODEX_APP_SERVER_COMMAND = ""
    settings.CODEX_MODEL_PROVIDER = "stand-in"
    settings.CODEX_STAND_IN_URL = model.base_url
    ensure_codex_home()
    env = app_server_env()
    workdir = codex_dirs / "work"
    workdir.mkdir()
    proc = subprocess.Popen([real_codex_bin, "app-server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=str(workdir), env=env)
    try:
        server = _AppServer(proc)
        server.call("initialize", {"clientInfo": {"name": "hermes_tests", "title": "Hermes tests",
                                                  "version": "0.0.1"}})
        server.send({"method": "initialized", "params": {}})
        thread_id = server.call("thread/start", {})["thread"]["id"]
        server.call("turn/start", {"threadId": thread_id, "input": [{"type": "text", "text": "hello one"}]})
        completed = server.wait_for(lambda m: m.get("method") == "turn/completed", timeout=60)

        turn = completed["params"]["turn"]
        texts = [item["text"] for item in turn.get("items") or [] if item.get("type") == "agentMessage"]
        if not texts:  # fall back to item/completed notifications
            texts = [m["params"]["item"]["text"] for m in server.seen
                     if m.get("method") == "item/completed" and m["params"]["item"].get("type") == "agentMessage"]
        assert texts == ["echo: hello one"], json.dumps(completed)[:2000]

        recorded = model.requests()
        assert len(recorded) == 1
        request = recorded[0]
        assert request["path"] == "/v1/responses"
        assert request["headers"]["authorization"] == f"Bearer {env[STAND_IN_KEY_ENV]}"
        assert request["body"]["stream"] is True
        assert request["body"]["prompt_cache_key"] == thread_id
        roles_texts = model.user_texts(request)
        assert roles_texts[-1] == ("user", "hello one")
        assert any(role == "user" and text.startswith("<environment_context>") for role, text in roles_texts)
    finally:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
        try:
            rc = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert rc == 0
