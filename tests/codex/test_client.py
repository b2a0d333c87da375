"""AppServerClient against the scripted stand-in, small inline stubs, and once against the real codex binary."""
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from hermes_sessions.codex.client import AppServerClient
from hermes_sessions.codex.errors import (
    CodexError,
    JsonRpcError,
    RequestTimeout,
    ThreadGone,
    TransportError,
    retryable,
)
from hermes_sessions.codex.server_requests import make_server_request_handler

SCRIPTED = Path(__file__).with_name("scripted_app_server.py")
REPO = Path(__file__).resolve().parents[2]

APPROVAL = "item/commandExecution/requestApproval"


# ---------------------------------------------------------------------------------------------- helpers


def scripted_client(state_dir, script=None, **kwargs):
    if script is not None:
        (state_dir / "script.json").write_text(json.dumps(script))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SCRIPTED_STATE_DIR": str(state_dir)}
    return AppServerClient([sys.executable, str(SCRIPTED)], env=env, cwd=str(state_dir), **kwargs)


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def text_input(text):
    return [{"type": "text", "text": text, "text_elements": []}]


def hanging_in_background(client, state_dir, into: dict) -> threading.Thread:
    """A ``thread/loaded/list`` the script never answers (``{"hang": true}``), sent from a thread once the
    stand-in has read it; its error goes to ``into["exc"]`` (and the time to ``into["at"]``)."""
    def hanging_request():
        try:
            client.request("thread/loaded/list")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            into["exc"], into["at"] = exc, time.monotonic()

    thread = threading.Thread(target=hanging_request)
    thread.start()
    deadline = time.monotonic() + 5
    while "thread/loaded/list" not in (state_dir / "methods.jsonl").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return thread


def until_turn_completed(client, timeout=10.0):
    """Notifications up to and including turn/completed."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        note = client.next_notification(timeout=0.5)
        if note is None:
            continue
        seen.append(note)
        if note["method"] == "turn/completed":
            return seen
    raise AssertionError(f"no turn/completed within {timeout}s; saw {[n['method'] for n in seen]}")


def live_group_members(pgid):
    """Pids of non-zombie processes in process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def assert_no_process_left(pid):
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the leader is reaped, not merely a zombie
    # Other members got SIGKILL; delivery is asynchronous, so give them a moment to die.
    deadline = time.monotonic() + 2
    while live_group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live_group_members(pid) == []


def assert_dead_or_zombie(pid):
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return
    assert "State:\tZ" in status, status  # PID 1 here does not reap orphans (docs/codex.md §1)


# ---------------------------------------------------------------------------------------------- handshake


def test_handshake_then_turn_records_wire_sequence_and_always_sends_params(state_dir):
    with scripted_client(state_dir) as client:
        init = client.start()
        assert init["userAgent"].startswith("hermes_sessions/")
        assert client.alive() and client.pid
        thread = client.request("thread/start")["thread"]
        turn = client.request("turn/start", {"threadId": thread["id"], "input": text_input("hi")})["turn"]
        assert turn["status"] == "inProgress"
        notes = until_turn_completed(client)

    assert client.sent_methods == ["initialize", "thread/start", "turn/start"]
    methods = read_jsonl(state_dir / "methods.jsonl")
    assert [m["method"] for m in methods] == ["initialize", "thread/start", "turn/start"]
    assert methods[0]["params"]["clientInfo"] == {
        "name": "hermes_sessions", "title": "hermes_sessions", "version": "0.1.0"
    }
    assert methods[1]["params"] == {}  # codex 0.169 rejects a request without params
    # Notifications arrive in order, unsolicited ones included.
    got = [n["method"] for n in notes]
    assert got[0] == "remoteControl/status/changed"
    assert got.index("thread/started") < got.index("turn/started") < got.index("thread/tokenUsage/updated")
    agent = [n["params"]["item"] for n in notes
             if n["method"] == "item/completed" and n["params"]["item"]["type"] == "agentMessage"]
    assert [a["text"] for a in agent] == ["echo: hi"]
    assert notes[-1]["params"]["turn"]["status"] == "completed"
    assert_no_process_left(client.pid)


def test_json_rpc_error_keeps_code_message_and_method_and_client_stays_usable(state_dir):
    missing = "3a71980c-6ec3-4335-8781-2e95cf463185"
    with scripted_client(state_dir) as client:
        client.start()
        with pytest.raises(JsonRpcError) as info:
            client.request("thread/resume", {"threadId": missing})
        assert (info.value.method, info.value.code) == ("thread/resume", -32600)
        assert info.value.message == f"no rollout found for thread id {missing}"
        assert info.value.data is None
        assert type(info.value) is ThreadGone and not retryable(info.value)
        with pytest.raises(JsonRpcError) as unknown:
            client.request("no/such/method")
        assert unknown.value.message.startswith("Invalid request: unknown variant")
        assert client.request("thread/start")["thread"]["id"]


