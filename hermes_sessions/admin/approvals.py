"""What codex asks a person, as the admin shows it and lets staff decide it.

* ``request_details`` — the approval's page and the session page: the command and its cwd, the file
  changes with their diffs, the permissions, the questions, an MCP server's message;
* ``approval_sections`` — the session page's section for its waiting turns: each pending approval with
  what it asks and its decision form;
* ``request_brief`` — one line of the same for the approvals list;
* ``decision_form`` — a POST form (CSRF) with one button per decision the approval offers
  (``Approval.available_decisions``, exactly what ``services.approval_decide`` accepts) and, for
  questions, a text box per question; ``decision_buttons`` the same buttons inside the changelist's
  own form (``formaction``: a form cannot sit inside another);
* ``decide`` — the POST behind both: ``services.approval_decide`` (the REST decision's service), its
  refusal as an error message, never a 500 (``tests/admin/test_approvals.py``).

Every value is escaped by ``format_html``; ids and classes are the browser tests' hooks
(docs/operating.md "The admin").
"""
from __future__ import annotations

import json
import uuid
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.admin.utils import quote, unquote
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden, HttpResponseNotAllowed, HttpResponseRedirect
from django.middleware.csrf import get_token
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.safestring import SafeString

from .. import services
from ..models import Approval
from .rendering import preview, when

#: The right to decide approvals in the admin (superusers have it; staff are given it).
DECIDE_PERMISSION = "hermes_sessions.change_approval"
#: Button labels of codex's decision names; a name not listed here is shown as codex spells it.
DECISION_LABELS = {
    "accept": "Accept",
    "acceptForSession": "Accept for this session",
    "acceptWithExecpolicyAmendment": "Accept and amend the exec policy",
    "applyNetworkPolicyAmendment": "Accept and change the network policy",
    "decline": "Decline",
    "cancel": "Decline and stop the turn",
}
AMENDMENT = "acceptWithExecpolicyAmendment"
DIFF_LIMIT = 20_000  # characters of one file's diff on a page (the API has it all)
MAX_DECISION_CHARS = 64  # a posted decision name longer than any codex sends is cut before the service sees it


def decide_url(approval_id: Any) -> str:
    return reverse("admin:hermes_sessions_approval_decide", args=[quote(str(approval_id))])


def approval_url(approval_id: Any) -> str:
    return reverse("admin:hermes_sessions_approval_change", args=[quote(str(approval_id))])


def pending_list_url() -> str:
    return reverse("admin:hermes_sessions_approval_changelist") + "?status__exact=pending"


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def _rows(pairs: list[tuple[str, Any]]) -> SafeString:
    return format_html_join("", '<dt>{}</dt><dd class="approval-{}">{}</dd>', ((k, k.replace(" ", "-"), v) for k, v in pairs))


def request_details(approval: Approval) -> SafeString:
    """``<dl class="approval-request">`` of what the approval asks, by kind: command → ``.approval-command``
    and ``.approval-cwd`` (and the reason); file change → each path with its diff (``pre.approval-diff``);
    permissions → the permissions asked (JSON); questions → each question with its options; MCP form → the
    server, message and URL or form schema."""
    asked = approval.request or {}
    pairs: list[tuple[str, Any]] = []
    if approval.kind == Approval.Kind.COMMAND:
        pairs = [("command", format_html("<code>{}</code>", preview(str(asked.get("command") or ""), 4_000))),
                 ("cwd", format_html("<code>{}</code>", str(asked.get("cwd") or "")))]
    elif approval.kind == Approval.Kind.FILE_CHANGE:
        changes = [c for c in asked.get("changes") or [] if isinstance(c, dict)]
        pairs = [("change", format_html('<code class="approval-path">{}</code> ({})<pre class="approval-diff">{}</pre>',
                                        c.get("path") or "", c.get("kind") or "change",
                                        preview(str(c.get("diff") or ""), DIFF_LIMIT))) for c in changes]
        if not changes:
            pairs = [("change", "codex sent no diff for this change")]
        if asked.get("grant_root"):
            pairs.append(("grant root", format_html("<code>{}</code>", asked["grant_root"])))
    elif approval.kind == Approval.Kind.PERMISSIONS:
        pairs = [("permissions", format_html("<pre>{}</pre>", _json(asked.get("permissions") or {}))),
                 ("cwd", format_html("<code>{}</code>", str(asked.get("cwd") or "")))]
    elif approval.kind == Approval.Kind.USER_INPUT:
        pairs = [("question", _question(q)) for q in asked.get("questions") or [] if isinstance(q, dict)]
    else:
        pairs = [("server", asked.get("server") or ""), ("message", asked.get("message") or "")]
        if asked.get("url"):
            pairs.append(("url", asked["url"]))
        if asked.get("schema"):
            pairs.append(("form", format_html("<pre>{}</pre>", _json(asked["schema"]))))
    if asked.get("reason"):
        pairs.append(("reason", preview(str(asked["reason"]), 2_000)))
    return format_html('<dl class="approval-request" data-approval="{}">{}</dl>', approval.pk, _rows(pairs))


