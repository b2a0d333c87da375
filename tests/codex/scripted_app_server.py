#!/usr/bin/env python3
"""A scripted stand-in for ``codex app-server`` (codex 0.169.0), for unit tests. Stdlib only.

Run as ``[sys.executable, __file__]``. Speaks newline-delimited JSON-RPC on stdin/stdout with the message
shapes of real codex 0.169.0 transcripts (``docs/codex.md`` §2–§6), abridged: handshake (``Not initialized`` /
``Already initialized``), ``thread/start``, ``thread/resume``, ``turn/start``, ``turn/interrupt``,
``thread/unsubscribe``, ``thread/loaded/list``, ``thread/turns/list`` (newest first; the userMessage item
carries ``clientId`` = turn/start's ``clientUserMessageId``); other methods get ``-32600 Invalid request: unknown variant``.

State lives in the directory named by env ``SCRIPTED_STATE_DIR`` so a "restart" is a new process on it:

* ``$CODEX_HOME/sessions/…/rollout-<ts>-<thread id>.jsonl`` (``rollouts/`` in the state directory when
  ``CODEX_HOME`` is unset): one line per turn (written at ``turn/start``), found by name at any depth
  as codex does; ``thread/resume`` of a
  thread without one answers ``-32600 no rollout found for thread id <id>``. ``turn/start`` on a thread this
  process has not started or resumed answers ``-32600 thread not found: <id>``.
* ``argv.jsonl``: each process's command-line arguments, ``{"pid", "argv"}``.
* ``methods.jsonl``: every request received, ``{"pid", "method", "params"}``, written before any fault acts.
* ``server_answers.jsonl``: the client's answer to each scripted server request ``{"method", "answer"}``.
* ``script.json``: faults, ``{method: [action, ...]}``. Each call of ``method`` consumes the next action
  (counts persist in ``script_consumed.json``, so across processes); once exhausted the method behaves
  normally. The file is re-read at every request. One action may combine keys; they act in this order:

  ``{"stderr_lines": N}``      write N lines to stderr first
  ``{"notification": {...}}``  emit this (e.g. unknown) notification first
  ``{"raw_line": "text"}``     write this raw line to stdout first (non-JSON / oversized frame tests)
  ``{"exit": code}``           exit at once with ``code``, without answering
  ``{"hang": true}``           never answer this request (later requests are still served)
  ``{"error": {"code", "message"}}``  answer with this error; ``{thread_id}`` in the message is replaced
                               by ``params.threadId``
  turn/start only:
  ``{"turn_items": [item, ...]}``  emit these ThreadItems as ``item/completed`` before the agentMessage
  ``{"turn_status": "failed", "turn_error": {"message": ...}}``  ``error`` notification, then
                               ``turn/completed`` with status failed (no agentMessage)
  ``{"server_request": {"method", "params"}}``  send this request mid-turn, wait for the answer, record it
                               (other requests, except turn/start, are served meanwhile)
  ``{"exit_mid_turn": code}``  ack, emit ``turn_items``, then exit with ``code`` (dies during a turn)
  ``{"no_completion": true}``  ack and emit items, but never send ``turn/completed`` (``turn/interrupt``
                               then ends it with status ``interrupted``)
  ``{"respond_last": true}``   send the whole turn (``turn/started`` … ``turn/completed``) first and the
                               ``turn/start`` response after it (the reader sees the turn before its id)
  thread/start and thread/resume:
  ``{"active_profile": "id"}``  report this ``activePermissionProfile.id`` (default: the one the command
                               line selects with ``-c default_permissions="…"``, as codex does; none without)
  any method:
  ``{"exit_after": code}``     answer normally, then exit at once with ``code``

Closing stdin ends the process with exit code 0.
"""

import collections
import glob
import json
import os
import sys
import tempfile
import time
import uuid