def test_spawn_failure_is_a_plain_codex_error(tmp_path):
    client = AppServerClient([str(tmp_path / "no-such-codex"), "app-server"], env={}, cwd=str(tmp_path))
    with pytest.raises(CodexError) as info:
        client.start()
    assert not isinstance(info.value, TransportError)  # a missing binary is not worth retrying
    assert "no-such-codex" in str(info.value)
    client.close()


# ---------------------------------------------------------------------------------------------- transport faults


def test_eof_fails_every_pending_request_at_once_with_stderr_tail(state_dir):
    script = {"thread/loaded/list": [{"hang": True}], "thread/start": [{"stderr_lines": 3, "exit": 7}]}
    with scripted_client(state_dir, script, request_timeout=30) as client:
        client.start()
        other: dict = {}
        waiter = hanging_in_background(client, state_dir, other)

        started = time.monotonic()
        with pytest.raises(TransportError) as info:
            client.request("thread/start")
        elapsed = time.monotonic() - started
        waiter.join(5)

    assert elapsed < 3, elapsed  # at EOF, not at the 30 s deadline
    exc = info.value
    assert not isinstance(exc, RequestTimeout)
    assert "exit code 7" in str(exc) and "closed its stdout" in str(exc)
    assert "stderr line 3 of 3" in exc.stderr_tail and "stderr line 3 of 3" in str(exc)
    assert retryable(exc)
    assert isinstance(other["exc"], TransportError) and not isinstance(other["exc"], RequestTimeout)
    assert other["at"] - started < 3


def test_request_past_deadline_raises_request_timeout_and_client_stays_usable(state_dir):
    with scripted_client(state_dir, {"thread/start": [{"hang": True}]}) as client:
        client.start()
        started = time.monotonic()
        with pytest.raises(RequestTimeout) as info:
            client.request("thread/start", timeout=0.3)
        assert 0.3 <= time.monotonic() - started < 2
        assert (info.value.method, info.value.timeout) == ("thread/start", 0.3)
        assert retryable(info.value)
        assert client.alive()
        assert client.request("thread/start")["thread"]["id"]


def test_next_notification_drains_queue_then_raises_after_exit(state_dir):
    with scripted_client(state_dir, {"thread/start": [{"exit": 3}]}) as client:
        client.start()
        with pytest.raises(TransportError):
            client.request("thread/start")
        assert not client.alive()
        assert client.next_notification(timeout=1)["method"] == "remoteControl/status/changed"
        started = time.monotonic()
        with pytest.raises(TransportError) as info:
            client.next_notification(timeout=30)
        assert time.monotonic() - started < 1
        assert "exit code 3" in str(info.value)
        with pytest.raises(TransportError):
            client.request("thread/start")  # fails fast, sends nothing
    assert client.sent_methods == ["initialize", "thread/start"]


def test_non_json_stdout_line_fails_the_connection_and_kills_the_process(state_dir):
    with scripted_client(state_dir, {"thread/start": [{"raw_line": "panicked at src/main.rs"}]}) as client:
        client.start()
        pid = client.pid
        with pytest.raises(TransportError) as info:
            client.request("thread/start", timeout=20)
        assert "not a JSON object" in str(info.value) and "panicked at src/main.rs" in str(info.value)
        assert "[stdout, not a JSON object] panicked at src/main.rs" in client.stderr_tail()
        assert not client.alive()
    assert_no_process_left(pid)


def test_frame_at_limit_passes_and_one_byte_over_is_too_large(state_dir):
    limit = 4096
    frame = json.dumps({"method": "pad", "params": {"p": ""}})
    at_limit = json.dumps({"method": "pad", "params": {"p": "x" * (limit - len(frame))}})
    assert len(at_limit) == limit
    over = json.dumps({"method": "pad", "params": {"p": "x" * (limit - len(frame) + 1)}})
    script = {"thread/loaded/list": [{"raw_line": at_limit}, {"raw_line": over}]}
    with scripted_client(state_dir, script, max_frame_bytes=limit) as client:
        client.start()
        client.request("thread/loaded/list")
        assert client.next_notification(timeout=1)["method"] == "remoteControl/status/changed"
        assert client.next_notification(timeout=1)["method"] == "pad"
        with pytest.raises(TransportError) as info:
            client.request("thread/loaded/list", timeout=20)
        assert "frame too large" in str(info.value)
        assert not client.alive()


def test_garbage_during_handshake_fails_start_and_leaves_no_process(tmp_path):
    stub = "import sys, time; print('Error: CODEX_HOME points to nowhere', flush=True); time.sleep(60)"
    client = AppServerClient([sys.executable, "-c", stub], env={}, cwd=str(tmp_path))
    with pytest.raises(TransportError) as info:
        client.start()
    assert "Error: CODEX_HOME points to nowhere" in str(info.value)
    assert_no_process_left(client.pid)