def _question(question: dict[str, Any]) -> SafeString:
    options = [str(o.get("label") or "") for o in question.get("options") or [] if isinstance(o, dict)]
    return format_html("<strong>{}</strong> {}{}", question.get("header") or question.get("id") or "",
                       question.get("question") or "",
                       format_html(" (options: {})", ", ".join(options)) if options else "")


def request_brief(approval: Approval) -> str:
    """One line of what the approval asks (the approvals list): ``<command>  (in <cwd>)``, the changed
    paths, the questions, the MCP message."""
    asked = approval.request or {}
    if approval.kind == Approval.Kind.COMMAND:
        return preview(f"{asked.get('command') or ''}  (in {asked.get('cwd') or '?'})", 200)
    if approval.kind == Approval.Kind.FILE_CHANGE:
        paths = [str(c.get("path") or "") for c in asked.get("changes") or [] if isinstance(c, dict)]
        return preview("change " + (", ".join(paths) or "(no diff sent)"), 200)
    if approval.kind == Approval.Kind.USER_INPUT:
        return preview(" / ".join(str(q.get("question") or "") for q in asked.get("questions") or [] if isinstance(q, dict)), 200)
    if approval.kind == Approval.Kind.PERMISSIONS:
        return preview(f"permissions {json.dumps(asked.get('permissions') or {}, sort_keys=True)}", 200)
    return preview(str(asked.get("message") or asked.get("reason") or ""), 200)


def decision_label(approval: Approval, name: str) -> str:
    """The button's text for decision ``name``: ``DECISION_LABELS``, with the command prefix an exec-policy
    amendment would allow when codex sent one (``offered``: ``{"acceptWithExecpolicyAmendment":
    {"execpolicy_amendment": [...]}}``, 0.171.0, docs/codex.md)."""
    label = DECISION_LABELS.get(name, name)
    if name == AMENDMENT:
        for offered in approval.offered or []:
            prefix = offered.get(AMENDMENT, {}).get("execpolicy_amendment") if isinstance(offered, dict) else None
            if isinstance(prefix, list) and prefix:
                return f"Accept and allow commands starting “{preview(' '.join(map(str, prefix)), 80)}”"
    return label


def _buttons(approval: Approval, names: list[str], *, formaction: str = "") -> SafeString:
    attr = format_html(' formaction="{}"', formaction) if formaction else ""
    return format_html_join(
        " ", '<button type="submit" name="decision" value="{}" class="approval-decision decision-{}"{}>{}</button>',
        ((name, name, attr, decision_label(approval, name)) for name in names))


def decision_form(approval: Approval, *, csrf_token: str, next_url: str) -> SafeString:
    """``<form class="approval-decide">`` posting to the approval's decide URL: a text box per question
    (``answer-<question id>``, its options offered as suggestions) when the approval asks questions, then
    a button per offered decision. Empty for an approval that is no longer pending."""
    if not approval.is_pending:
        return SafeString("")
    answers = SafeString("")
    if approval.kind == Approval.Kind.USER_INPUT:
        questions = [q for q in approval.request.get("questions") or [] if isinstance(q, dict)]
        answers = SafeString("".join(_answer_box(approval, q) for q in questions))
    return format_html(
        '<form method="post" action="{}" class="approval-decide" data-approval="{}">'
        '<input type="hidden" name="csrfmiddlewaretoken" value="{}"><input type="hidden" name="next" value="{}">'
        "{}<p>{}</p></form>",
        decide_url(approval.pk), approval.pk, csrf_token, next_url, answers, _buttons(approval, list(approval.available_decisions or [])))


def _answer_box(approval: Approval, question: dict[str, Any]) -> SafeString:
    """A text box ``answer-<question id>`` with the question's options as suggestions (a ``datalist``);
    accepting needs an answer to every question (``tests/admin/test_approvals.py::test_questions_need_an_answer_to_accept``)."""
    qid = str(question.get("id") or "")
    options = format_html_join("", '<option value="{}">', ((str(o.get("label") or ""),)
                                                          for o in question.get("options") or [] if isinstance(o, dict)))
    return format_html('<p><label>{} <input type="text" name="answer-{}" class="approval-answer" list="options-{}-{}" '
                       'maxlength="20000"></label><datalist id="options-{}-{}">{}</datalist></p>',
                       question.get("question") or qid, qid, approval.pk, qid, approval.pk, qid, options)


