"""The admin's "Add session" under a race on the id (``docs/contract.md`` §9: the API answers 409
``session_id_taken``): a duplicate is a form error, never a 500, even for 12
concurrent POSTs of one ``id`` (the insert losing the race after the form's check)."""
import threading
from html import unescape

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from hermes_sessions import services
from hermes_sessions.models import Session

pytestmark = pytest.mark.django_db(transaction=True)  # real threads, real connections

ADD_URL = reverse("admin:hermes_sessions_session_add")


def _form(owner, session_id):
    return {"id": session_id, "owner": owner.pk, "title": "raced", "model_config": "{}"}


def test_an_id_inserted_between_the_form_check_and_the_insert_is_a_form_error(admin_client, admin_user, monkeypatch):
    real_create = services.session_create

    def raced_create(**kwargs):  # another connection commits the same id first
        other = threading.Thread(target=lambda: (real_create(**kwargs), connection.close()))
        other.start()
        other.join(10)
        return real_create(**kwargs)

    monkeypatch.setattr(services, "session_create", raced_create)
    response = admin_client.post(ADD_URL, _form(admin_user, "raced.1"))
    assert response.status_code == 200
    assert "session id 'raced.1' is already taken" in unescape(response.content.decode())
    assert Session.objects.filter(pk="raced.1").count() == 1


def test_twelve_concurrent_adds_of_one_id_make_one_session_and_form_errors(admin_user):
    clients = []
    for _ in range(12):
        client = Client()
        client.force_login(admin_user)
        clients.append(client)
    start, statuses = threading.Barrier(12), []

    def post(client):
        try:
            start.wait(10)
            response = client.post(ADD_URL, _form(admin_user, "raced.12"))
            ok = response.status_code == 302 or "is already taken" in unescape(response.content.decode())
            statuses.append((response.status_code, ok))
        except BaseException as exc:  # noqa: BLE001 - a 500 raises out of the test client
            statuses.append((repr(exc), False))
        finally:
            connection.close()

    threads = [threading.Thread(target=post, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(statuses) == 12 and all(ok for _, ok in statuses), statuses
    assert sorted(code for code, _ in statuses) == [200] * 11 + [302]
    assert Session.objects.filter(pk="raced.12").count() == 1
