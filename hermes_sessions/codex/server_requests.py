"""Answers to the requests ``codex app-server`` sends to us (approvals, elicitations, user input).

Codex 0.171.0 ``ServerRequest`` methods (``docs/codex.md`` §5). Each approval-like request is read
into an :class:`ApprovalRequest` (our words: kind, command and cwd, paths and diff, questions, the
decisions a person may give) and put to ``ask`` — the worker's approval desk
(``worker/approvals.py``), which records it (``services/approvals.py``) and waits, boundedly, for a
person's decision. :func:`answer` turns that decision into the JSON-RPC result codex expects:

======================================================  =================================================
method (kind)                                           result per decision
======================================================  =================================================
``item/commandExecution/requestApproval`` (command)     ``{"decision": D}``: ``D`` as codex offered it
``item/fileChange/requestApproval`` (file_change)       (``"accept"``, ``"acceptForSession"``, an amendment
                                                        object, ``"decline"``, ``"cancel"``)
``item/permissions/requestApproval`` (permissions)      ``{"permissions": <the requested ones, or {}>,
                                                        "scope": "turn" | "session"}``
``item/tool/requestUserInput`` (user_input)             ``{"answers": {<question id>: {"answers": [..]}}}``;
                                                        declined: a JSON-RPC error (nothing to answer)
``mcpServer/elicitation/request`` (mcp_elicitation)     ``{"action": "accept"|"decline"|"cancel",
                                                        "content": <form values> | None, "_meta": None}``
``execCommandApproval``, ``applyPatchApproval`` (v1)    not put to a person: ``approved`` if auto_approve
                                                        else ``denied`` (v1 ``ReviewDecision``)
anything else                                           raises ``LookupError`` (JSON-RPC -32601)
======================================================  =================================================

With no ``ask`` (or when ``ask`` returns ``None``: no turn of ours is waiting for it), every answer
fails closed, as before a person could decide: approvals ``decline`` (``accept`` with
``auto_approve``), permissions grant nothing, elicitations ``decline``, user input raises.

Observed live (0.169.0 and 0.171.0): ``"decline"`` is accepted even when absent from
``availableDecisions``; the command item then completes with ``status: "declined"`` and the turn still
ends ``completed``. An error answer makes the item ``failed`` and the turn still completes. codex
waits for an answer with no timer of its own (an unanswered request leaves the thread
``waitingOnApproval``); ``thread/increment_elicitation`` pauses only the unified-exec output window of
a command already running, not this wait (``docs/codex.md`` §5). The client turns a raised exception
into ``{"code": -32601, "message": "hermes_sessions does not handle <method>"}``.

Each answer is validated against the pinned codex's generated schema (``<X>Response``) by the contract test
(``tests/codex/contract/``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ServerRequestHandler = Callable[[str, dict], dict]

COMMAND, FILE_CHANGE, PERMISSIONS, USER_INPUT, MCP_ELICITATION = (
    "command", "file_change", "permissions", "user_input", "mcp_elicitation")
#: codex method → our kind.
KINDS = {
    "item/commandExecution/requestApproval": COMMAND,
    "item/fileChange/requestApproval": FILE_CHANGE,
    "item/permissions/requestApproval": PERMISSIONS,
    "item/tool/requestUserInput": USER_INPUT,
    "mcpServer/elicitation/request": MCP_ELICITATION,
}
ACCEPT, ACCEPT_FOR_SESSION, DECLINE, CANCEL = "accept", "acceptForSession", "decline", "cancel"
#: Decisions a person may give per kind when codex lists none (file changes: 0.171.0 sends no
#: ``availableDecisions``; its ``FileChangeApprovalDecision`` has these four).
DEFAULT_DECISIONS = {
    COMMAND: [ACCEPT, ACCEPT_FOR_SESSION, DECLINE, CANCEL],
    FILE_CHANGE: [ACCEPT, ACCEPT_FOR_SESSION, DECLINE, CANCEL],
    PERMISSIONS: [ACCEPT, ACCEPT_FOR_SESSION, DECLINE],
    USER_INPUT: [ACCEPT, DECLINE],
    MCP_ELICITATION: [ACCEPT, DECLINE, CANCEL],
}

_V1_APPROVALS = ("execCommandApproval", "applyPatchApproval")
_UNATTENDED = "declined: hermes_sessions runs turns unattended"


class UnanswerableServerRequest(LookupError):
    """Codex asked for something only a person could give (``requestUserInput``), and no person did."""


def decision_name(decision: Any) -> str:
    """``"accept"`` for ``"accept"``, ``"acceptWithExecpolicyAmendment"`` for
    ``{"acceptWithExecpolicyAmendment": {…}}`` (codex's ``availableDecisions`` mixes both forms)."""
    if isinstance(decision, dict) and len(decision) == 1:
        return str(next(iter(decision)))
    return str(decision) if isinstance(decision, str) else ""


@dataclass
class ApprovalRequest:
    """One server request codex sent for a decision, in our words. ``kind`` is one of ``KINDS``'
    values; ``request_id`` its number among the turn's requests (set by whoever records it: the client
    answers them one at a time, in arrival order); ``thread_id`` / ``codex_turn_id`` / ``item_id``
    codex's ids; ``details`` what a person needs to decide (``as_dict``); ``offered`` codex's
    ``availableDecisions`` verbatim (``[]`` when it sent none); ``decisions`` the names a person may
    choose: codex's, plus ``decline`` (always taken, observed on 0.169.0 and 0.171.0) and
    ``acceptForSession`` where ``accept`` is offered (the session's grant is kept by hermes:
    ``services/approvals.py``)."""

    method: str
    kind: str
    request_id: str = ""
    thread_id: str = ""
    codex_turn_id: str = ""
    item_id: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    offered: list[Any] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """``{"method", "item_id", **details}``: what the ``Approval.request`` column holds."""
        return {"method": self.method, "item_id": self.item_id, **self.details}

    def fingerprint(self) -> str:
        """sha256 (hex) of what makes two requests "the same": the kind and, per kind, command + cwd,
        the paths and diff (or codex's reason and grant root when it sent no change), the permissions,
        the questions, the server + message + form."""
        keys = {COMMAND: ("command", "cwd"), FILE_CHANGE: ("changes", "reason", "grant_root"),
                PERMISSIONS: ("permissions", "cwd"), USER_INPUT: ("questions",),
                MCP_ELICITATION: ("server", "message", "schema", "url")}[self.kind]
        basis = [self.kind, *[self.details.get(k) for k in keys]]
        return hashlib.sha256(json.dumps(basis, sort_keys=True, default=str).encode("utf-8", "surrogatepass")).hexdigest()


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def approval_request(method: str, params: dict[str, Any], *, request_id: Any = "") -> ApprovalRequest | None:
    """Read codex's request into an :class:`ApprovalRequest`; ``None`` for a method that is not put to a
    person. Param shapes (0.171.0, ``ServerRequest.ts`` and ``codex/protocol.md`` §5):
    command ``{threadId, turnId, itemId, command, cwd, reason?, commandActions, availableDecisions}``;
    file change ``{threadId, turnId, itemId, reason?, grantRoot?}`` (the diff comes on the item's
    ``item/started``: the caller may add ``details["changes"]``); permissions ``{…, reason?, cwd?,
    permissions}``; user input ``{…, questions: [{id, header, question, isOther, isSecret, options}]}``;
    MCP ``{threadId, turnId?, serverName, mode, message, requestedSchema? | url?}``."""
    kind = KINDS.get(method)
    if kind is None:
        return None
    p = params if isinstance(params, dict) else {}
    details: dict[str, Any] = {}
    if kind == COMMAND:
        details = {"command": _text(p.get("command")), "cwd": _text(p.get("cwd")), "reason": _text(p.get("reason")),
                   "command_actions": p.get("commandActions") or []}
    elif kind == FILE_CHANGE:
        details = {"reason": _text(p.get("reason")), "grant_root": _text(p.get("grantRoot")), "changes": []}
    elif kind == PERMISSIONS:
        details = {"reason": _text(p.get("reason")), "cwd": _text(p.get("cwd")),
                   "permissions": p.get("permissions") if isinstance(p.get("permissions"), dict) else {}}
    elif kind == USER_INPUT:
        asked = p.get("questions")
        details = {"questions": [q for q in asked if isinstance(q, dict)] if isinstance(asked, list) else []}
    else:
        details = {"server": _text(p.get("serverName")), "mode": _text(p.get("mode")), "message": _text(p.get("message")),
                   "schema": p.get("requestedSchema") if isinstance(p.get("requestedSchema"), dict) else None,
                   "url": _text(p.get("url"))}
    listed = p.get("availableDecisions")
    offered: list[Any] = listed if isinstance(listed, list) else []
    names = [n for n in (decision_name(d) for d in offered) if n] or list(DEFAULT_DECISIONS[kind])
    if ACCEPT in names and ACCEPT_FOR_SESSION not in names and kind in (COMMAND, FILE_CHANGE, PERMISSIONS):
        names.insert(names.index(ACCEPT) + 1, ACCEPT_FOR_SESSION)
    if DECLINE not in names:
        names.append(DECLINE)
    return ApprovalRequest(method=method, kind=kind, request_id=str(request_id), thread_id=_text(p.get("threadId")),
                           codex_turn_id=_text(p.get("turnId")), item_id=_text(p.get("itemId")), details=details,
                           offered=offered, decisions=names)


@dataclass(frozen=True)
class Verdict:
    """A person's decision (or the worker's: expiry, a cancelled turn): ``decision`` one of the
    request's ``decisions``; ``response`` the extra answer (``{"answers": {question id: [text]}}`` for
    user input, ``{"content": {…}}`` for an MCP form)."""

    decision: str
    response: dict[str, Any] = field(default_factory=dict)


def answer(request: ApprovalRequest, verdict: Verdict) -> dict[str, Any]:
    """The JSON-RPC ``result`` for ``request`` given ``verdict`` (module table). A decision the request
    does not offer is answered ``decline`` (fail closed). Raises :class:`UnanswerableServerRequest` for
    user input that was not answered (codex then gets a JSON-RPC error: the tool call fails)."""
    decision = verdict.decision if verdict.decision in request.decisions else DECLINE
    accepted = decision not in (DECLINE, CANCEL)
    if request.kind in (COMMAND, FILE_CHANGE):
        offered = {decision_name(d): d for d in request.offered}
        if decision == ACCEPT_FOR_SESSION:
            # Hermes keeps the session's grant (services/approvals.py, by fingerprint); codex's own would
            # outlive this approval in a kept app-server and let through what nobody was shown — a file
            # change of other content at the same path (tests/services/test_approvals.py::test_answer_per_kind).
            return {"decision": ACCEPT}
        return {"decision": offered.get(decision, decision)}
    if request.kind == PERMISSIONS:
        granted = request.details.get("permissions") or {} if accepted else {}
        return {"permissions": granted, "scope": "turn"}  # a session's grant is hermes's, as above
    if request.kind == USER_INPUT:
        if not accepted:
            raise UnanswerableServerRequest(f"the person asked {decision}d to answer codex's questions")
        given = verdict.response.get("answers") or {}
        return {"answers": {str(qid): {"answers": [str(a) for a in (v if isinstance(v, list) else [v])]}
                            for qid, v in given.items()}}
    content = verdict.response.get("content") if accepted else None
    return {"action": decision if decision in (ACCEPT, DECLINE, CANCEL) else DECLINE,
            "content": content if isinstance(content, dict) else None, "_meta": None}


Ask = Callable[[ApprovalRequest], "Verdict | None"]


def make_server_request_handler(
    *, approval_policy: str = "never", auto_approve: bool = False, ask: Ask | None = None
) -> ServerRequestHandler:
    """Return ``handler(method, params) -> result dict`` for :class:`~.client.AppServerClient`.

    ``ask`` puts an approval-like request to a person and returns the :class:`Verdict` (it may block:
    the client runs the handler on its own dispatcher thread, so notifications keep flowing), or
    ``None`` when nobody can be asked — then the fail-closed answers of the module docstring apply.
    ``approval_policy`` is the policy the thread runs under; it is only used to log a request codex should
    not have sent (under ``"never"`` codex asks for no approval). ``auto_approve`` accepts command and
    file-change approvals nobody was asked about. Raises :class:`LookupError` for methods it does not handle.
    """

    def handle(method: str, params: dict) -> dict:
        request = approval_request(method, params or {})
        if request is not None and approval_policy == "never" and request.kind in (COMMAND, FILE_CHANGE):
            logger.warning("codex asked %s although approval_policy is 'never'", method)
        if request is not None and ask is not None:
            verdict = ask(request)
            if verdict is not None:
                return answer(request, verdict)
        if method in _V1_APPROVALS or (request is not None and request.kind in (COMMAND, FILE_CHANGE)):
            logger.info("codex approval %s answered unattended (auto_approve=%s): command=%r item=%r", method,
                        auto_approve, (params or {}).get("command"), (params or {}).get("itemId"))
        if method in _V1_APPROVALS:
            return {"decision": "approved" if auto_approve else {"denied": {"rejection": _UNATTENDED}}}
        if request is None:
            raise LookupError(f"no handler for codex server request {method!r}")
        if request.kind == USER_INPUT:
            raise UnanswerableServerRequest("codex asked for user input, but nobody was asked to answer it")
        return answer(request, Verdict(ACCEPT if auto_approve and request.kind in (COMMAND, FILE_CHANGE) else DECLINE))

    return handle
