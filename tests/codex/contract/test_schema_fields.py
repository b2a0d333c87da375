"""Every field the runner (``hermes_sessions/codex/runner.py``) and the projection (``projection.py``)
read from codex exists in the pinned codex's schema, under the method the code expects it on.

A rename in a new codex version fails here with the field's name. Add a row when the code starts
reading a new field.
"""
from __future__ import annotations

import pytest
from jsonschema import Draft7Validator

from hermes_sessions.codex.errors import IMPLIED_STATUS, STATUS_VARIANTS

from .support import KNOWN_SERVER_REQUESTS, CodexSchema, FieldMissing

# (method, what, path): ``what`` is response (the result of our request), notification, or
# server-request (its params). Path syntax: see ``CodexSchema.field``.
READ_FIELDS = [
    # runner._thread_id / _open_thread: the thread's id, codex's spelling
    ("thread/start", "response", "thread.id"),
    ("thread/resume", "response", "thread.id"),
    # drive_turn: the codex turn id notifications are matched against
    ("turn/start", "response", "turn.id"),
    # runner._adopt_completed_turn: find our turn by the clientId codex keeps on its userMessage
    ("thread/turns/list", "response", "data[].id"),
    ("thread/turns/list", "response", "data[].status"),
    ("thread/turns/list", "response", "data[].items[]{userMessage}.clientId"),
    # runner._scope: which thread and turn a notification belongs to
    ("item/completed", "notification", "threadId"),
    ("item/completed", "notification", "turnId"),
    ("turn/completed", "notification", "threadId"),
    ("turn/completed", "notification", "turn.id"),
    ("thread/tokenUsage/updated", "notification", "threadId"),
    ("thread/tokenUsage/updated", "notification", "turnId"),
    ("error", "notification", "threadId"),
    ("error", "notification", "turnId"),
    # runner._drive
    ("item/completed", "notification", "item"),
    ("turn/completed", "notification", "turn.status"),
    ("turn/completed", "notification", "turn.error.message"),
    ("error", "notification", "error.message"),
    ("error", "notification", "willRetry"),
    # errors.turn_error_text: what failed, and the model call's HTTP status (docs/codex.md §4)
    *[(method, "notification", f"{prefix}.{field}")
      for method, prefix in (("error", "error"), ("turn/completed", "turn.error"))
      for field in ("additionalDetails", "codexErrorInfo",
                    *(f"codexErrorInfo.{variant}.httpStatusCode" for variant in STATUS_VARIANTS))],
    # runner._usage
    ("thread/tokenUsage/updated", "notification", "tokenUsage.last.inputTokens"),
    ("thread/tokenUsage/updated", "notification", "tokenUsage.last.cachedInputTokens"),
    ("thread/tokenUsage/updated", "notification", "tokenUsage.last.outputTokens"),
    ("thread/tokenUsage/updated", "notification", "tokenUsage.last.reasoningOutputTokens"),
    ("thread/tokenUsage/updated", "notification", "tokenUsage.last.totalTokens"),
    ("thread/tokenUsage/updated", "notification", "tokenUsage.total.totalTokens"),
    ("thread/tokenUsage/updated", "notification", "tokenUsage.modelContextWindow"),
    # projection.ItemProjector.add, item by item
    ("item/completed", "notification", "item{agentMessage}.id"),
    ("item/completed", "notification", "item{agentMessage}.text"),
    ("item/completed", "notification", "item{reasoning}.summary"),
    ("item/completed", "notification", "item{reasoning}.content"),
    ("item/completed", "notification", "item{commandExecution}.id"),
    ("item/completed", "notification", "item{commandExecution}.command"),
    ("item/completed", "notification", "item{commandExecution}.cwd"),
    ("item/completed", "notification", "item{commandExecution}.aggregatedOutput"),
    ("item/completed", "notification", "item{commandExecution}.exitCode"),
    ("item/completed", "notification", "item{commandExecution}.status"),
    ("item/completed", "notification", "item{fileChange}.id"),
    ("item/completed", "notification", "item{fileChange}.status"),
    ("item/completed", "notification", "item{fileChange}.changes[].kind"),
    ("item/completed", "notification", "item{fileChange}.changes[].path"),
    ("item/completed", "notification", "item{mcpToolCall}.id"),
    ("item/completed", "notification", "item{mcpToolCall}.server"),
    ("item/completed", "notification", "item{mcpToolCall}.tool"),
    ("item/completed", "notification", "item{mcpToolCall}.arguments"),
    ("item/completed", "notification", "item{mcpToolCall}.result"),
    ("item/completed", "notification", "item{mcpToolCall}.error"),
    ("item/completed", "notification", "item{userMessage}.id"),
    # runner._TEXT_ONLY_ITEMS: only the type matters, so the variant must exist
    ("item/completed", "notification", "item{plan}.id"),
    ("item/completed", "notification", "item{contextCompaction}.id"),
    # server_requests.make_server_request_handler logs these
    ("item/commandExecution/requestApproval", "server-request", "command"),
    ("item/commandExecution/requestApproval", "server-request", "itemId"),
]

