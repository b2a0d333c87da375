"""Session writes (bindings and notices: ``bindings.py``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction

from .. import policy
from ..models import Session
from ..sanitize import clean_json, clean_text
from .errors import SessionIdTaken
from .users import require_user

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User


def session_create(
    *, owner: User | AnonymousUser, session_id: str | None = None, title: str = "", model_config: dict[str, Any] | None = None
) -> Session:
    """Create a session owned by ``owner``.

    ``session_id`` is the client's choice (validated against ``models.SESSION_ID_RE``) or a generated
    ``sess-<hex>``. ``model_config`` is cleaned by ``policy.validate_model_config`` (raises
    ``policy.PolicyError``). Raises ``SessionIdTaken`` when the id exists, whoever owns it, with a
    message that names only the id: ids are one namespace for all users, so "taken" is the one thing a
    caller learns about another user's session (``docs/contract.md`` §9, "Session ids").
    """
    config = policy.validate_model_config(model_config, is_staff=bool(getattr(owner, "is_staff", False)))
    session = Session(owner=require_user(owner), title=clean_text(title, max_chars=200), model_config=clean_json(config))
    if session_id:
        session.id = session_id
    session.full_clean(exclude=["owner"], validate_unique=False)
    try:
        with transaction.atomic():
            session.save(force_insert=True)
    except IntegrityError as exc:
        if not Session.objects.filter(pk=session.id).exists():
            raise  # another constraint, not the id: not the client's "id taken"
        raise SessionIdTaken(f"session id {session.id!r} is already taken") from exc
    return session
