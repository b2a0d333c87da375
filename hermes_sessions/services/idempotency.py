"""``Idempotency-Key`` handling for POST endpoints.

The first request with a key runs and records ``(user, scope, key) → object id`` in the same
transaction as the object it creates; a repeat with the same body gets that object back, a repeat
with a different body gets ``IdempotencyMismatch``. Concurrent requests with one key serialize on a
transaction-scoped PostgreSQL advisory lock, so exactly one creates. Keys are kept
``settings.HERMES_IDEMPOTENCY_TTL`` seconds (default 24 h); the sweep deletes older ones.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.db import OperationalError, transaction
from django.db.models import Model
from django.utils import timezone

from ..models import IdempotencyKey
from .errors import IdempotencyKeyInUse, IdempotencyMismatch, InvalidIdempotencyKey
from .locks import advisory_xact_lock, bound_lock_waits, lock_wait_timed_out
from .users import require_user

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User

T = TypeVar("T", bound=Model)
MAX_KEY_CHARS = 255


def request_hash(body: Any) -> str:
    """sha256 of the canonical JSON of ``body`` (key order ignored)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode("utf-8", "surrogatepass")).hexdigest()


def idempotent(
    *, user: User | AnonymousUser, scope: str, key: str | None, body: Any, create: Callable[[], T], load: Callable[[str], T]
) -> tuple[T, bool]:
    """Run ``create()`` once per ``(user, scope, key)``; return ``(object, created)``.

    ``key`` None: no idempotency, just ``create()``. A key whose object has since been deleted runs
    ``create()`` again (the key then names the new object). Raises ``InvalidIdempotencyKey`` for a malformed key,
    ``IdempotencyMismatch`` when the key was used with a different ``body``, and ``IdempotencyKeyInUse`` when a
    request with the same key held it longer than ``HERMES_POST_LOCK_TIMEOUT_MS``: unbounded, such
    requests would queue one behind another on the key's lock, each holding a pooled connection
    (``tests/api/test_session_lock_wait.py``).
    """
    if key is None:
        return create(), True
    if not key or len(key) > MAX_KEY_CHARS or not (key.isascii() and key.isprintable()):
        # ASCII only: HTTP headers arrive latin-1-decoded, so anything else would be judged by accident.
        raise InvalidIdempotencyKey(f"Idempotency-Key must be 1-{MAX_KEY_CHARS} printable ASCII characters")
    digest = request_hash(body)
    user = require_user(user)
    with transaction.atomic():
        bound_lock_waits()  # a request with the same key in progress is waited for, boundedly
        try:
            advisory_xact_lock(f"idempotency:{user.pk}:{scope}:{key}")
        except OperationalError as exc:
            if lock_wait_timed_out(exc):
                raise IdempotencyKeyInUse("a request with this Idempotency-Key is still in progress; retry shortly "
                                          "for its result") from exc
            raise
        fresh_after = timezone.now() - timedelta(seconds=settings.HERMES_IDEMPOTENCY_TTL)
        row = IdempotencyKey.objects.filter(user=user, scope=scope, key=key).first()
        if row is not None and row.created_at >= fresh_after:
            if row.request_hash != digest:
                raise IdempotencyMismatch("this Idempotency-Key was already used with a different request body")
            try:
                return load(row.object_id), False
            except ObjectDoesNotExist:
                pass  # the object was deleted since (e.g. by an operator): the key is spent; run afresh
        obj = create()
        IdempotencyKey.objects.update_or_create(
            user=user, scope=scope, key=key,
            defaults={"request_hash": digest, "object_id": str(obj.pk), "created_at": timezone.now()},
        )
        return obj, True