# Values the code compares against: (method, what, path, values that must be allowed)
READ_VALUES = [
    ("turn/completed", "notification", "turn.status", {"completed", "failed", "interrupted"}),
    ("thread/turns/list", "response", "data[].status", {"completed"}),
    ("item/completed", "notification", "item{commandExecution}.status", {"completed"}),
    # errors.IMPLIED_STATUS: codexErrorInfo kinds that stand for one HTTP status
    ("turn/completed", "notification", "turn.error.codexErrorInfo", set(IMPLIED_STATUS)),
    ("error", "notification", "error.codexErrorInfo", set(IMPLIED_STATUS)),
]

# What the runner sends, with the result type it reads.
SENT_METHODS = ["initialize", "thread/start", "thread/resume", "turn/start", "turn/interrupt", "thread/turns/list"]


def _root(schema: CodexSchema, method: str, what: str) -> str:
    if what == "response":
        return schema.response_ref("ClientRequest", method)
    union = {"notification": "ServerNotification", "server-request": "ServerRequest"}[what]
    return schema.params_ref(union, method)


def test_the_bundle_is_draft_07_and_validates_as_such(codex_schema):
    assert codex_schema.bundle["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert codex_schema.validator_class is Draft7Validator
    Draft7Validator.check_schema(codex_schema.bundle)


@pytest.mark.parametrize("method", SENT_METHODS)
def test_each_method_we_send_has_params_and_a_result_type(codex_schema, method):
    assert codex_schema.params_ref("ClientRequest", method)
    assert codex_schema.response_ref("ClientRequest", method)
    assert "initialized" in codex_schema.arms("ClientNotification")


@pytest.mark.parametrize(("method", "what", "path"), READ_FIELDS, ids=[f"{m} {w} {p}" for m, w, p in READ_FIELDS])
def test_each_field_we_read_is_in_the_schema(codex_schema, method, what, path):
    assert codex_schema.field(_root(codex_schema, method, what), path)


@pytest.mark.parametrize(
    ("method", "what", "path", "values"), READ_VALUES, ids=[f"{m} {p}" for m, _, p, _ in READ_VALUES]
)
def test_each_value_we_compare_against_is_allowed(codex_schema, method, what, path, values):
    allowed = codex_schema.enum_values(codex_schema.field(_root(codex_schema, method, what), path))
    missing = sorted(values - allowed)
    assert not missing, f"{method} {path}: codex no longer allows {missing} (allows {sorted(allowed)})"


def test_every_server_request_codex_can_send_is_one_we_answer_in_the_contract_test(codex_schema):
    """A new server-request method in a codex version must get an answer (I4) and a row here."""
    assert set(codex_schema.arms("ServerRequest")) == set(KNOWN_SERVER_REQUESTS)



def test_a_renamed_field_fails_with_its_name(codex_schema):
    """The checks above can fail: a misspelt field, variant or array step is named in the failure."""
    turn_completed = _root(codex_schema, "turn/completed", "notification")
    for path, named in (("turn.stauts", "turn.stauts"), ("item{agentMesage}.text", "agentMesage"),
                        ("turn.id[]", "turn.id")):
        root = turn_completed if path.startswith("turn") else _root(codex_schema, "item/completed", "notification")
        with pytest.raises(FieldMissing, match=named.replace("[", r"\[").replace("{", r"\{")):
            codex_schema.field(root, path)


def test_requests_are_validated_closed_so_an_unknown_parameter_fails(codex_schema):
    """codex ignores parameters it does not know; the contract test must not."""
    params = {"threadId": "t", "input": [{"type": "text", "text": "hi", "text_elements": []}], "sandboxMode": "x"}
    ref = codex_schema.params_ref("ClientRequest", "turn/start")
    assert codex_schema.errors(ref, params) == []
    [error] = codex_schema.errors(ref, params, closed=True)
    assert "sandboxMode" in error