# ---------------------------------------------------------------------------------------------- server requests


@pytest.mark.parametrize(("auto_approve", "decision"), [(False, "decline"), (True, "accept")])
def test_approval_request_is_answered_and_turn_completes(state_dir, auto_approve, decision):
    script = {"turn/start": [{"server_request": {"method": APPROVAL, "params": {"command": "touch x"}}}]}
    handler = make_server_request_handler(approval_policy="untrusted", auto_approve=auto_approve)
    with scripted_client(state_dir, script, server_request_handler=handler) as client:
        client.start()
        thread_id = client.request("thread/start")["thread"]["id"]
        client.request("turn/start", {"threadId": thread_id, "input": text_input("run it")})
        notes = until_turn_completed(client)
    assert "serverRequest/resolved" in [n["method"] for n in notes]
    [answer] = read_jsonl(state_dir / "server_answers.jsonl")
    assert answer == {"method": APPROVAL, "answer": {"id": 0, "result": {"decision": decision}}}


@pytest.mark.parametrize(
    ("method", "use_handler"),
    [("item/tool/call", True), ("item/tool/requestUserInput", True), (APPROVAL, False)],
)
def test_unhandled_server_request_gets_method_not_found(state_dir, method, use_handler):
    script = {"turn/start": [{"server_request": {"method": method, "params": {}}}]}
    handler = make_server_request_handler() if use_handler else None
    with scripted_client(state_dir, script, server_request_handler=handler) as client:
        client.start()
        thread_id = client.request("thread/start")["thread"]["id"]
        client.request("turn/start", {"threadId": thread_id, "input": text_input("x")})
        until_turn_completed(client)
    [answer] = read_jsonl(state_dir / "server_answers.jsonl")
    assert answer["answer"] == {
        "id": 0, "error": {"code": -32601, "message": f"hermes_sessions does not handle {method}"}
    }


def test_slow_handler_does_not_block_responses(state_dir):
    entered, release = threading.Event(), threading.Event()

    def slow_handler(method, params):
        entered.set()
        release.wait(10)
        return {"decision": "decline"}

    script = {"turn/start": [{"server_request": {"method": APPROVAL, "params": {}}}]}
    with scripted_client(state_dir, script, server_request_handler=slow_handler) as client:
        client.start()
        thread_id = client.request("thread/start")["thread"]["id"]
        client.request("turn/start", {"threadId": thread_id, "input": text_input("x")})
        assert entered.wait(5)
        # While the handler waits, the reader still delivers responses.
        assert client.request("thread/loaded/list", timeout=2)["data"] == [thread_id]
        release.set()
        until_turn_completed(client)
    [answer] = read_jsonl(state_dir / "server_answers.jsonl")
    assert answer["answer"]["result"] == {"decision": "decline"}


@pytest.mark.parametrize(
    ("method", "auto_approve", "expected"),
    [
        (APPROVAL, False, {"decision": "decline"}),
        (APPROVAL, True, {"decision": "accept"}),
        ("item/fileChange/requestApproval", False, {"decision": "decline"}),
        ("item/fileChange/requestApproval", True, {"decision": "accept"}),
        ("item/permissions/requestApproval", True, {"permissions": {}, "scope": "turn"}),
        ("execCommandApproval", False, {"decision": {"denied": {"rejection": "declined: hermes_sessions runs turns unattended"}}}),
        ("applyPatchApproval", True, {"decision": "approved"}),
        ("mcpServer/elicitation/request", True, {"action": "decline", "content": None, "_meta": None}),
    ],
)
def test_server_request_handler_answers(method, auto_approve, expected):
    assert make_server_request_handler(auto_approve=auto_approve)(method, {}) == expected


@pytest.mark.parametrize("method", ["item/tool/requestUserInput", "item/tool/call", "attestation/generate"])
def test_server_request_handler_refuses(method):
    with pytest.raises(LookupError):
        make_server_request_handler(auto_approve=True)(method, {})


# ---------------------------------------------------------------------------------------------- close


STUBBORN = r"""
import json, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "300"])
open(sys.argv[1], "w").write(str(child.pid))
request = json.loads(sys.stdin.readline())
print(json.dumps({"id": request["id"], "result": {"userAgent": "stubborn"}}), flush=True)
sys.stdin.read()
while True:
    time.sleep(1)
"""


def test_close_kills_a_process_that_ignores_stdin_eof_and_its_children(tmp_path):
    child_pid_file = tmp_path / "child.pid"
    client = AppServerClient([sys.executable, "-c", STUBBORN, str(child_pid_file)], env={}, cwd=str(tmp_path))
    client.start()
    pid = client.pid
    child_pid = int(child_pid_file.read_text())
    started = time.monotonic()
    client.close(timeout=0.3)
    assert time.monotonic() - started < 3
    assert_no_process_left(pid)
    assert_dead_or_zombie(child_pid)
    client.close()  # idempotent
    with pytest.raises(TransportError):
        client.request("thread/start")


