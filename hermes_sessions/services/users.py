"""The acting user of a service call, as the services need it: a real account row."""
from __future__ import annotations

from django.contrib.auth.models import AnonymousUser, User

from .errors import ServiceError


def require_user(user: User | AnonymousUser | None) -> User:
    """``user`` itself when it is an account; raises ``ServiceError`` for the anonymous user (the API
    only calls services for authenticated requests, so this is a guard, not a code path)."""
    if user is None or isinstance(user, AnonymousUser):
        raise ServiceError("an authenticated user is required")
    return user