STATE = os.environ.get("SCRIPTED_STATE_DIR") or tempfile.mkdtemp(prefix="scripted-app-server-")
ROLLOUTS = os.path.join(os.environ["CODEX_HOME"], "sessions") if os.environ.get("CODEX_HOME") else os.path.join(STATE, "rollouts")
os.makedirs(ROLLOUTS, exist_ok=True)

def _profile_from_argv(argv):
    """``-c default_permissions="<id>"`` on the command line (``launch.permission_overrides``), as codex
    reports it in ``activePermissionProfile``; ``None`` without one."""
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == "-c" and value.startswith("default_permissions="):
            return json.loads(value.split("=", 1)[1])
    return None


PROFILE = _profile_from_argv(sys.argv)
loaded_threads = set()
active_turns = {}  # thread id -> turn id of a turn left running by no_completion
inbox = collections.deque()  # client messages read while waiting for a server-request answer
initialized = False
next_server_request_id = 0


def now_ms():
    return int(time.time() * 1000)


def append_jsonl(name, record):
    with open(os.path.join(STATE, name), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


def load_json(name, default):
    try:
        with open(os.path.join(STATE, name), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def save_json(name, value):
    path = os.path.join(STATE, name)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(value, fh)
    os.replace(path + ".tmp", path)


def write(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def respond(request_id, result):
    write({"id": request_id, "result": result})


def respond_error(request_id, code, message):
    write({"id": request_id, "error": {"code": code, "message": message}})


def notify(method, params):
    write({"method": method, "params": params, "emittedAtMs": now_ms()})


def read_message():
    """Next client message (dict), or None at EOF. Non-JSON input is ignored, as the real server logs it."""
    if inbox:
        return inbox.popleft()
    while True:
        line = sys.stdin.buffer.readline()
        if not line:
            return None
        try:
            message = json.loads(line)
        except ValueError:
            print("scripted-app-server: ignoring non-JSON input", file=sys.stderr, flush=True)
            continue
        if isinstance(message, dict):
            return message


def next_action(method):
    script = load_json("script.json", {})
    actions = script.get(method) or []
    consumed = load_json("script_consumed.json", {})
    index = consumed.get(method, 0)
    if index >= len(actions):
        return {}
    consumed[method] = index + 1
    save_json("script_consumed.json", consumed)
    return actions[index]


def rollout_path(thread_id):
    """The existing rollout of the thread (any depth, by name, as codex finds it), else where a new one goes."""
    if os.environ.get("CODEX_HOME"):
        found = sorted(glob.glob(os.path.join(ROLLOUTS, "**", f"rollout-*-{thread_id}.jsonl"), recursive=True))
        return found[0] if found else os.path.join(ROLLOUTS, "2026", "01", "01", f"rollout-2026-01-01T00-00-00-{thread_id}.jsonl")
    return os.path.join(ROLLOUTS, f"{thread_id}.jsonl")


def read_rollout(thread_id):
    with open(rollout_path(thread_id), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def thread_obj(thread_id, cwd, turns):
    created = int(time.time())
    preview = ""
    if turns:
        preview = turns[0]["items"][0]["content"][0]["text"]
    return {
        "id": thread_id, "sessionId": thread_id, "forkedFromId": None, "parentThreadId": None,
        "preview": preview, "ephemeral": False, "historyMode": "paginated", "modelProvider": "fake",
        "model": "mock-model", "reasoningEffort": None, "createdAt": created, "updatedAt": created,
        "status": {"type": "idle"}, "path": rollout_path(thread_id), "cwd": cwd, "cliVersion": "0.169.0",
        "originator": "scripted", "source": "vscode", "gitInfo": None, "name": None, "turns": turns,
    }


def session_result(thread, params, action=None):
    profile = (action or {}).get("active_profile", PROFILE)
    extra = {"activePermissionProfile": {"id": profile, "extends": None}} if profile else {}
    return {**extra,
        "thread": thread, "model": params.get("model") or "mock-model", "modelProvider": "fake",
        "serviceTier": None, "cwd": thread["cwd"], "approvalPolicy": params.get("approvalPolicy") or "never",
        "approvalsReviewer": "user", "sandbox": {"type": "readOnly", "networkAccess": False},
        "reasoningEffort": None,
    }


def turn_obj(turn_id, status, items=(), error=None, items_view="notLoaded"):
    return {
        "id": turn_id, "rootTurnId": turn_id, "items": list(items), "itemsView": items_view, "status": status,
        "error": error, "startedAt": int(time.time()), "completedAt": None, "durationMs": None,
    }


def user_text(params):
    texts = [part.get("text", "") for part in params.get("input") or [] if part.get("type") == "text"]
    return texts[-1] if texts else ""


def ask_client(method, params):
    """Send a server request and wait for its answer (other client messages are kept for later)."""
    global next_server_request_id
    request_id = next_server_request_id
    next_server_request_id += 1
    write({"id": request_id, "method": method, "params": params})
    while True:
        line = sys.stdin.buffer.readline()
        if not line:
            sys.exit(0)
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if not isinstance(message, dict):
            continue
        if message.get("id") == request_id and "method" not in message:
            return message
        if "id" in message and message.get("method") not in (None, "turn/start"):
            process_request(message)  # like codex, keep serving other requests while waiting
        else:
            inbox.append(message)


def token_usage(thread_id, turn_id):
    turns = read_rollout(thread_id)
    last = turns[-1]["usage"]
    total = {key: sum(t["usage"][key] for t in turns) for key in last}
    return {"threadId": thread_id, "turnId": turn_id,
            "tokenUsage": {"total": total, "last": last, "modelContextWindow": 258400}}


def canonical(thread_id):
    """codex parses thread ids as UUIDs and answers in their canonical lower-case spelling."""
    return thread_id.lower() if isinstance(thread_id, str) else thread_id


def codex_marker(items, cut_off):
    """What codex's own rollout would show of the turn (``rollout_files.Leftover.shows_work``): its
    ``task_complete``, or the first item beyond talk it completed; nothing for a turn that only talked."""
    acted = [i["type"] for i in items if i.get("type") not in ("userMessage", "agentMessage", "reasoning")]
    if not cut_off:
        return {"type": "event_msg", "payload": {"type": "task_complete"}}
    if acted:
        return {"type": "event_msg", "payload": {"type": "item_completed", "item": {"type": acted[0][:1].upper() + acted[0][1:]}}}
    return {}


def handle_turn_start(request_id, params, action):
    thread_id = canonical(params.get("threadId"))
    if thread_id not in loaded_threads:
        return respond_error(request_id, -32600, f"thread not found: {thread_id}")
    if thread_id in active_turns:  # steering into the running turn, as codex 0.169 does
        return respond(request_id, {"turn": turn_obj(active_turns[thread_id], "inProgress")})
    turn_id = str(uuid.uuid4())
    text = user_text(params)
    reply = f"echo: {text}"
    user_item = {"type": "userMessage", "id": str(uuid.uuid4()), "clientId": params.get("clientUserMessageId"),
                 "content": [{"type": "text", "text": text, "text_elements": []}]}
    agent_item = {"type": "agentMessage", "id": f"msg_{uuid.uuid4().hex[:16]}", "text": reply, "phase": None}
    failed = action.get("turn_status") == "failed"
    usage = {"totalTokens": 100 + len(text) + len(reply.split()), "inputTokens": 100 + len(text),
             "cachedInputTokens": 0, "outputTokens": len(reply.split()), "reasoningOutputTokens": 0}
    cut_off = failed or action.get("no_completion") or "exit_mid_turn" in action
    items = [user_item] + list(action.get("turn_items") or []) + ([] if cut_off else [agent_item])
    os.makedirs(os.path.dirname(rollout_path(thread_id)), exist_ok=True)
    with open(rollout_path(thread_id), "a", encoding="utf-8") as fh:
        status = "failed" if failed else "interrupted" if cut_off else "completed"
        line = {"id": turn_id, "items": items, "usage": usage, "status": status, **codex_marker(items, cut_off)}
        fh.write(json.dumps(line) + "\n")

    ack = {"turn": turn_obj(turn_id, "inProgress")}
    if not action.get("respond_last"):
        respond(request_id, ack)
    ids = {"threadId": thread_id, "turnId": turn_id}
    notify("thread/status/changed", {"threadId": thread_id, "status": {"type": "active", "activeFlags": []}})
    notify("turn/started", {"threadId": thread_id, "turn": turn_obj(turn_id, "inProgress")})
    notify("item/started", {"item": user_item, **ids, "startedAtMs": now_ms()})
    notify("item/completed", {"item": user_item, **ids, "completedAtMs": now_ms()})
    if "server_request" in action:
        asked = action["server_request"]
        answer = ask_client(asked["method"], {**ids, **(asked.get("params") or {})})
        append_jsonl("server_answers.jsonl", {"method": asked["method"], "answer": answer})
        notify("serverRequest/resolved", {"threadId": thread_id, "requestId": answer.get("id")})
    for item in action.get("turn_items") or []:
        notify("item/completed", {"item": item, **ids, "completedAtMs": now_ms()})
    if "exit_mid_turn" in action:  # the process dies after the ack and some items
        sys.stdout.flush()
        os._exit(int(action["exit_mid_turn"]))
    if action.get("no_completion"):
        active_turns[thread_id] = turn_id
        return None
    if failed:
        error = {"message": "scripted failure", "codexErrorInfo": "other", "additionalDetails": None,
                 **(action.get("turn_error") or {})}
        notify("error", {"error": error, "willRetry": False, **ids})
        notify("thread/status/changed", {"threadId": thread_id, "status": {"type": "systemError"}})
        return notify("turn/completed", {"threadId": thread_id, "turn": turn_obj(turn_id, "failed", error=error)})
    notify("item/started", {"item": {**agent_item, "text": ""}, **ids, "startedAtMs": now_ms()})
    notify("item/agentMessage/delta", {**ids, "itemId": agent_item["id"], "delta": reply})
    notify("item/completed", {"item": agent_item, **ids, "completedAtMs": now_ms()})
    notify("thread/tokenUsage/updated", token_usage(thread_id, turn_id))
    notify("thread/status/changed", {"threadId": thread_id, "status": {"type": "idle"}})
    notify("turn/completed", {"threadId": thread_id,
                              "turn": turn_obj(turn_id, "completed", [agent_item], items_view="summary")})
    if action.get("respond_last"):
        respond(request_id, ack)
    return None


def handle_initialize(request_id, params, action):
    global initialized
    if initialized:
        return respond_error(request_id, -32600, "Already initialized")
    initialized = True
    name = (params.get("clientInfo") or {}).get("name", "client")
    respond(request_id, {"userAgent": f"{name}/0.169.0 (scripted)", "codexHome": STATE,
                         "platformFamily": "unix", "platformOs": "linux"})
    return notify("remoteControl/status/changed", {"status": "disabled"})


def handle_thread_start(request_id, params, action):
    thread = thread_obj(str(uuid.uuid4()), params.get("cwd") or os.getcwd(), [])
    loaded_threads.add(thread["id"])
    respond(request_id, session_result(thread, params, action))
    return notify("thread/started", {"thread": thread})


def handle_thread_resume(request_id, params, action):
    thread_id = canonical(params.get("threadId"))
    if not thread_id:
        return respond_error(request_id, -32600, "Invalid request: missing field `threadId`")
    if not os.path.exists(rollout_path(thread_id)):
        return respond_error(request_id, -32600, f"no rollout found for thread id {thread_id}")
    turns = [] if params.get("excludeTurns") else [
        {**turn_obj(t["id"], t["status"], t["items"], items_view="full")} for t in read_rollout(thread_id)
    ]
    loaded_threads.add(thread_id)
    notify("thread/status/changed", {"threadId": thread_id, "status": {"type": "idle"}})
    return respond(request_id, session_result(thread_obj(thread_id, params.get("cwd") or os.getcwd(), turns), params, action))


def handle_turn_interrupt(request_id, params, action):
    thread_id = params.get("threadId")
    turn_id = active_turns.pop(thread_id, None)
    if turn_id is None:
        return respond_error(request_id, -32600, "no active turn to interrupt")
    respond(request_id, {})
    notify("thread/status/changed", {"threadId": thread_id, "status": {"type": "idle"}})
    return notify("turn/completed", {"threadId": thread_id, "turn": turn_obj(turn_id, "interrupted")})


def handle_thread_unsubscribe(request_id, params, action):
    loaded_threads.discard(params.get("threadId"))
    return respond(request_id, {})


def handle_thread_turns_list(request_id, params, action):  # newest first, as codex 0.169.0 defaults to
    thread_id = params.get("threadId")
    if not os.path.exists(rollout_path(thread_id)):
        return respond_error(request_id, -32600, f"no rollout found for thread id {thread_id}")
    turns = [turn_obj(t["id"], t["status"], t["items"], items_view="full") for t in read_rollout(thread_id)]
    return respond(request_id, {"data": turns[::-1][: params.get("limit") or None], "nextCursor": None,
                                "backwardsCursor": None})


def handle_thread_loaded_list(request_id, params, action):
    return respond(request_id, {"data": sorted(loaded_threads), "nextCursor": None})


HANDLERS = {
    "thread/start": handle_thread_start,
    "thread/resume": handle_thread_resume,
    "turn/start": handle_turn_start,
    "turn/interrupt": handle_turn_interrupt,
    "thread/unsubscribe": handle_thread_unsubscribe,
    "thread/turns/list": handle_thread_turns_list,
    "thread/loaded/list": handle_thread_loaded_list,
}


def handle_request(request_id, method, params, action):
    if method == "initialize":
        return handle_initialize(request_id, params, action)
    if not initialized:
        return respond_error(request_id, -32600, "Not initialized")
    handler = HANDLERS.get(method)
    if handler is None:
        return respond_error(request_id, -32600, f"Invalid request: unknown variant `{method}`")
    return handler(request_id, params, action)


def process_request(message):
    """Log the request, apply its scripted action (if any), then answer it normally."""
    request_id, method = message["id"], message["method"]
    append_jsonl("methods.jsonl", {"pid": os.getpid(), "method": method, "params": message.get("params")})
    if "params" not in message:
        return respond_error(request_id, -32600, "Invalid request: missing field `params`")
    params = message["params"] or {}
    action = next_action(method)
    for n in range(int(action.get("stderr_lines", 0))):
        print(f"scripted-app-server: stderr line {n + 1} of {action['stderr_lines']} ({method})",
              file=sys.stderr, flush=True)
    if "notification" in action:
        write(action["notification"])
    if "raw_line" in action:
        sys.stdout.write(action["raw_line"] + "\n")
        sys.stdout.flush()
    if "exit" in action:
        sys.stdout.flush()
        os._exit(int(action["exit"]))
    if action.get("hang"):
        return None
    if "error" in action:
        error = action["error"]
        text = str(error.get("message", "")).replace("{thread_id}", str(params.get("threadId")))
        return respond_error(request_id, int(error.get("code", -32600)), text)
    handle_request(request_id, method, params, action)
    if "exit_after" in action:
        sys.stdout.flush()
        os._exit(int(action["exit_after"]))
    return None


def main():
    append_jsonl("argv.jsonl", {"pid": os.getpid(), "argv": sys.argv[1:]})
    while True:
        message = read_message()
        if message is None:
            return 0
        if "method" in message and "id" in message:
            process_request(message)
        # else: notifications (initialized) and stray responses need no answer


if __name__ == "__main__":
    sys.exit(main())
