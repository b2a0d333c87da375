"""Codex items become transcript rows (docs/contract.md §7), stored once."""
import json

import pytest

from hermes_sessions import services
from hermes_sessions.codex.projection import ItemProjector
from hermes_sessions.models import Message, Turn

pytestmark = pytest.mark.django_db(transaction=True)  # the worker heartbeat uses its own connection

ITEMS = [
    {"type": "reasoning", "id": "rs_1", "summary": ["thinking about it"], "content": [{"type": "text", "text": "deeper"}]},
    {"type": "commandExecution", "id": "call_1", "command": "/bin/bash -lc 'ls'", "cwd": "/w", "status": "completed",
     "aggregatedOutput": "a.txt\n", "exitCode": 0},
    {"type": "commandExecution", "id": "call_2", "command": "false", "cwd": "/w", "status": "failed",
     "aggregatedOutput": "", "exitCode": 1},
    {"type": "fileChange", "id": "fc_1", "status": "completed",
     "changes": [{"path": "/w/a.txt", "kind": {"type": "add"}, "diff": "+secret body"}]},
    {"type": "mcpToolCall", "id": "mcp_1", "server": "docs", "tool": "search", "arguments": {"q": "x"},
     "result": {"content": [{"type": "text", "text": "found"}]}, "error": None, "status": "completed"},
    {"type": "userMessage", "id": "u_1", "content": [{"type": "text", "text": "echo of the user"}]},
    {"type": "plan", "id": "p_1", "text": "ignored"},
]


def test_items_are_projected_into_tool_calls_results_and_reasoning(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    scripted_codex.script({"turn/start": [{"turn_items": ITEMS}]})
    turn = run_turn_now(session=session, text="do things", user=user)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error

    rows = list(Message.objects.filter(session=session).order_by("seq"))
    shape = [(m.role, m.codex_item_id) for m in rows]
    assert shape == [
        ("user", ""),
        ("assistant", "call_1"), ("tool", "call_1"),
        ("assistant", "call_2"), ("tool", "call_2"),
        ("assistant", "fc_1"), ("tool", "fc_1"),
        ("assistant", "mcp_1"), ("tool", "mcp_1"),
        ("assistant", rows[-1].codex_item_id),  # the final agentMessage
    ]
    assert [m.content for m in rows if m.role == "user"] == ["do things"]  # codex's echo is not stored twice
    exec_call = rows[1].tool_calls[0]
    assert exec_call["id"] == "codex_exec_call_1" and exec_call["function"]["name"] == "exec_command"
    assert json.loads(exec_call["function"]["arguments"]) == {"command": "/bin/bash -lc 'ls'", "cwd": "/w"}
    assert rows[1].reasoning == "thinking about it\ndeeper"  # reasoning attaches to the next assistant row
    assert (rows[2].tool_call_id, rows[2].content) == ("codex_exec_call_1", "a.txt\n")
    assert rows[4].content.startswith("[exit 1]")
    assert rows[5].tool_calls[0]["function"]["name"] == "apply_patch"
    assert "secret body" not in rows[5].tool_calls[0]["function"]["arguments"]  # no file bodies
    assert rows[6].content == "apply_patch status=completed, 1 change(s)"
    assert rows[7].tool_calls[0]["function"]["name"] == "mcp.docs.search"
    assert "found" in rows[8].content
    assert rows[-1].content == "echo: do things" == turn.final_text
    assert rows[-1].reasoning == ""


def test_a_repeated_item_is_projected_once():
    projector = ItemProjector()
    item = {"type": "agentMessage", "id": "msg_1", "text": "hi"}
    projector.add(item)
    projector.add(item)
    assert projector.messages == [{"role": "assistant", "content": "hi", "codex_item_id": "msg_1"}]


def test_nul_bytes_and_lone_surrogates_from_codex_are_stored_safely(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    bad = "out\x00put \ud800 end"
    scripted_codex.script({"turn/start": [{"turn_items": [
        {"type": "commandExecution", "id": "call_9", "command": "x\x00", "cwd": "/w", "status": "completed",
         "aggregatedOutput": bad, "exitCode": 0},
    ]}]})
    turn = run_turn_now(session=session, text="nul \x00 in input", user=user)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    tool_row = Message.objects.get(session=session, role="tool")
    assert tool_row.content == "out\ufffdput \ufffd end"
    assert Message.objects.get(session=session, role="user").content == "nul \ufffd in input"


def test_approval_requests_are_declined_by_default(user, scripted_codex, run_turn_now):
    import json as _json

    session = services.session_create(owner=user)
    request = {"method": "item/commandExecution/requestApproval",
               "params": {"itemId": "call_1", "command": "rm -rf /", "cwd": "/"}}
    scripted_codex.script({"turn/start": [{"server_request": request}]})
    turn = run_turn_now(session=session, text="do it", user=user)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    answers = [_json.loads(line) for line in (scripted_codex.state / "server_answers.jsonl").read_text().splitlines()]
    assert [a["answer"].get("result") for a in answers] == [{"decision": "decline"}]
