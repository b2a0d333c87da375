"""Session and notice writes."""
from __future__ import annotations

from typing import Iterable

from django.db import IntegrityError, transaction
from django.utils import timezone

from .. import policy
from ..models import CodexBinding, Notice, Session
from ..sanitize import clean_json, clean_text
from .errors import SessionIdTaken

# --- sessions ------------------------------------------------------------------------------------


def session_create(*, owner, session_id: str | None = None, title: str = "", model_config: dict | None = None) -> Session:
    """Create a session owned by ``owner``.

    ``session_id`` is the client's choice (validated against ``models.SESSION_ID_RE``) or a generated
    ``sess-<hex>``. ``model_config`` is cleaned by ``policy.validate_model_config`` (raises
    ``policy.PolicyError``). Raises ``SessionIdTaken`` when the id exists (whoever owns it).
    """
    config = policy.validate_model_config(model_config, is_staff=bool(getattr(owner, "is_staff", False)))
    session = Session(owner=owner, title=clean_text(title, max_chars=200), model_config=clean_json(config))
    if session_id:
        session.id = session_id
    session.full_clean(exclude=["owner"], validate_unique=False)
    try:
        with transaction.atomic():
            session.save(force_insert=True)
    except IntegrityError as exc:
        raise SessionIdTaken(f"session id {session.id!r} is already taken") from exc
    return session




NOTICE_BINDING_ENDED = "Codex thread binding ended by an operator; the next turn starts a new one."


def binding_end(*, session: Session, reason: str) -> bool:
    """End the session's active binding (an operator's decision) and record a notice; the next turn
    then starts a fresh thread seeded with the transcript. Returns False when there was none."""
    with transaction.atomic():
        Session.objects.select_for_update().get(pk=session.pk)
        ended = CodexBinding.objects.filter(session=session, status=CodexBinding.Status.ACTIVE).update(
            status=CodexBinding.Status.ENDED, ended_at=timezone.now(), ended_reason=clean_text(reason, max_chars=1000)
        )
        if ended:
            Notice.objects.create(session=session, kind=Notice.Kind.LIFECYCLE, text=NOTICE_BINDING_ENDED)
        return bool(ended)


# --- notices ---------------------------------------------------------------------------------------


def notice_acknowledge(*, notices: Iterable[Notice], user) -> int:
    """Mark unacknowledged notices acknowledged by ``user``; returns how many changed."""
    ids = [n.pk for n in notices]
    with transaction.atomic():
        return Notice.objects.filter(pk__in=ids, acknowledged_at__isnull=True).update(
            acknowledged_at=timezone.now(), acknowledged_by=user
        )
