"""REST API views: parse and check the request, call a service or selector, serialize.

A user sees and drives only their own sessions (invariant I7): every lookup goes through a
selector scoped to ``request.user``, and anything not found that way is a 404 — including ids that
are malformed, so bad ids never reach the database. Domain errors are mapped to 4xx in
``api.errors``.
"""
from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import generics, permissions, status
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from .. import selectors, services
from ..latency_marks import mark
from ..models import Approval, Message, Notice, Session, Turn, WebhookDelivery, WebhookEndpoint
from .errors import BadRequest
from .openapi import (
    ApprovalClosedErrorSerializer,
    InvalidDecisionErrorSerializer,
    SessionBusyErrorSerializer,
    TurnFinishedErrorSerializer,
    error_responses,
)
from .pagination import (
    MessageSearchPagination,
    StandardPagination,
    TranscriptPagination,
    TranscriptSearchPagination,
)
from .parsers import SafeJSONParser
from .routes import ApiRootSerializer, api_root
from .serializers import (
    IDEMPOTENCY_KEY_PATTERN,
    SESSION_ID_PATTERN,
    ApprovalDecisionSerializer,
    ApprovalSerializer,
    MessageSearchResultSerializer,
    MessageSerializer,
    NoticeSerializer,
    SessionCreateSerializer,
    SessionSerializer,
    TurnCreateSerializer,
    TurnSerializer,
    WebhookDeliverySerializer,
    WebhookEndpointCreatedSerializer,
    WebhookEndpointSerializer,
    WebhookEndpointWriteSerializer,
)

IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    {"type": "string", "pattern": IDEMPOTENCY_KEY_PATTERN},
    OpenApiParameter.HEADER,
    required=False,
    description="Repeat-safe POST: the same key with the same body returns the object the first request created "
    "(kept 24 h, per user); with a different body the answer is 422. 1-255 printable ASCII characters "
    "(spaces and tabs around it are not part of it); another key: 400.",
)


def _idempotency_key(request: Request) -> str | None:
    """The ``Idempotency-Key`` header without the spaces and tabs around it (HTTP servers strip them
    already; this makes every server, and the test client, agree); ``None`` when absent."""
    key = request.headers.get("Idempotency-Key")
    return None if key is None else key.strip(" \t")


SESSION_ID_PARAM = OpenApiParameter(
    "session_id", {"type": "string", "pattern": SESSION_ID_PATTERN}, OpenApiParameter.PATH,
    description="The session id (see POST /api/sessions/); an id that is not one of yours, well-formed or not: 404.",
)
TURN_ID_PARAM = OpenApiParameter(
    "turn_id", OpenApiTypes.UUID, OpenApiParameter.PATH,
    description="The turn's id (a UUID); anything that is not one of your turns' ids: 404.",
)
NO_SESSION = "No such session among yours (`code` `not_found`)."
NO_TURN = "No such turn among yours (`code` `not_found`)."
# Paged lists: a page past the last one is DRF's 404 `Invalid page.`.
NO_SESSION_OR_PAGE = "No such session among yours, or `page` is past the last page (`code` `not_found`)."


class _ApiView(generics.GenericAPIView):
    """Common settings: JSON bodies only. DRF reads a JSON body through Django's ``request.body``,
    which enforces ``settings.DATA_UPLOAD_MAX_MEMORY_SIZE`` (``RequestDataTooBig`` → 413 in
    ``api.errors``)."""

    parser_classes = [SafeJSONParser]

    def get_session(self, *, annotated: bool = False) -> Session:
        """The caller's session named by the ``session_id`` URL segment, or 404 (I7). The plain row
        (``selectors.session_owned``) unless ``annotated``: only a view that shows the session needs
        ``session_list``'s counts, last activity and active thread (``selectors.session_get``)."""
        lookup = selectors.session_get if annotated else selectors.session_owned
        try:
            return lookup(user=self.request.user, session_id=self.kwargs["session_id"])
        except Session.DoesNotExist as exc:
            raise NotFound("No such session.") from exc


@extend_schema(
    summary="The API's endpoints",
    auth=[],
    responses={200: ApiRootSerializer, **error_responses()},
)
class ApiRootView(APIView):
    """Where to start: links to the sessions list, the schema and its docs, and every route.

    ``GET /api/``: links to the sessions list, the schema and its docs, and every route of the
    API with its methods (read from the URLconf, ``api.routes``). Open to anyone: it names
    endpoints, nothing of anyone's data."""

    permission_classes = [permissions.AllowAny]

    def get(self, request: Request) -> Response:
        return Response(api_root(request))