def test_close_of_a_cooperative_server_is_quick_and_clean(state_dir):
    client = scripted_client(state_dir)
    client.start()
    pid = client.pid
    started = time.monotonic()
    client.close()
    assert time.monotonic() - started < 1
    assert client._proc.returncode == 0  # exited on stdin EOF, not killed
    assert_no_process_left(pid)
    assert client.next_notification(timeout=0)["method"] == "remoteControl/status/changed"  # still drained
    with pytest.raises(TransportError):
        client.next_notification(timeout=0)


# ---------------------------------------------------------------------------------------------- real codex


def test_real_codex_handshake_thread_and_turn(codex_dirs, settings, real_codex_bin):
    """The real binary, launched exactly as the worker launches it (launch.py), on the project's
    model stand-in."""
    from devtools.model_stand_in import ModelStandIn
    from hermes_sessions.codex.launch import app_server_env, ensure_codex_home

    stand_in = ModelStandIn().start()
    settings.CODEX_BIN = real_codex_bin
    settings.CODEX_MODEL_PROVIDER = "stand-in"
    settings.CODEX_STAND_IN_URL = stand_in.base_url
    codex_home = ensure_codex_home()
    work = codex_dirs / "work"
    work.mkdir()
    env = app_server_env()
    client = AppServerClient(
        [real_codex_bin, "app-server"], env=env, cwd=str(work), request_timeout=30,
        server_request_handler=make_server_request_handler(),
    )
    with client:
        init = client.start()
        assert init["codexHome"] == str(codex_home)
        thread = client.request("thread/start", {"cwd": str(work)})["thread"]
        turn = client.request(
            "turn/start", {"threadId": thread["id"], "input": text_input("hello real codex")}
        )["turn"]
        notes = until_turn_completed(client, timeout=60)
        pid = client.pid

    completed = notes[-1]["params"]
    assert completed["threadId"] == thread["id"] and completed["turn"]["id"] == turn["id"]
    assert completed["turn"]["status"] == "completed", completed
    texts = [n["params"]["item"].get("text") for n in notes
             if n["method"] == "item/completed" and n["params"]["item"]["type"] == "agentMessage"]
    assert texts == ["echo: hello real codex"]
    assert "thread/tokenUsage/updated" in [n["method"] for n in notes]
    assert client.sent_methods == ["initialize", "thread/start", "turn/start"]
    assert_no_process_left(pid)
    assert len(stand_in.requests()) == 1
    stand_in.stop()


STRAY = r"""
import json, subprocess, sys
# A child in its own session keeps our stdout and stderr open after we exit.
child = subprocess.Popen(["sleep", "300"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
request = json.loads(sys.stdin.readline())
print(json.dumps({"id": request["id"], "result": {"userAgent": "stray"}}), flush=True)
sys.stdin.readline()  # the next request: die without answering
"""


def test_death_is_noticed_and_close_returns_while_a_stray_holds_stdout(tmp_path):
    child_pid_file = tmp_path / "child.pid"
    client = AppServerClient([sys.executable, "-c", STRAY, str(child_pid_file)], env={}, cwd=str(tmp_path))
    try:
        client.start()
        started = time.monotonic()
        with pytest.raises(TransportError) as info:
            client.request("thread/start", timeout=30)
        assert time.monotonic() - started < 5
        assert "still holds its stdout open" in str(info.value)
        started = time.monotonic()
        client.close(timeout=0.3)
        assert time.monotonic() - started < 3
        assert_no_process_left(client.pid)
    finally:
        os.kill(int(child_pid_file.read_text()), signal.SIGKILL)  # the stray we caused, by pid


def test_a_request_to_an_app_server_that_died_before_it_was_sent_says_it_was_not_sent(state_dir):
    """A kept app-server killed between turns (``e2e/test_affinity``): the next turn's ``turn/start`` is its
    first request, and it never reached codex — ``TransportError.sent`` is False, so the runner may run the
    turn again on a fresh app-server. A request that was written when codex died says ``sent``."""
    script = {"thread/loaded/list": [{"hang": True}]}
    with scripted_client(state_dir, script, request_timeout=30) as client:
        client.start()
        waiter: dict = {}
        thread = hanging_in_background(client, state_dir, waiter)
        os.kill(client._started().pid, signal.SIGKILL)
        thread.join(5)
        with pytest.raises(TransportError) as info:
            client.request("turn/start", {"threadId": "t", "input": text_input("hi")})
    assert waiter["exc"].sent is True  # written before codex died: it may have acted on it
    assert info.value.sent is False and retryable(info.value)
