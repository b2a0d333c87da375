"""error_from_response / retryable: one row per answer codex 0.169.0 was seen to give (docs/codex.md §6),
and the edges where the text or code is only nearly right."""
import pytest

from hermes_sessions.codex import errors
from hermes_sessions.codex.errors import (
    CodexError,
    CodexStateDamaged,
    InvalidThreadId,
    JsonRpcError,
    Overloaded,
    RequestTimeout,
    ThreadArchived,
    ThreadBusy,
    ThreadGone,
    ThreadNotLoaded,
    TransportError,
    TurnTimeout,
    error_from_response,
    retryable,
    turn_error_text,
)

TID = "01a2283c-94e3-7b03-b6fc-1f6e4954ec81"


def answer(code, message, method="thread/resume"):
    return error_from_response(method, {"code": code, "message": message})


# (method, error member, exact type, retryable) — the module docstring's table, row by row.
RESPONSES = [
    ("thread/resume", {"code": -32600, "message": "no rollout found for thread id 3a71980c-6ec3-4335-8781-2e95cf463185"},
     ThreadGone, False),
    ("thread/resume", {"code": -32600, "message": f"no rollout found for thread id {TID}"}, ThreadGone, False),
    ("thread/fork", {"code": -32600, "message": f"no rollout found for thread id {TID}"}, ThreadGone, False),
    ("thread/resume", {"code": -32600, "message": f"thread {TID} already has an active writer"}, ThreadBusy, True),
    ("thread/resume", {"code": -32001, "message": "Server overloaded; retry later."}, Overloaded, True),
    ("turn/start", {"code": -32001, "message": "Server overloaded; retry later."}, Overloaded, True),
    ("turn/start", {"code": -32600, "message": f"thread not found: {TID}"}, ThreadNotLoaded, False),
    ("thread/resume",
     {"code": -32600, "message": f"session {TID} is archived. Run `codex unarchive {TID}` to unarchive it first."},
     ThreadArchived, False),
    ("thread/resume",
     {"code": -32600, "message": "invalid session id: invalid character: expected an optional prefix of `urn:uuid:` "
                                 "followed by [0-9a-fA-F-], found `n` at 1"},
     InvalidThreadId, False),
    ("thread/resume", {"code": -32600, "message": "Invalid request: missing field `threadId`"}, JsonRpcError, False),
    ("turn/interrupt", {"code": -32600, "message": "no active turn to interrupt"}, JsonRpcError, False),
    ("thread/start", {"code": -32600, "message": "Not initialized"}, JsonRpcError, False),
    ("thread/resume", {"code": -32603, "message": "internal error"}, JsonRpcError, False),
    # codex 0.171.0, a truncated thread_history_1.sqlite (tests/e2e/test_real_codex_faults.py)
    ("thread/resume",
     {"code": -32603, "message": "failed to list thread history: thread-store internal error: failed to open thread "
                                 "history database: failed to open thread history DB at /h/thread_history_1.sqlite: "
                                 "error returned from database: (code: 11) database disk image is malformed"},
     CodexStateDamaged, True),
    ("thread/resume", {"code": -32603, "message": "failed to open state db: (code: 26) file is not a database"},
     CodexStateDamaged, True),
    ("thread/resume", {"code": -32600, "message": "database disk image is malformed"}, JsonRpcError, False),
    ("thread/resume", {"code": 12345, "message": "something new"}, JsonRpcError, False),
    # The code decides first: overload whatever the text; the -32600 texts only with -32600 …
    ("thread/resume", {"code": -32001, "message": f"no rollout found for thread id {TID}"}, Overloaded, True),
    ("thread/resume", {"code": -32603, "message": f"no rollout found for thread id {TID}"}, JsonRpcError, False),
    ("turn/start", {"code": -32603, "message": f"thread not found: {TID}"}, JsonRpcError, False),
    # … and only as the exact prefix (and suffix).
    ("thread/resume", {"code": -32600, "message": f"error: no rollout found for thread id {TID}"}, JsonRpcError, False),
    ("thread/resume", {"code": -32600, "message": f"thread {TID} already has an active writer, and more"},
     JsonRpcError, False),
    ("thread/resume", {"code": -32600, "message": f"session {TID} is archived"}, JsonRpcError, False),
    # Malformed error members still give an error, never a crash.
    ("thread/resume", "plain string error", JsonRpcError, False),
    ("thread/resume", {"code": "-32600", "message": f"no rollout found for thread id {TID}"}, JsonRpcError, False),
    ("thread/resume", {"code": True, "message": "x"}, JsonRpcError, False),
    ("thread/resume", {}, JsonRpcError, False),
]


def row_id(value):
    return str(value)[:60] if isinstance(value, dict | str) else None


