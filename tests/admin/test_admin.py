"""Admin: the annotated sessions list, the session page (notice banner, read-only transcript,
bindings and turns) and acknowledging notices."""
from __future__ import annotations

import pytest
from django.contrib.admin.utils import quote
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from hermes_sessions.models import Notice
from tests.factories import CodexBindingFactory, MessageFactory, NoticeFactory, SessionFactory, TurnFactory

pytestmark = pytest.mark.django_db

SESSIONS_URL = reverse("admin:hermes_sessions_session_changelist")
NOTICES_URL = reverse("admin:hermes_sessions_notice_changelist")


def session_url(session_id: str) -> str:
    return reverse("admin:hermes_sessions_session_change", args=[quote(session_id)])


def busy_session(**kwargs):
    session = SessionFactory(**kwargs)
    TurnFactory(session=session, seq=1, status="succeeded")
    TurnFactory(session=session, seq=2, status="failed", error="codex exited")
    CodexBindingFactory(session=session, thread_id="thread-old", status="ended", ended_reason="gone")
    CodexBindingFactory(session=session, thread_id="thread-active")
    NoticeFactory(session=session, text="Codex thread could not be resumed; starting a new one.")
    NoticeFactory(session=session, text="an acknowledged notice", acknowledged_at=timezone.now())
    return session


def test_session_changelist_shows_annotated_counts(admin_client):
    session = busy_session(title="Busy one")
    response = admin_client.get(SESSIONS_URL)
    assert response.status_code == 200
    row = next(r for r in response.context["cl"].result_list if r.pk == session.pk)
    assert row.turn_count == 2
    assert row.unacknowledged_notice_count == 1
    assert row.active_thread_id == "thread-active"
    assert row.last_activity is not None
    html = response.content.decode()
    assert "thread-active" in html
    assert "Busy one" in html


def test_session_changelist_query_count_does_not_grow_with_sessions(admin_client):
    busy_session()

    def count_queries() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert admin_client.get(SESSIONS_URL).status_code == 200
        return len(ctx.captured_queries)

    one = count_queries()
    for _ in range(5):
        busy_session()
    assert count_queries() == one


def test_session_page_shows_unacknowledged_notices_at_the_top(admin_client):
    session = busy_session(id="a.b:c")
    response = admin_client.get(session_url(session.id))
    assert response.status_code == 200
    html = response.content.decode()
    banner = html.index('<ul class="messagelist" id="session-notices">')
    assert html.index("Codex thread could not be resumed; starting a new one.", banner) < html.index('<div id="content"')
    assert '<li class="warning"><span class="notice-text">Codex thread could not be resumed' in html
    assert "an acknowledged notice" not in html


def test_session_page_without_notices_has_no_banner(admin_client):
    session = SessionFactory()
    NoticeFactory(session=session, text="done already", acknowledged_at=timezone.now())
    html = admin_client.get(session_url(session.id)).content.decode()
    assert 'id="session-notices"' not in html
    assert "done already" not in html


def test_banner_link_opens_the_sessions_unacknowledged_notices(admin_client):
    session = busy_session(id="link.test:1")
    NoticeFactory(session=SessionFactory(), text="elsewhere")
    url = f"{NOTICES_URL}?session__id__exact={session.id}&acknowledged=no"
    response = admin_client.get(url)
    assert response.status_code == 200  # not a ?e=1 redirect for a disallowed lookup
    assert [n.session_id for n in response.context["cl"].result_list] == [session.id]


def test_session_page_shows_transcript_bindings_and_turns_read_only(admin_client):
    session = busy_session()
    for seq in (3, 1, 2):
        MessageFactory(session=session, seq=seq, content=f"transcript-row-{seq}")
    response = admin_client.get(session_url(session.id))
    html = response.content.decode()
    positions = [html.index(f"transcript-row-{seq}") for seq in (3, 2, 1)]
    assert positions == sorted(positions)  # newest first
    assert "thread-old" in html and "gone" in html  # binding history with the reason it ended
    assert "codex exited" in html  # the failed turn's error
    assert 'name="_save"' not in html  # view-only page
    for formset in response.context["inline_admin_formsets"]:
        assert not formset.has_add_permission
        assert not formset.has_change_permission
        assert not formset.has_delete_permission


def test_sessions_cannot_be_changed_or_deleted_in_the_admin(admin_client):
    session = SessionFactory(title="original")
    assert admin_client.get(reverse("admin:hermes_sessions_session_delete", args=[session.pk])).status_code == 403
    response = admin_client.post(session_url(session.id), {"title": "changed"})
    assert response.status_code == 403
    session.refresh_from_db()
    assert session.title == "original"


