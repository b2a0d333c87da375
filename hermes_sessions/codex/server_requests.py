"""Answers to the requests ``codex app-server`` sends to us (approvals, elicitations, user input).

Codex 0.169.0 ``ServerRequest`` methods (``docs/codex.md`` §5). Turns run in a background worker
with nobody at a keyboard, so every answer fails closed unless the session opted into ``auto_approve``:

======================================================  =================================================
method                                                  answer
======================================================  =================================================
``item/commandExecution/requestApproval``               ``{"decision": "accept"}`` if auto_approve else
``item/fileChange/requestApproval``                     ``{"decision": "decline"}``
``item/permissions/requestApproval``                    ``{"permissions": {}, "scope": "turn"}`` always (grants
                                                        nothing; this response has no ``decision``)
``execCommandApproval``, ``applyPatchApproval`` (v1)    ``{"decision": "approved"}`` / ``{"decision": {"denied":
                                                        {"rejection": …}}}`` (v1 ``ReviewDecision``)
``mcpServer/elicitation/request``                       ``{"action": "decline", "content": None, "_meta": None}``
``item/tool/requestUserInput``                          raises: nobody can answer (JSON-RPC error)
anything else                                           raises ``LookupError`` (JSON-RPC -32601)
======================================================  =================================================

Observed live: ``"decline"`` is accepted even when absent from ``availableDecisions``; the command item then
completes with ``status: "declined"`` and the turn still ends ``completed``. An error answer makes the item
``failed`` and the turn still completes. The client turns a raised exception into
``{"code": -32601, "message": "hermes_sessions does not handle <method>"}``.

Each answer is validated against the pinned codex's generated schema (``<X>Response``) by the contract test
(``tests/codex/contract/``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

ServerRequestHandler = Callable[[str, dict], dict]

_V2_APPROVALS = ("item/commandExecution/requestApproval", "item/fileChange/requestApproval")
_V1_APPROVALS = ("execCommandApproval", "applyPatchApproval")
_UNATTENDED = "declined: hermes_sessions runs turns unattended"


class UnanswerableServerRequest(LookupError):
    """Codex asked for something only a person at a keyboard could give (e.g. ``requestUserInput``)."""


def make_server_request_handler(
    *, approval_policy: str = "never", auto_approve: bool = False
) -> ServerRequestHandler:
    """Return ``handler(method, params) -> result dict`` for :class:`~.client.AppServerClient`.

    ``approval_policy`` is the policy the thread runs under; it is only used to log a request codex should
    not have sent (under ``"never"`` codex 0.169 asks for no approval). ``auto_approve`` accepts command and
    file-change approvals; without it they are declined (fail closed, as hermes does with no callback).
    Raises :class:`LookupError` for methods it does not handle.
    """

    def handle(method: str, params: dict) -> dict:
        if method in _V2_APPROVALS or method in _V1_APPROVALS:
            if approval_policy == "never":
                logger.warning("codex asked %s although approval_policy is 'never'", method)
            logger.info(
                "codex approval %s (auto_approve=%s): command=%r item=%r",
                method,
                auto_approve,
                (params or {}).get("command"),
                (params or {}).get("itemId"),
            )
        if method in _V2_APPROVALS:
            return {"decision": "accept" if auto_approve else "decline"}
        if method in _V1_APPROVALS:
            return {"decision": "approved" if auto_approve else {"denied": {"rejection": _UNATTENDED}}}
        if method == "item/permissions/requestApproval":
            return {"permissions": {}, "scope": "turn"}  # grant nothing
        if method == "mcpServer/elicitation/request":
            return {"action": "decline", "content": None, "_meta": None}
        if method == "item/tool/requestUserInput":
            raise UnanswerableServerRequest(
                "codex asked for user input, but turns run unattended and nobody can answer"
            )
        raise LookupError(f"no handler for codex server request {method!r}")

    return handle
