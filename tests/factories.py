"""factory_boy factories for the hermes_sessions models.

They write rows directly (bypassing the services) so tests can set up any state; sequence
numbers are explicit per session where uniqueness matters (``MessageFactory`` / ``TurnFactory``
take ``seq`` or draw from a global counter, which is unique within any session too).
"""
from __future__ import annotations

from datetime import timedelta

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone

from hermes_sessions.models import Approval, CodexBinding, Message, Notice, Session, Turn, WebhookEndpoint


class UserFactory(factory.django.DjangoModelFactory):
    """A non-staff user with password ``pw``."""

    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.com")
    password = factory.django.Password("pw")


class SessionFactory(factory.django.DjangoModelFactory):
    """A session with a ``sess-factory-N`` id."""

    class Meta:
        model = Session

    id = factory.Sequence(lambda n: f"sess-factory-{n}")
    owner = factory.SubFactory(UserFactory)
    title = factory.Sequence(lambda n: f"Session {n}")
    model_config = factory.LazyFunction(dict)


class TurnFactory(factory.django.DjangoModelFactory):
    """A queued turn; pass ``status``, ``seq`` etc. to describe others."""

    class Meta:
        model = Turn

    session = factory.SubFactory(SessionFactory)
    seq = factory.Sequence(lambda n: n + 1)
    input = factory.Sequence(lambda n: f"input {n}")


class MessageFactory(factory.django.DjangoModelFactory):
    """A user transcript row."""

    class Meta:
        model = Message

    session = factory.SubFactory(SessionFactory)
    seq = factory.Sequence(lambda n: n + 1)
    role = Message.Role.USER
    content = factory.Sequence(lambda n: f"message {n}")


class CodexBindingFactory(factory.django.DjangoModelFactory):
    """An active binding to a made-up thread id."""

    class Meta:
        model = CodexBinding

    session = factory.SubFactory(SessionFactory)
    thread_id = factory.Sequence(lambda n: f"019a0000-0000-7000-8000-{n:012d}")
    status = CodexBinding.Status.ACTIVE


class NoticeFactory(factory.django.DjangoModelFactory):
    """An unacknowledged lifecycle notice."""

    class Meta:
        model = Notice

    session = factory.SubFactory(SessionFactory)
    kind = Notice.Kind.LIFECYCLE
    text = "Codex thread could not be resumed; starting a new one."


class ApprovalFactory(factory.django.DjangoModelFactory):
    """A pending command approval of ``turn`` (pass one), expiring in an hour."""

    class Meta:
        model = Approval

    turn = factory.SubFactory(TurnFactory)
    session = factory.LazyAttribute(lambda a: a.turn.session)
    turn_ref = factory.LazyAttribute(lambda a: a.turn.pk)
    kind = Approval.Kind.COMMAND
    codex_request_id = factory.Sequence(lambda n: str(n + 1))
    request = factory.LazyFunction(lambda: {"method": "item/commandExecution/requestApproval", "command": "ls", "cwd": "/w"})
    available_decisions = factory.LazyFunction(lambda: ["accept", "acceptForSession", "decline"])
    fingerprint = "0" * 64
    expires_at = factory.LazyFunction(lambda: timezone.now() + timedelta(hours=1))


class WebhookEndpointFactory(factory.django.DjangoModelFactory):
    """An active endpoint of ``owner`` for every event type, at a public URL (nothing is sent in tests
    that do not run the sender)."""

    class Meta:
        model = WebhookEndpoint

    owner = factory.SubFactory(UserFactory)
    url = "https://hooks.example.com/hermes"
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    event_types = factory.LazyFunction(lambda: list(WebhookEndpoint.EVENT_TYPES))
