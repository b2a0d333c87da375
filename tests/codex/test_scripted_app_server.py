"""The scripted stand-in behaves like codex 0.169.0 where turn-runner tests rely on it."""
import json

import pytest

from hermes_sessions.codex.errors import JsonRpcError, ThreadGone, TransportError

from .test_client import read_jsonl, scripted_client, text_input, until_turn_completed


def start_turn_and_wait(client, thread_id, text):
    client.request("turn/start", {"threadId": thread_id, "input": text_input(text)})
    return until_turn_completed(client)


def test_restart_needs_resume_and_resume_returns_the_rollout(state_dir):
    with scripted_client(state_dir) as first:
        first.start()
        thread_id = first.request("thread/start")["thread"]["id"]
        start_turn_and_wait(first, thread_id, "hello one")

    with scripted_client(state_dir) as second:
        second.start()
        with pytest.raises(JsonRpcError) as info:
            second.request("turn/start", {"threadId": thread_id, "input": text_input("hello two")})
        assert (info.value.code, info.value.message) == (-32600, f"thread not found: {thread_id}")
        thread = second.request("thread/resume", {"threadId": thread_id})["thread"]
        [turn] = thread["turns"]
        assert [i["type"] for i in turn["items"]] == ["userMessage", "agentMessage"]
        assert turn["items"][1]["text"] == "echo: hello one"
        notes = start_turn_and_wait(second, thread_id, "hello two")
        usage = next(n for n in notes if n["method"] == "thread/tokenUsage/updated")["params"]["tokenUsage"]
        assert usage["total"]["totalTokens"] > usage["last"]["totalTokens"]  # both turns counted

    pids = {m["pid"] for m in read_jsonl(state_dir / "methods.jsonl")}
    assert len(pids) == 2


def test_thread_without_a_turn_is_gone_after_restart(state_dir):
    with scripted_client(state_dir) as first:
        first.start()
        thread_id = first.request("thread/start")["thread"]["id"]
    with scripted_client(state_dir) as second:
        second.start()
        with pytest.raises(JsonRpcError) as info:
            second.request("thread/resume", {"threadId": thread_id})
        assert isinstance(info.value, ThreadGone)


def test_script_actions_are_consumed_across_processes(state_dir):
    writer = {"error": {"code": -32600, "message": "thread {thread_id} already has an active writer"}}
    script = {"thread/resume": [writer, {"exit": 1}]}
    with scripted_client(state_dir, script) as client:
        client.start()
        with pytest.raises(JsonRpcError) as info:
            client.request("thread/resume", {"threadId": "t-1"})
        assert info.value.message == "thread t-1 already has an active writer"
    with scripted_client(state_dir) as client:
        client.start()
        with pytest.raises(TransportError):
            client.request("thread/resume", {"threadId": "t-1"})
    with scripted_client(state_dir) as client:
        client.start()
        with pytest.raises(JsonRpcError) as info:  # script exhausted: normal behaviour
            client.request("thread/resume", {"threadId": "t-1"})
        assert isinstance(info.value, ThreadGone)
    assert json.loads((state_dir / "script_consumed.json").read_text()) == {"thread/resume": 2}


def test_turn_items_failed_turn_and_interrupt(state_dir):
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": ["thinking"], "content": []}
    script = {
        "turn/start": [
            {"turn_items": [reasoning]},
            {"turn_status": "failed", "turn_error": {"message": "Connection failed: error sending request"}},
            {"no_completion": True},
        ]
    }
    with scripted_client(state_dir, script) as client:
        client.start()
        thread_id = client.request("thread/start")["thread"]["id"]
        notes = start_turn_and_wait(client, thread_id, "a")
        completed = [n["params"]["item"]["type"] for n in notes if n["method"] == "item/completed"]
        assert completed == ["userMessage", "reasoning", "agentMessage"]

        notes = start_turn_and_wait(client, thread_id, "b")
        assert [n["method"] for n in notes][-3:] == ["error", "thread/status/changed", "turn/completed"]
        turn = notes[-1]["params"]["turn"]
        assert (turn["status"], turn["error"]["message"]) == ("failed", "Connection failed: error sending request")

        turn_id = client.request("turn/start", {"threadId": thread_id, "input": text_input("c")})["turn"]["id"]
        assert client.request("turn/interrupt", {"threadId": thread_id, "turnId": turn_id}) == {}
        turn = until_turn_completed(client)[-1]["params"]["turn"]
        assert (turn["id"], turn["status"]) == (turn_id, "interrupted")
        with pytest.raises(JsonRpcError) as info:
            client.request("turn/interrupt", {"threadId": thread_id, "turnId": turn_id})
        assert info.value.message == "no active turn to interrupt"


def test_whole_turn_before_the_turn_start_response_then_exit(state_dir):
    """The stand-in can send the turn before its ``turn/start`` answer and die right after; the client
    still returns the answer and hands out every queued notification before reporting the EOF."""
    with scripted_client(state_dir, {"turn/start": [{"respond_last": True, "exit_after": 0}]}) as client:
        client.start()
        thread_id = client.request("thread/start")["thread"]["id"]
        turn_id = client.request("turn/start", {"threadId": thread_id, "input": text_input("a")})["turn"]["id"]
        notes = until_turn_completed(client)
        assert notes[-1]["params"]["turn"]["id"] == turn_id
        assert "turn/started" in [n["method"] for n in notes]
        with pytest.raises(TransportError):
            client.next_notification(timeout=5)