def test_acknowledge_action_marks_selected_notices(admin_client, admin_user):
    session = SessionFactory()
    first = NoticeFactory(session=session)
    second = NoticeFactory(session=session, text="second")
    untouched = NoticeFactory(session=session, text="untouched")
    response = admin_client.post(
        NOTICES_URL, {"action": "acknowledge_notices", "_selected_action": [first.pk, second.pk]}, follow=True
    )
    assert response.status_code == 200
    assert "Acknowledged 2 notices." in response.content.decode()
    for notice in (first, second):
        notice.refresh_from_db()
        assert notice.acknowledged_at is not None
        assert notice.acknowledged_by == admin_user
    untouched.refresh_from_db()
    assert untouched.acknowledged_at is None
    html = admin_client.get(session_url(session.id)).content.decode()
    banner = html.split('<ul class="messagelist" id="session-notices">')[1].split("</ul>")[0]
    assert "untouched" in banner and "second" not in banner


def test_notice_list_filters_by_acknowledged(admin_client):
    open_notice = NoticeFactory(text="open one")
    done = NoticeFactory(text="done one", acknowledged_at=timezone.now())
    unacked = admin_client.get(NOTICES_URL + "?acknowledged=no").context["cl"].result_list
    acked = admin_client.get(NOTICES_URL + "?acknowledged=yes").context["cl"].result_list
    assert [n.pk for n in unacked] == [open_notice.pk]
    assert [n.pk for n in acked] == [done.pk]


def test_notice_page_is_view_only(admin_client):
    notice = NoticeFactory(text="keep me")
    url = reverse("admin:hermes_sessions_notice_change", args=[notice.pk])
    assert admin_client.get(url).status_code == 200
    assert admin_client.post(url, {"text": "changed"}).status_code == 403
    assert admin_client.post(reverse("admin:hermes_sessions_notice_delete", args=[notice.pk]), {"post": "yes"}).status_code == 403
    notice.refresh_from_db()
    assert notice.text == "keep me"
    assert Notice.objects.count() == 1


def test_turn_admin_is_view_only(admin_client):
    turn = TurnFactory(seq=1)
    assert admin_client.get(reverse("admin:hermes_sessions_turn_changelist")).status_code == 200
    url = reverse("admin:hermes_sessions_turn_change", args=[turn.pk])
    assert admin_client.get(url).status_code == 200
    assert admin_client.post(url, {"status": "failed"}).status_code == 403
    assert admin_client.get(reverse("admin:hermes_sessions_turn_delete", args=[turn.pk])).status_code == 403


def test_malformed_session_id_in_admin_url_is_not_a_500(admin_client):
    response = admin_client.get("/admin/hermes_sessions/session/bad%00id/change/")
    assert response.status_code == 400  # RejectNulMiddleware: no URL of ours may carry NUL
    response = admin_client.get("/admin/hermes_sessions/session/bad%0Aid/change/")
    assert response.status_code == 404  # a newline: not an id the admin can resolve; not a 500


def test_end_binding_action_ends_the_active_binding_with_a_notice(admin_client):
    from hermes_sessions.models import CodexBinding as Binding

    session = SessionFactory(id="sess-stuck")
    Binding.objects.create(session=session, thread_id="t-1")
    response = admin_client.post(
        "/admin/hermes_sessions/session/",
        {"action": "end_codex_binding", "_selected_action": [session.pk]},
        follow=True,
    )
    assert response.status_code == 200
    binding = Binding.objects.get(session=session)
    assert binding.status == Binding.Status.ENDED and "ended by operator" in binding.ended_reason
    assert session.notices.count() == 1


@pytest.mark.parametrize("q", ["%20", "%20%20%09"])
def test_a_whitespace_only_search_shows_its_reason_as_a_too_long_one_does(admin_client, q):
    session = busy_session(id="sess-blank-q")
    MessageFactory(session=session, seq=1, content="hello")
    html = admin_client.get(session_url(session.id) + "?q=" + q).content.decode()
    assert 'id="transcript-search-error"' in html and "q must not be empty" in html
    html = admin_client.get(reverse("admin:hermes_sessions_message_changelist") + "?q=" + q).content.decode()
    assert 'id="message-search-error"' in html and "q must not be empty" in html
    # An empty q is no search at all: the form alone, no error.
    assert 'id="message-search-error"' not in admin_client.get(
        reverse("admin:hermes_sessions_message_changelist") + "?q=").content.decode()


def test_the_session_pages_turns_table_is_newest_first_like_the_transcript(admin_client):
    import re

    session = busy_session(id="sess-turn-order")
    TurnFactory(session=session, seq=3, status="succeeded")
    html = admin_client.get(session_url(session.id)).content.decode()
    assert [int(s) for s in re.findall(r'<tr id="turn-(\d+)"', html)] == [3, 2, 1]


def test_the_read_only_session_page_closes_at_its_bottom_and_links_all_turns_visibly(admin_client):
    """The Close button sits at the page's bottom, not mid-page between the binding history and the
    session's sections under an empty bar; the "all turns" link is visible, not inside a module heading
    in the heading's own background colour."""
    session = SessionFactory()
    html = admin_client.get(session_url(session.id)).content.decode()
    assert html.count('class="closelink"') == 1
    assert html.index('id="session-operations"') < html.index('id="session-close-row"') < html.index('class="closelink"')
    assert 'class="submit-row"' not in html[:html.index('id="session-operations"')]
    link = html.index('id="all-turns"')
    assert html.rfind("<h2", 0, link) < html.rfind("</h2>", 0, link)  # not inside a heading