@pytest.mark.parametrize(("method", "error", "expected", "retry"), RESPONSES, ids=row_id)
def test_error_from_response_types_each_observed_answer(method, error, expected, retry):
    exc = error_from_response(method, error)
    assert type(exc) is expected
    assert retryable(exc) is retry
    assert exc.method == method


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (TransportError("codex app-server (pid 1, exit code 1) closed its stdout (EOF)"), True),
        (TransportError("codex app-server (pid 1) sent a frame too large", stderr_tail="x"), True),
        (RequestTimeout("thread/resume", 30.0), True),
        (TurnTimeout("turn/completed never came", thread_id=TID, turn_id="t", timeout=600), False),
        (CodexError("could not start codex app-server"), False),
        (ValueError(f"no rollout found for thread id {TID}"), False),
    ],
    ids=row_id,
)
def test_retryable_is_decided_by_type_alone(exc, retry):
    assert retryable(exc) is retry


def test_every_typed_answer_is_a_json_rpc_error_with_the_verbatim_fields():
    exc = error_from_response("thread/resume", {"code": -32600, "message": f"no rollout found for thread id {TID}",
                                                "data": {"x": 1}})
    assert isinstance(exc, JsonRpcError) and isinstance(exc, CodexError)
    assert (exc.method, exc.code, exc.message, exc.data) == (
        "thread/resume", -32600, f"no rollout found for thread id {TID}", {"x": 1})
    assert f"-32600: no rollout found for thread id {TID}" in str(exc)


def test_a_missing_or_non_integer_code_reads_as_zero():
    assert answer(None, "x").code == 0
    assert error_from_response("m", "just text").message == "just text"


def test_request_timeout_is_a_transport_error_with_method_and_timeout():
    exc = RequestTimeout("turn/start", 2.5, stderr_tail="WARN something")
    assert isinstance(exc, TransportError)
    assert (exc.method, exc.timeout, exc.stderr_tail) == ("turn/start", 2.5, "WARN something")
    assert "turn/start" in str(exc) and "WARN something" in str(exc)


def test_the_docstring_table_names_every_typed_error():
    """The table in errors.py is the contract; a new type must get its row."""
    table = errors.__doc__ or ""
    for exc_type in (ThreadGone, ThreadBusy, Overloaded, TransportError, RequestTimeout, ThreadNotLoaded,
                     ThreadArchived, InvalidThreadId, JsonRpcError, CodexError):
        assert f":class:`{exc_type.__name__}`" in table, exc_type.__name__


# --- turn_error_text: a failed turn's TurnError (docs/codex.md §4, shapes measured on codex 0.171.0) ---

HIGH_DEMAND = "We’re currently experiencing high demand, which may cause temporary errors."


@pytest.mark.parametrize(("error", "expected"), [
    ({"message": HIGH_DEMAND, "codexErrorInfo": "internalServerError", "additionalDetails": None},
     f"the model call failed with HTTP 500 (codex: internalServerError): {HIGH_DEMAND}"),
    ({"message": "unexpected status 401 Unauthorized: bad key", "codexErrorInfo": {"httpConnectionFailed": {"httpStatusCode": 401}}},
     "the model call failed with HTTP 401 (codex: httpConnectionFailed): unexpected status 401 Unauthorized: bad key"),
    ({"message": "exceeded retry limit, last status: 429 Too Many Requests",
      "codexErrorInfo": {"responseTooManyFailedAttempts": {"httpStatusCode": 429}}},
     "the model call failed with HTTP 429 (codex: responseTooManyFailedAttempts): exceeded retry limit, last status: 429 Too Many Requests"),
    # no status known: codex's text, with its kind and details
    ({"message": "Reconnecting... waiting for network", "additionalDetails": "Connection failed: error sending request",
      "codexErrorInfo": {"responseStreamDisconnected": {"httpStatusCode": None}}},
     "Reconnecting... waiting for network (Connection failed: error sending request) (codex: responseStreamDisconnected)"),
    ({"message": "Missing environment variable", "codexErrorInfo": "other"}, "Missing environment variable (codex: other)"),
    ({"message": "plain"}, "plain"),
    ("a bare string", "a bare string"),
    (None, ""),
    ({}, ""),
    # a status on a variant we do not know, or a bool, is not taken for an HTTP status
    ({"message": "m", "codexErrorInfo": {"somethingNew": {"httpStatusCode": 500}}}, "m (codex: somethingNew)"),
    ({"message": "m", "codexErrorInfo": {"httpConnectionFailed": {"httpStatusCode": True}}}, "m (codex: httpConnectionFailed)"),
])
def test_turn_error_text_names_the_http_status_codex_saw(error, expected):
    assert turn_error_text(error) == expected
