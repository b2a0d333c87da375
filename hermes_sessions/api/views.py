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
from rest_framework import generics, status
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from .. import selectors, services
from ..models import Message, Notice, Session, Turn
from .errors import BadRequest
from .pagination import (
    MessageSearchPagination,
    StandardPagination,
    TranscriptPagination,
    TranscriptSearchPagination,
)
from .parsers import SafeJSONParser
from .serializers import (
    MessageSearchResultSerializer,
    MessageSerializer,
    NoticeSerializer,
    SessionCreateSerializer,
    SessionSerializer,
    TurnCreateSerializer,
    TurnSerializer,
)

IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=False,
    description="Repeat-safe POST: the same key with the same body returns the object the first request created "
    "(kept 24 h, per user); with a different body the answer is 422.",
)


def _idempotency_key(request: Request) -> str | None:
    return request.headers.get("Idempotency-Key")


SESSION_ID_PARAM = OpenApiParameter(
    "session_id", OpenApiTypes.STR, OpenApiParameter.PATH, description="The session id (see POST /api/sessions/)."
)


class _ApiView(generics.GenericAPIView):
    """Common settings: JSON bodies only. DRF reads a JSON body through Django's ``request.body``,
    which enforces ``settings.DATA_UPLOAD_MAX_MEMORY_SIZE`` (``RequestDataTooBig`` → 413 in
    ``api.errors``)."""

    parser_classes = [SafeJSONParser]

    def get_session(self) -> Session:
        """The caller's session named by the ``session_id`` URL segment, or 404."""
        try:
            return selectors.session_get(user=self.request.user, session_id=self.kwargs["session_id"])
        except Session.DoesNotExist as exc:
            raise NotFound("No such session.") from exc


@extend_schema_view(
    get=extend_schema(summary="List your sessions", responses=SessionSerializer(many=True)),
    post=extend_schema(
        summary="Create a session",
        parameters=[IDEMPOTENCY_KEY],
        request=SessionCreateSerializer,
        responses={
            201: SessionSerializer,
            400: OpenApiResponse(description="Malformed id or body, or a model_config setting outside policy."),
            403: OpenApiResponse(description="A model_config setting reserved to staff."),
            409: OpenApiResponse(description="The session id is taken."),
            422: OpenApiResponse(description="The Idempotency-Key was used with a different body."),
        },
    ),
)
class SessionListCreateView(_ApiView, generics.ListCreateAPIView):
    """``GET /api/sessions/`` (paginated) and ``POST /api/sessions/``."""

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
            load=lambda pk: Session.objects.get(pk=pk),
        )
        session = selectors.session_get(user=request.user, session_id=session.id)
        return Response(SessionSerializer(session).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


@extend_schema(summary="Get one of your sessions", parameters=[SESSION_ID_PARAM])
class SessionDetailView(_ApiView, generics.RetrieveAPIView):
    """``GET /api/sessions/{id}/``."""

    serializer_class = SessionSerializer
    queryset = Session.objects.none()  # lookups go through get_session(); this only names the model

    def get_object(self) -> Session:
        return self.get_session()


@extend_schema(
    summary="Send an input to a session (queues a turn)",
    parameters=[SESSION_ID_PARAM, IDEMPOTENCY_KEY],
    request=TurnCreateSerializer,
    responses={
        202: TurnSerializer,
        400: OpenApiResponse(description="Missing, empty, non-string or too long input."),
        404: OpenApiResponse(description="No such session."),
        409: OpenApiResponse(description="on_busy=reject and the session has a turn running or queued (named in `turn`)."),
        422: OpenApiResponse(description="The Idempotency-Key was used with a different body."),
    },
)
class TurnCreateView(_ApiView):
    """``POST /api/sessions/{id}/turns/`` → 202 with the queued turn; a worker runs it."""

    serializer_class = TurnCreateSerializer
    queryset = Turn.objects.none()

    def post(self, request: Request, session_id: str) -> Response:
        session = self.get_session()
        body = TurnCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        turn, _ = services.idempotent(
            user=request.user,
            scope=f"turns:{session.id}",
            key=_idempotency_key(request),
            body=request.data,
            create=lambda: services.turn_enqueue(
                session=session,
                input_text=body.validated_data["input"],
                user=request.user,
                on_busy=body.validated_data["on_busy"],
            ),
            load=lambda pk: Turn.objects.get(pk=pk),
        )
        return Response(TurnSerializer(turn).data, status=status.HTTP_202_ACCEPTED)


@extend_schema(
    summary="Cancel a turn",
    parameters=[OpenApiParameter("turn_id", OpenApiTypes.UUID, OpenApiParameter.PATH)],
    request=None,
    responses={
        202: TurnSerializer,
        404: OpenApiResponse(description="No such turn."),
        409: OpenApiResponse(description="The turn already finished (`turn` holds it)."),
    },
)
class TurnCancelView(_ApiView):
    """``POST /api/turns/{id}/cancel/`` → 202 with the turn as it is now: a queued turn is
    ``cancelled`` at once; a running one is still ``running`` — its worker sends ``turn/interrupt``
    within a second and it then ends ``cancelled`` with what codex completed before it. A finished
    turn answers 409."""

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
    parameters=[OpenApiParameter("turn_id", OpenApiTypes.UUID, OpenApiParameter.PATH)],
)
class TurnDetailView(_ApiView, generics.RetrieveAPIView):
    """``GET /api/turns/{id}/``."""

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
        {"type": "string", "minLength": 1, "maxLength": selectors.MAX_SEARCH_CHARS, "pattern": r"\S"},
        OpenApiParameter.QUERY,
        required=required,
        description=f"Full-text search of the messages' content, web-search syntax (words are ANDed, "
        f'"a phrase", `or`, `-word`; PostgreSQL\'s `simple` configuration: no stemming). 1-{selectors.MAX_SEARCH_CHARS} '
        "characters, not only whitespace; matches come newest first.",
    )


SEARCH_400 = OpenApiResponse(description="`q` is empty or too long (`code`: `invalid_search`).")


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
    responses={200: MessageSerializer(many=True), 400: SEARCH_400, 404: OpenApiResponse(description="No such session.")},
)
class MessageListView(_ApiView, generics.ListAPIView):
    """``GET /api/sessions/{id}/messages/`` — cursor-paginated by ``seq``; with ``?q=`` the rows
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
    responses={200: MessageSearchResultSerializer(many=True), 400: SEARCH_400},
)
class MessageSearchView(_ApiView, generics.ListAPIView):
    """``GET /api/messages/?q=`` — messages matching ``q`` in the caller's sessions only
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


@extend_schema(summary="A session's notices, newest first", parameters=[SESSION_ID_PARAM])
class NoticeListView(_ApiView, generics.ListAPIView):
    """``GET /api/sessions/{id}/notices/``."""

    serializer_class = NoticeSerializer
    pagination_class = StandardPagination

    def get_queryset(self) -> QuerySet[Notice]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular schema generation
            return Notice.objects.none()
        return selectors.notice_list(session=self.get_session())