def decision_buttons(approval: Approval, *, next_url: str) -> SafeString:
    """The decision buttons of one row of the approvals list, submitting the changelist's own form (its CSRF
    token) to the decide URL. Questions need answers: such a row links to the approval's page instead,
    and offers only the decisions that need none."""
    if not approval.is_pending:
        return SafeString("")
    action = f"{decide_url(approval.pk)}?{urlencode({'next': next_url})}"
    names = list(approval.available_decisions or [])
    if approval.kind != Approval.Kind.USER_INPUT:
        return _buttons(approval, names, formaction=action)
    return format_html('<a href="{}" class="approval-answer-link">Answer…</a> {}', approval_url(approval.pk),
                       _buttons(approval, [d for d in names if d in ("decline", "cancel")], formaction=action))


def approval_sections(pending: list[Approval], *, request: HttpRequest) -> SafeString:
    """The session page's ``<div class="pending-approval" id="approval-<id>">`` per pending approval: its
    kind and turn, what it asks, and its decision form when the user may decide (back to this page)."""
    can_decide = request.user.has_perm(DECIDE_PERMISSION)
    token = get_token(request) if can_decide else ""
    return format_html_join("", '<div class="pending-approval" id="approval-{}"><h3><a href="{}">{}</a> asked by turn {}, '
                            "expires {}</h3>{}{}</div>", (
        (a.pk, approval_url(a.pk), a.get_kind_display(), a.turn_ref, when(a.expires_at), request_details(a),
         decision_form(a, csrf_token=token, next_url=request.get_full_path()) if can_decide else "")
        for a in pending))


def _back(request: HttpRequest, default: str) -> str:
    """Where to go after a decision: the posted ``next`` (form field or query) when it is a URL of this
    site, else ``default``."""
    wanted = request.POST.get("next") or request.GET.get("next") or ""
    if wanted and url_has_allowed_host_and_scheme(wanted, allowed_hosts={request.get_host()},
                                                  require_https=request.is_secure()):
        return wanted
    return default


def _answers(request: HttpRequest, approval: Approval) -> dict[str, str] | None:
    """The posted answers (``answer-<question id>``, empty ones left out so the service names them
    missing) of an approval that asks questions; ``None`` for any other kind."""
    if approval.kind != Approval.Kind.USER_INPUT:
        return None
    asked = [str(q.get("id") or "") for q in approval.request.get("questions") or [] if isinstance(q, dict)]
    return {qid: request.POST[f"answer-{qid}"] for qid in asked if request.POST.get(f"answer-{qid}", "").strip()}


def decide(request: HttpRequest, object_id: str) -> HttpResponse:
    """POST ``decision`` (and ``answer-<id>`` for questions): decide the approval through
    ``services.approval_decide``, as ``POST /api/approvals/{id}/decision/`` does, with the staff user as
    the person; then back to ``next``. A decision not offered, answers missing, an approval already
    decided or whose turn ended: an error message and nothing changes (``ApprovalClosed`` /
    ``InvalidDecision``; ``tests/admin/test_approvals.py::test_a_decision_on_an_approval_already_decided_is_an_error_message_and_changes_nothing``);
    an unknown id: an error message on the pending list (``…::test_an_unknown_approval_is_a_message_never_a_500``)."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    if not request.user.has_perm(DECIDE_PERMISSION):
        return HttpResponseForbidden("You may not decide approvals.")
    try:
        approval = Approval.objects.get(pk=uuid.UUID(unquote(object_id)))
    except (ValueError, Approval.DoesNotExist):
        messages.error(request, f"No approval with id {object_id[:40]!r}.")
        return HttpResponseRedirect(pending_list_url())
    back = _back(request, approval_url(approval.pk))
    decision = request.POST.get("decision", "")[:MAX_DECISION_CHARS]
    if not decision:
        messages.error(request, "No decision given: press one of the approval's buttons.")
        return HttpResponseRedirect(back)
    try:
        decided = services.approval_decide(approval_id=approval.pk, user=request.user, decision=decision,
                                           answers=_answers(request, approval) if decision == "accept" else None)
    except (services.ApprovalClosed, services.InvalidDecision) as exc:
        messages.error(request, f"Approval not decided: {exc}.")
    except Approval.DoesNotExist:  # deleted with its session since the page was shown
        messages.error(request, f"No approval with id {object_id[:40]!r}.")
        return HttpResponseRedirect(pending_list_url())
    else:
        messages.success(request, f"Approval {decided.status} ({decided.decision}): {request_brief(decided)}")
    return HttpResponseRedirect(back)
