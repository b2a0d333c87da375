"""``serializers.FieldsBuiltOnce``: the API's model serializers build their fields from the model once per
class and deep-copy them per instance (DRF's field building was ~26 % of a turn POST's CPU, session 13) —
with exactly the fields, and so exactly the output, DRF's own ``ModelSerializer.get_fields`` gives."""
from __future__ import annotations

import pytest
from rest_framework import serializers

from hermes_sessions.api.serializers import (
    MessageSearchResultSerializer,
    MessageSerializer,
    NoticeSerializer,
    SessionSerializer,
    TurnSerializer,
)
from tests.factories import TurnFactory

pytestmark = pytest.mark.django_db

HOT = [SessionSerializer, TurnSerializer, MessageSerializer, MessageSearchResultSerializer, NoticeSerializer]


@pytest.mark.parametrize("serializer_class", HOT, ids=lambda c: c.__name__)
def test_the_fields_are_drfs_own(serializer_class):
    ours = serializer_class().fields
    drfs = serializers.ModelSerializer.get_fields(serializer_class())  # DRF's building, past the mixin
    assert list(ours) == list(drfs)
    assert {name: repr(field) for name, field in ours.items()} == {name: repr(field) for name, field in drfs.items()}


def test_they_are_built_once_per_class_and_never_shared_between_instances(monkeypatch):
    monkeypatch.delattr(TurnSerializer, "_fields_built_once", raising=False)
    built: list[str] = []
    real = serializers.ModelSerializer.build_field
    monkeypatch.setattr(serializers.ModelSerializer, "build_field",
                        lambda self, name, *a: (built.append(name), real(self, name, *a))[1])
    turn = TurnFactory()
    first, second = TurnSerializer(turn), TurnSerializer(turn)
    assert first.data == second.data and first.data["id"] == str(turn.pk) and first.data["seq"] == turn.seq
    assert len(built) == len(set(built)) > 0  # each model field built once, for the first instance only
    assert first.fields["seq"] is not second.fields["seq"] and first.fields["seq"].parent is first

def test_a_subclass_builds_its_own():
    assert "session" not in MessageSerializer().fields and "session" in MessageSearchResultSerializer().fields
    assert "session" not in MessageSerializer().fields
