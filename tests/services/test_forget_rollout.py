"""``manage.py forget_rollout``: the way to provoke a rotation on the production shape (docs/operating.md)."""
import pytest
from django.core.management import CommandError, call_command

from hermes_sessions import services
from hermes_sessions.models import CodexBinding, CodexRollout, Notice, Turn

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_next_turn_rotates_with_one_notice(user, scripted_codex, run_turn_now, capsys):
    session = services.session_create(owner=user, session_id="sess-forget")
    t1 = run_turn_now(session=session, text="hello one", user=user)
    assert CodexRollout.objects.filter(thread_id=t1.codex_thread_id).exists()
    call_command("forget_rollout", "sess-forget")
    assert f"forgot the rollout of thread {t1.codex_thread_id}" in capsys.readouterr().out
    assert not CodexRollout.objects.filter(thread_id=t1.codex_thread_id).exists()
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t2.status, t2.thread_action) == (Turn.Status.SUCCEEDED, "rotated")
    assert t2.codex_thread_id != t1.codex_thread_id
    assert Notice.objects.filter(session=session).count() == 1
    assert CodexBinding.objects.get(session=session, status="active").thread_id == t2.codex_thread_id


def test_it_refuses_what_it_cannot_do(user, scripted_codex, run_turn_now):
    with pytest.raises(CommandError, match="no session 'nope'"):
        call_command("forget_rollout", "nope")
    session = services.session_create(owner=user, session_id="sess-new")
    with pytest.raises(CommandError, match="has no bound thread"):
        call_command("forget_rollout", "sess-new")
    run_turn_now(session=session, text="hello", user=user)
    call_command("forget_rollout", "sess-new")
    with pytest.raises(CommandError, match="has no stored rollout"):
        call_command("forget_rollout", "sess-new")


def test_it_refuses_while_a_turn_runs(user, scripted_codex, run_turn_now):
    """Forgetting the rollout under a running turn would fence that turn's finalize (it would commit nothing,
    wait for its lease and run its input a second time). So it is refused, nothing deleted."""
    session = services.session_create(owner=user, session_id="sess-busy")
    t1 = run_turn_now(session=session, text="hello", user=user)
    running = Turn.objects.create(session=session, seq=2, input="still running", status=Turn.Status.RUNNING)
    with pytest.raises(CommandError, match="has a running turn"):
        call_command("forget_rollout", "sess-busy")
    assert CodexRollout.objects.filter(thread_id=t1.codex_thread_id).exists()
    Turn.objects.filter(pk=running.pk).update(status=Turn.Status.SUCCEEDED)
    call_command("forget_rollout", "sess-busy")
    assert not CodexRollout.objects.filter(thread_id=t1.codex_thread_id).exists()