@extend_schema_view(
    get=extend_schema(
        summary="List your sessions, most recently active first",
        responses={200: SessionSerializer(many=True), **error_responses(s404="`page` is past the last page.")},
    ),
    post=extend_schema(
        summary="Create a session",
        parameters=[IDEMPOTENCY_KEY],
        request=SessionCreateSerializer,
        responses={
            200: OpenApiResponse(SessionSerializer, description="The session an earlier request with this Idempotency-Key created."),
            201: SessionSerializer,
            **error_responses(
                413, 415, 422,
                s400="Malformed body, id or Idempotency-Key, or a model_config setting outside policy "
                "(`code` `invalid`, `invalid_setting`, `invalid_idempotency_key`, `parse_error`).",
                s403="A model_config setting reserved to staff (`forbidden_setting`), or a POST with the session "
                "cookie and no CSRF token.",
                s409="The session id is taken — by you or by anyone: session ids are one namespace, and the "
                "answer is the same either way (`session_id_taken`; docs/contract.md §9).",
            ),
        },
    ),
)
class SessionListCreateView(_ApiView, generics.ListCreateAPIView):
    """Your sessions: list them (paged, most recently active first) or create one.

    ``GET /api/sessions/`` and ``POST /api/sessions/``. The first line of each view's docstring is
    its summary in ``GET /api/`` (``api.routes``)."""

    serializer_class = SessionSerializer
    pagination_class = StandardPagination

    def get_queryset(self) -> QuerySet[Session]:
        return selectors.session_list(user=self.request.user)

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        body = SessionCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        session, created = services.idempotent(
            user=request.user,
            scope="sessions",
            key=_idempotency_key(request),
            body=request.data,
            create=lambda: services.session_create(
                owner=request.user,
                session_id=data.get("id") or None,
                title=data.get("title", ""),
                model_config=data.get("model_config") or {},
            ),
            # Among the caller's sessions only: an id is one namespace for all users, so the key's session may
            # have been deleted and its id taken by someone else since (then the key is spent: 409 below).
            load=lambda pk: selectors.session_owned(user=request.user, session_id=pk),
        )
        session = selectors.session_get(user=request.user, session_id=session.id)
        return Response(SessionSerializer(session).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


@extend_schema(
    summary="Get one of your sessions",
    parameters=[SESSION_ID_PARAM],
    responses={200: SessionSerializer, **error_responses(s404=NO_SESSION)},
)
class SessionDetailView(_ApiView, generics.RetrieveAPIView):
    """One of your sessions, with its active codex thread id.

    ``GET /api/sessions/{id}/``."""

    serializer_class = SessionSerializer
    queryset = Session.objects.none()  # lookups go through get_session(); this only names the model

    def get_object(self) -> Session:
        return self.get_session(annotated=True)


@extend_schema_view(
    get=extend_schema(
        summary="A session's turns, newest first",
        parameters=[SESSION_ID_PARAM],
        responses={200: TurnSerializer(many=True), **error_responses(s404=NO_SESSION_OR_PAGE)},
    ),
    post=extend_schema(
        summary="Send an input to a session (queues a turn)",
        parameters=[SESSION_ID_PARAM, IDEMPOTENCY_KEY],
        request=TurnCreateSerializer,
        responses={
            202: TurnSerializer,
            **error_responses(
                403, 413, 415, 422,
                s400="Missing, empty, whitespace-only, non-string or too long input, a malformed body or "
                "Idempotency-Key (`code` `invalid`, `invalid_input`, `invalid_idempotency_key`, `parse_error`).",
                s404=NO_SESSION,
                s409=("on_busy=reject and the session has a turn running or queued (`session_busy`; `turn` names it).",
                      SessionBusyErrorSerializer),
            ),
        },
    ),
)
class TurnListCreateView(_ApiView, generics.ListAPIView):
    """A session's turns: list them (paged, newest first) or send an input (queues a turn, 202).

    ``GET /api/sessions/{id}/turns/`` and ``POST /api/sessions/{id}/turns/`` → 202 with the queued
    turn; a worker runs it."""

    serializer_class = TurnSerializer
    pagination_class = StandardPagination

    def get_queryset(self) -> QuerySet[Turn]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular schema generation
            return Turn.objects.none()
        return selectors.turn_list_newest_first(session=self.get_session())

    def post(self, request: Request, session_id: str) -> Response:
        mark("api.post.start", session_id)
        # The session is not read first: the enqueue's locking UPDATE checks that the caller owns it (one round
        # trip fewer per turn). A request that fails otherwise still answers 404 first for a session the caller
        # cannot see — a bad body, key or anything else — as a read first would (invariant I7).
        try:
            body = TurnCreateSerializer(data=request.data)
            body.is_valid(raise_exception=True)
            turn, _ = services.idempotent(
                user=request.user,
                scope=f"turns:{session_id}",
                key=_idempotency_key(request),
                body=request.data,
                create=lambda: services.turn_enqueue(
                    owned_session_id=session_id,
                    input_text=body.validated_data["input"],
                    user=request.user,
                    on_busy=body.validated_data["on_busy"],
                ),
                load=lambda pk: Turn.objects.get(pk=pk, session_id=session_id),
            )
        except Session.DoesNotExist as exc:
            raise NotFound("No such session.") from exc
        except Exception:
            self.get_session()
            raise
        mark("api.post.enqueued", turn.id)
        return Response(TurnSerializer(turn).data, status=status.HTTP_202_ACCEPTED)


@extend_schema(
    summary="Cancel a turn",
    parameters=[TURN_ID_PARAM],
    request=None,
    responses={
        202: TurnSerializer,
        **error_responses(
            403,
            s404=NO_TURN,
            s409=("The turn already finished (`turn_finished`; `turn` holds it).", TurnFinishedErrorSerializer),
        ),
    },
)
class TurnCancelView(_ApiView):
    """Cancel a turn (202 with the turn as it is now; 409 when it already ended).

    ``POST /api/turns/{id}/cancel/`` → 202 with the turn as it is now: a queued turn is
    ``cancelled`` at once; a running one is still ``running`` — its worker sends ``turn/interrupt``
    within a second and it then ends ``cancelled`` with what codex completed before it. A finished
    turn answers 409. The body is not read (any or none)."""

    serializer_class = TurnSerializer
    queryset = Turn.objects.none()

    def post(self, request: Request, turn_id: str) -> Response:
        try:
            turn = selectors.turn_get(user=request.user, turn_id=turn_id)
        except Turn.DoesNotExist as exc:
            raise NotFound("No such turn.") from exc
        if not turn.is_terminal:
            turn = services.turn_cancel(turn=turn)
            # It may have finished between the read above and the lock the service takes.
            if not turn.is_terminal or turn.status == Turn.Status.CANCELLED:
                return Response(TurnSerializer(turn).data, status=status.HTTP_202_ACCEPTED)
        body = {"detail": f"turn already {turn.status}; nothing to cancel", "code": "turn_finished",
                "turn": TurnSerializer(turn).data}
        return Response(body, status=status.HTTP_409_CONFLICT)


@extend_schema(
    summary="Get one of your turns",
    parameters=[TURN_ID_PARAM],
    responses={200: TurnSerializer, **error_responses(s404=NO_TURN)},
)
class TurnDetailView(_ApiView, generics.RetrieveAPIView):
    """One of your turns: status, thread action, codex ids, final text, error, usage, timings.

    ``GET /api/turns/{id}/``."""

    serializer_class = TurnSerializer
    queryset = Turn.objects.none()

    def get_object(self) -> Turn:
        try:
            return selectors.turn_get(user=self.request.user, turn_id=self.kwargs["turn_id"])
        except Turn.DoesNotExist as exc:
            raise NotFound("No such turn.") from exc


def _search_param(*, required: bool) -> OpenApiParameter:
    return OpenApiParameter(
        "q",
        {"type": "string", "minLength": 1, "maxLength": selectors.MAX_SEARCH_CHARS, "pattern": r"^[^\x00]*[^\s\x00][^\x00]*$"},
        OpenApiParameter.QUERY,
        required=required,
        description=f"Full-text search of the messages' content, web-search syntax (words are ANDed, "
        f'"a phrase", `or`, `-word`; PostgreSQL\'s `simple` configuration: no stemming). 1-{selectors.MAX_SEARCH_CHARS} '
        "characters, not only whitespace; matches come newest first.",
    )


def _search_text(request: Request) -> str | None:
    """The request's ``q`` checked by ``selectors.search_text`` (``None`` when absent); 400 when bad."""
    if "q" not in request.query_params:
        return None
    try:
        return selectors.search_text(request.query_params["q"])
    except selectors.InvalidSearch as exc:
        raise BadRequest(str(exc), code="invalid_search") from exc


@extend_schema(
    summary="A session's transcript, in seq order; or, with q, its matching messages newest first",
    parameters=[SESSION_ID_PARAM, _search_param(required=False)],
    responses={
        200: MessageSerializer(many=True),
        **error_responses(
            s400="`q` is empty or too long (`code`: `invalid_search`), a NUL byte in the URL or headers, or a bad `page_size`.",
            s404="No such session among yours, or a `cursor` the server did not make.",
        ),
    },
)
class MessageListView(_ApiView, generics.ListAPIView):
    """A session's transcript, oldest first, or with q the messages matching it, newest first.

    ``GET /api/sessions/{id}/messages/`` — cursor-paginated by ``seq``; with ``?q=`` the rows
    matching it (``selectors.message_search``), newest first, cursor-paginated by ``-seq``."""

    serializer_class = MessageSerializer
    pagination_class = TranscriptPagination

    @property
    def paginator(self) -> TranscriptPagination:
        """A keyset on ``seq`` for the transcript, on ``-seq`` for search results."""
        if not hasattr(self, "_paginator"):
            searching = "q" in self.request.query_params
            self._paginator = TranscriptSearchPagination() if searching else TranscriptPagination()
        return self._paginator

    def get_queryset(self) -> QuerySet[Message]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular schema generation
            return Message.objects.none()
        q = _search_text(self.request)
        session = self.get_session()
        if q is None:
            return selectors.message_list(session=session)
        return selectors.message_search(session=session, q=q)


@extend_schema(
    summary="Search the messages of all your sessions, newest first",
    parameters=[_search_param(required=True)],
    responses={
        200: MessageSearchResultSerializer(many=True),
        **error_responses(
            s400="`q` is missing, empty or too long (`code`: `invalid_search`), or a NUL byte in the URL or headers.",
            s404="A `cursor` the server did not make.",
        ),
    },
)
class MessageSearchView(_ApiView, generics.ListAPIView):
    """Search the messages of all your sessions for q, newest first.

    ``GET /api/messages/?q=`` — messages matching ``q`` in the caller's sessions only
    (``selectors.message_search_for_user``, I7), newest first, cursor-paginated by ``-id``."""

    serializer_class = MessageSearchResultSerializer
    pagination_class = MessageSearchPagination

    def get_queryset(self) -> QuerySet[Message]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular schema generation
            return Message.objects.none()
        q = _search_text(self.request)
        if q is None:
            raise BadRequest("q is required: the text to search for", code="invalid_search")
        return selectors.message_search_for_user(user=self.request.user, q=q)


@extend_schema(
    summary="A session's notices, newest first",
    parameters=[SESSION_ID_PARAM],
    responses={200: NoticeSerializer(many=True), **error_responses(s404=NO_SESSION_OR_PAGE)},
)
class NoticeListView(_ApiView, generics.ListAPIView):
    """A session's lifecycle notices, newest first (paged).

    ``GET /api/sessions/{id}/notices/``."""

    serializer_class = NoticeSerializer
    pagination_class = StandardPagination

    def get_queryset(self) -> QuerySet[Notice]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular schema generation
            return Notice.objects.none()
        return selectors.notice_list(session=self.get_session())


APPROVAL_ID_PARAM = OpenApiParameter(
    "approval_id", OpenApiTypes.UUID, OpenApiParameter.PATH,
    description="The approval's id (a UUID); anything that is not one of your approvals' ids: 404.",
)
NO_APPROVAL = "No such approval among yours (`code` `not_found`)."
APPROVAL_STATUS_PARAM = OpenApiParameter(
    "status", {"type": "string", "enum": list(Approval.Status.values)}, OpenApiParameter.QUERY, required=False,
    description="Only the approvals in this status (`pending`: those waiting for a decision now).",
)


def _approval(request: Request, approval_id: str) -> Approval:
    try:
        return selectors.approval_get(user=request.user, approval_id=approval_id)
    except Approval.DoesNotExist as exc:
        raise NotFound("No such approval.") from exc


@extend_schema(
    summary="A session's approvals, newest first",
    parameters=[SESSION_ID_PARAM, APPROVAL_STATUS_PARAM],
    responses={200: ApprovalSerializer(many=True),
               **error_responses(s400="`status` is not an approval status, or a NUL byte in the URL or headers.",
                                 s404=NO_SESSION_OR_PAGE)},
)
class ApprovalListView(_ApiView, generics.ListAPIView):
    """A session's approvals (what codex asked a person), newest first; ?status=pending for those waiting.

    ``GET /api/sessions/{id}/approvals/`` (paged)."""

    serializer_class = ApprovalSerializer
    pagination_class = StandardPagination

    def get_queryset(self) -> QuerySet[Approval]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular schema generation
            return Approval.objects.none()
        session = self.get_session()  # another user's session is 404 whatever the query says (I7)
        status_param = self.request.query_params.get("status")
        if status_param is not None and status_param not in Approval.Status.values:
            raise BadRequest(f"status must be one of {', '.join(Approval.Status.values)}", code="invalid_status")
        return selectors.approval_list(session=session, status=status_param)


@extend_schema(
    summary="Get one of your approvals",
    parameters=[APPROVAL_ID_PARAM],
    responses={200: ApprovalSerializer, **error_responses(s404=NO_APPROVAL)},
)
class ApprovalDetailView(_ApiView, generics.RetrieveAPIView):
    """One of your approvals: what codex asked, the decisions offered, what was decided, by whom and when.

    ``GET /api/approvals/{id}/``."""

    serializer_class = ApprovalSerializer
    queryset = Approval.objects.none()

    def get_object(self) -> Approval:
        return _approval(self.request, self.kwargs["approval_id"])


@extend_schema(
    summary="Decide a pending approval",
    parameters=[APPROVAL_ID_PARAM, IDEMPOTENCY_KEY],
    request=ApprovalDecisionSerializer,
    responses={
        200: ApprovalSerializer,
        **error_responses(
            403, 413, 415, 422,
            s400=("A decision the approval does not offer (`invalid_decision`, `available_decisions` lists them), "
                  "answers that do not fit its questions, or a body that breaks the schema.",
                  InvalidDecisionErrorSerializer),
            s404=NO_APPROVAL,
            s409=("Already decided, expired or cancelled, or its turn no longer runs (`approval_closed`; "
                  "`approval` holds it); or the Idempotency-Key is in use.", ApprovalClosedErrorSerializer),
        ),
    },
)
class ApprovalDecisionView(_ApiView):
    """Decide a pending approval (200 with it decided; 409 when it is no longer pending or its turn ended).

    ``POST /api/approvals/{id}/decision/`` with ``{"decision": …, "answers"?: {…}, "content"?: {…}}``: the
    worker waiting on it answers codex within a second. Only one of the approval's ``available_decisions`` is
    accepted (400 otherwise). Repeat-safe with an ``Idempotency-Key``."""

    serializer_class = ApprovalSerializer
    queryset = Approval.objects.none()

    def post(self, request: Request, approval_id: str) -> Response:
        approval = _approval(request, approval_id)
        body = ApprovalDecisionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        decided, _ = services.idempotent(
            user=request.user,
            scope=f"approvals:{approval.pk}",
            key=_idempotency_key(request),
            body=request.data,
            create=lambda: services.approval_decide(
                approval_id=approval.pk, user=request.user, decision=body.validated_data["decision"],
                answers=body.validated_data.get("answers"), content=body.validated_data.get("content")),
            load=lambda pk: selectors.approval_get(user=request.user, approval_id=pk),
        )
        return Response(ApprovalSerializer(decided).data, status=status.HTTP_200_OK)


WEBHOOK_ID_PARAM = OpenApiParameter(
    "webhook_id", {"type": "integer", "minimum": 1}, OpenApiParameter.PATH,
    description="The webhook endpoint's id; anything that is not one of your endpoints' ids: 404.",
)
NO_WEBHOOK = "No such webhook endpoint among yours (`code` `not_found`)."
WEBHOOK_400 = ("A body that breaks the schema, a URL that is no allowed target (private, loopback, link-local or "
               "other internal addresses, a host that does not resolve, not http/https; `invalid_webhook`, `field` "
               "`url`), a secret not in the `whsec_` form, or all_sessions without staff rights.")


def _webhook(request: Request, webhook_id: str) -> WebhookEndpoint:
    try:
        return selectors.webhook_endpoint_get(user=request.user, endpoint_id=webhook_id)
    except WebhookEndpoint.DoesNotExist as exc:
        raise NotFound("No such webhook endpoint.") from exc


@extend_schema_view(
    get=extend_schema(
        summary="List your webhook endpoints, newest first",
        responses={200: WebhookEndpointSerializer(many=True), **error_responses(s404="`page` is past the last page.")},
    ),
    post=extend_schema(
        summary="Register a webhook endpoint",
        request=WebhookEndpointWriteSerializer,
        responses={201: WebhookEndpointCreatedSerializer, **error_responses(403, 413, 415, s400=WEBHOOK_400)},
    ),
)
class WebhookListCreateView(_ApiView, generics.ListAPIView):
    """Your webhook endpoints: list them (paged) or register one (201 with its secret, shown once).

    ``GET /api/webhooks/`` and ``POST /api/webhooks/`` with ``{"url", "event_types", "secret"?,
    "all_sessions"?}``. The URL must resolve to public addresses only (400 otherwise)."""

    serializer_class = WebhookEndpointSerializer
    pagination_class = StandardPagination

    def get_queryset(self) -> QuerySet[WebhookEndpoint]:
        return selectors.webhook_endpoint_list(user=self.request.user)

    def post(self, request: Request) -> Response:
        body = WebhookEndpointWriteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        if "active" in data:
            raise BadRequest("active is set with PATCH /api/webhooks/{id}/; an endpoint starts active",
                             code="invalid_webhook")
        endpoint = services.webhook_endpoint_create(
            owner=request.user, url=data["url"], event_types=data["event_types"], secret=data.get("secret", ""),
            all_sessions=data.get("all_sessions", False))
        return Response(WebhookEndpointCreatedSerializer(endpoint).data, status=status.HTTP_201_CREATED)


@extend_schema_view(
    get=extend_schema(summary="Get one of your webhook endpoints", parameters=[WEBHOOK_ID_PARAM],
                      responses={200: WebhookEndpointSerializer, **error_responses(s404=NO_WEBHOOK)}),
    patch=extend_schema(summary="Change a webhook endpoint (URL, event types, re-enable or disable)",
                        parameters=[WEBHOOK_ID_PARAM], request=WebhookEndpointWriteSerializer,
                        responses={200: WebhookEndpointSerializer,
                                   **error_responses(403, 413, 415, s400=WEBHOOK_400, s404=NO_WEBHOOK)}),
    delete=extend_schema(summary="Delete a webhook endpoint and its deliveries", parameters=[WEBHOOK_ID_PARAM],
                         responses={204: None, **error_responses(403, s404=NO_WEBHOOK)}),
)
class WebhookDetailView(_ApiView):
    """One of your webhook endpoints: read it, change it (PATCH, which also re-enables it), delete it.

    ``GET``, ``PATCH`` and ``DELETE /api/webhooks/{id}/``. The secret is never shown again; to change it,
    register a new endpoint and delete this one."""

    serializer_class = WebhookEndpointSerializer
    queryset = WebhookEndpoint.objects.none()

    def get(self, request: Request, webhook_id: str) -> Response:
        return Response(WebhookEndpointSerializer(_webhook(request, webhook_id)).data)

    def patch(self, request: Request, webhook_id: str) -> Response:
        endpoint = _webhook(request, webhook_id)
        body = WebhookEndpointWriteSerializer(data=request.data, partial=True)
        body.is_valid(raise_exception=True)
        changes = dict(body.validated_data)
        if "secret" in changes:
            raise BadRequest("the secret cannot be changed; register a new endpoint and delete this one",
                             code="invalid_webhook")
        endpoint = services.webhook_endpoint_update(endpoint=endpoint, user=request.user, changes=changes)
        return Response(WebhookEndpointSerializer(endpoint).data)

    def delete(self, request: Request, webhook_id: str) -> Response:
        services.webhook_endpoint_delete(endpoint=_webhook(request, webhook_id))
        return Response(status=status.HTTP_204_NO_CONTENT)


@extend_schema(
    summary="A webhook endpoint's deliveries with their attempts, newest first",
    parameters=[WEBHOOK_ID_PARAM],
    responses={200: WebhookDeliverySerializer(many=True),
               **error_responses(s404="No such webhook endpoint among yours, or `page` is past the last page.")},
)
class WebhookDeliveryListView(_ApiView, generics.ListAPIView):
    """A webhook endpoint's deliveries (one per event), newest first, each with its HTTP attempts.

    ``GET /api/webhooks/{id}/deliveries/`` (paged)."""

    serializer_class = WebhookDeliverySerializer
    pagination_class = StandardPagination

    def get_queryset(self) -> QuerySet[WebhookDelivery]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular schema generation
            return WebhookDelivery.objects.none()
        return selectors.webhook_delivery_list(endpoint=_webhook(self.request, self.kwargs["webhook_id"]))
