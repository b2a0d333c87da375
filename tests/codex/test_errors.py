"""classify / is_thread_gone, one row per failure codex 0.169.0 was seen to produce (protocol.md §3.2, §6)."""
import pytest

from hermes_sessions.codex.errors import (
    CodexError,
    ErrorClass,
    JsonRpcError,
    RequestTimeout,
    TransportError,
    TurnTimeout,
    classify,
    is_thread_gone,
)

TID = "01a2283c-94e3-7b03-b6fc-1f6e4954ec81"


def rpc(code, message, method="thread/resume"):
    return JsonRpcError(method, code, message)


CASES = [
    # (exception, class, thread gone)
    (rpc(-32600, "no rollout found for thread id 3a71980c-6ec3-4335-8781-2e95cf463185"), ErrorClass.ROTATE, True),
    (rpc(-32600, f"no rollout found for thread id {TID}"), ErrorClass.ROTATE, True),
    (rpc(-32600, f"no rollout found for thread id {TID}", method="thread/fork"), ErrorClass.ROTATE, True),
    (rpc(-32600, f"thread {TID} already has an active writer"), ErrorClass.RETRY, False),
    (rpc(-32001, "Server overloaded; retry later."), ErrorClass.RETRY, False),
    (TransportError("codex app-server (pid 1, exit code 1) closed its stdout (EOF)"), ErrorClass.RETRY, False),
    (TransportError("codex app-server (pid 1) sent a frame too large", stderr_tail="x"), ErrorClass.RETRY, False),
    (RequestTimeout("thread/resume", 30.0), ErrorClass.RETRY, False),
    (
        rpc(-32600, f"session {TID} is archived. Run `codex unarchive {TID}` to unarchive it first."),
        ErrorClass.FAIL,
        False,
    ),
    (
        rpc(
            -32600,
            "invalid session id: invalid character: expected an optional prefix of `urn:uuid:` "
            "followed by [0-9a-fA-F-], found `n` at 1",
        ),
        ErrorClass.FAIL,
        False,
    ),
    (rpc(-32600, f"thread not found: {TID}", method="turn/start"), ErrorClass.FAIL, False),
    (rpc(-32600, "Invalid request: missing field `threadId`"), ErrorClass.FAIL, False),
    (rpc(-32600, "no active turn to interrupt", method="turn/interrupt"), ErrorClass.FAIL, False),
    (rpc(-32600, "Not initialized"), ErrorClass.FAIL, False),
    (rpc(-32603, "internal error"), ErrorClass.FAIL, False),
    (rpc(12345, "something new"), ErrorClass.FAIL, False),
    # The thread-gone message only counts with code -32600, and only as a prefix.
    (rpc(-32001, f"no rollout found for thread id {TID}"), ErrorClass.RETRY, False),
    (rpc(-32603, f"no rollout found for thread id {TID}"), ErrorClass.FAIL, False),
    (rpc(-32600, f"error: no rollout found for thread id {TID}"), ErrorClass.FAIL, False),
    (rpc(-32600, f"thread {TID} already has an active writer, and more"), ErrorClass.FAIL, False),
    (TurnTimeout("turn/completed never came", thread_id=TID, turn_id="t", timeout=600), ErrorClass.FAIL, False),
    (CodexError("could not start codex app-server"), ErrorClass.FAIL, False),
    (ValueError(f"no rollout found for thread id {TID}"), ErrorClass.FAIL, False),
]


def case_id(value):
    return str(value)[:60] if isinstance(value, BaseException) else None


@pytest.mark.parametrize(("exc", "expected", "gone"), CASES, ids=case_id)
def test_classify_and_is_thread_gone_per_observed_error(exc, expected, gone):
    assert classify(exc) is expected
    assert is_thread_gone(exc) is gone


def test_request_timeout_is_a_transport_error_with_method_and_timeout():
    exc = RequestTimeout("turn/start", 2.5, stderr_tail="WARN something")
    assert isinstance(exc, TransportError)
    assert (exc.method, exc.timeout, exc.stderr_tail) == ("turn/start", 2.5, "WARN something")
    assert "turn/start" in str(exc) and "WARN something" in str(exc)


def test_json_rpc_error_message_is_verbatim():
    exc = rpc(-32600, f"no rollout found for thread id {TID}")
    assert (exc.method, exc.code, exc.message, exc.data) == ("thread/resume", -32600, exc.message, None)
    assert f"-32600: no rollout found for thread id {TID}" in str(exc)
