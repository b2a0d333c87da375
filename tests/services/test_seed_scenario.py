"""The seed scenario (docs/contract.md §3) against the scripted app-server stand-in, through the real task code.

Each turn spawns a new app-server process (a "restart"), so the wire sequence per process is what
docs/contract.md §3 pins.
"""
import pytest

from hermes_sessions import services
from hermes_sessions.history_seed import CURRENT_TURN_MARKER
from hermes_sessions.models import CodexBinding, Message, Notice, Turn

pytestmark = pytest.mark.django_db(transaction=True)  # the worker heartbeat uses its own connection

NOTICE = "Codex thread could not be resumed; starting a new one."


def active_binding(session):
    return CodexBinding.objects.get(session=session, status=CodexBinding.Status.ACTIVE)


def test_dead_thread_rotates_once_with_notice(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user, session_id="sess-codex-restart")

    t1 = run_turn_now(session=session, text="hello one", user=user)
    assert (t1.status, t1.error) == (Turn.Status.SUCCEEDED, "")
    assert t1.thread_action == "started"
    assert t1.final_text == "echo: hello one"
    assert scripted_codex.processes()[-1] == ["initialize", "thread/start", "turn/start"]
    assert t1.codex_methods == ["thread/start"]
    thread1 = active_binding(session).thread_id
    assert thread1 == t1.codex_thread_id
    assert t1.usage["total_tokens"] > 0

    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t2.status, t2.thread_action, t2.codex_thread_id) == (Turn.Status.SUCCEEDED, "resumed", thread1)
    assert scripted_codex.processes()[-1] == ["initialize", "thread/resume", "turn/start"]
    assert active_binding(session).thread_id == thread1
    assert not Notice.objects.filter(session=session).exists()

    scripted_codex.remove_rollout(thread1)
    t3 = run_turn_now(session=session, text="hello three", user=user)
    assert (t3.status, t3.thread_action) == (Turn.Status.SUCCEEDED, "rotated"), t3.error
    assert scripted_codex.processes()[-1] == ["initialize", "thread/resume", "thread/start", "turn/start"]
    thread2 = active_binding(session).thread_id
    assert thread2 == t3.codex_thread_id != thread1
    old = CodexBinding.objects.get(session=session, thread_id=thread1)
    assert old.status == CodexBinding.Status.ENDED
    assert "no rollout found for thread id" in old.ended_reason and old.ended_by_turn_id == t3.id
    assert list(Notice.objects.filter(session=session).values_list("text", "turn_id")) == [(NOTICE, t3.id)]

    # A second restart resumes the new thread and rotates nothing.
    t4 = run_turn_now(session=session, text="hello four", user=user)
    assert (t4.status, t4.thread_action, t4.codex_thread_id) == (Turn.Status.SUCCEEDED, "resumed", thread2)
    assert scripted_codex.processes()[-1] == ["initialize", "thread/resume", "turn/start"]
    assert Notice.objects.filter(session=session).count() == 1
    assert CodexBinding.objects.filter(session=session).count() == 2


def test_fresh_thread_input_carries_the_history_seed_but_the_transcript_does_not(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    run_turn_now(session=session, text="hello one", user=user)
    t2 = run_turn_now(session=session, text="hello two", user=user)
    scripted_codex.remove_rollout(t2.codex_thread_id)
    t3 = run_turn_now(session=session, text="hello three", user=user)
    assert t3.thread_action == "rotated"

    inputs = scripted_codex.turn_inputs()
    assert inputs[:2] == ["hello one", "hello two"]  # no seed on a first turn or a resume
    seeded = inputs[2]
    assert seeded.endswith(f"{CURRENT_TURN_MARKER}\nhello three")
    for earlier in ("[USER]\nhello one", "[ASSISTANT]\necho: hello one", "[USER]\nhello two", "[ASSISTANT]\necho: hello two"):
        assert earlier in seeded
    assert seeded.count("hello three") == 1  # the current turn is not in its own seed

    rows = list(Message.objects.filter(session=session).values_list("seq", "role", "content"))
    assert rows == [
        (1, "user", "hello one"),
        (2, "assistant", "echo: hello one"),
        (3, "user", "hello two"),
        (4, "assistant", "echo: hello two"),
        (5, "user", "hello three"),  # the raw text, not the seeded input
        (6, "assistant", f"echo: {seeded}"),  # the stand-in echoes what codex was sent
    ]


ACTIVE_WRITER = {"error": {"code": -32600, "message": "thread {thread_id} already has an active writer"}}

# docs/contract.md §4: none of these rotate. Transient ones are retried on a new app-server (a dead
# worker's app-server releases the thread within milliseconds); the rest fail with the reason.
TRANSIENT = [
    pytest.param(ACTIVE_WRITER, id="active-writer"),
    pytest.param({"error": {"code": -32001, "message": "Server overloaded; retry later."}}, id="overloaded"),
    pytest.param({"exit": 3}, id="process-exits"),
    pytest.param({"hang": True}, id="resume-times-out"),
]
FATAL = [
    pytest.param({"error": {"code": -32600, "message": "session {thread_id} is archived. Run `codex unarchive {thread_id}` to unarchive it first."}},
                 "is archived", id="archived"),
    pytest.param({"error": {"code": -32603, "message": "internal error"}}, "internal error", id="unknown-error"),
    pytest.param({"error": {"code": -32600, "message": "invalid session id: invalid character"}}, "invalid session id", id="invalid-id"),
]


@pytest.fixture
def bound_session(user, scripted_codex, run_turn_now, settings):
    settings.CODEX_REQUEST_TIMEOUT = 1.0
    settings.HERMES_RETRY_DELAYS = (0.05, 0.05)
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    return session, t1.codex_thread_id


def assert_untouched(session, thread_id):
    assert active_binding(session).thread_id == thread_id
    assert not Notice.objects.filter(session=session).exists()
    assert CodexBinding.objects.filter(session=session).count() == 1


@pytest.mark.parametrize("action", TRANSIENT)
def test_transient_resume_errors_are_retried_never_rotated(bound_session, user, scripted_codex, run_turn_now, action):
    session, thread1 = bound_session
    scripted_codex.script({"thread/resume": [action]})
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t2.status, t2.thread_action, t2.codex_thread_id) == (Turn.Status.SUCCEEDED, "resumed", thread1), t2.error
    calls = [c["method"] for c in scripted_codex.calls()]
    assert calls.count("thread/resume") == 2  # the failed one, then the retry (same process for -32001)
    assert calls.count("thread/start") == 1  # turn 1's only
    assert_untouched(session, thread1)


def test_a_writer_that_never_lets_go_fails_the_turn_and_keeps_the_binding(bound_session, user, scripted_codex, run_turn_now):
    session, thread1 = bound_session
    scripted_codex.script({"thread/resume": [ACTIVE_WRITER] * 9})
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert t2.status == Turn.Status.FAILED
    assert "already has an active writer" in t2.error and "binding is kept" in t2.error
    assert "gave up after 3 attempts" in t2.error and t2.attempt == 3  # back to the queue twice first
    assert len([p for p in scripted_codex.processes() if "thread/resume" in p]) == 9  # 3 attempts × (1 + 2 retries)
    assert_untouched(session, thread1)
    t3 = run_turn_now(session=session, text="hello three", user=user)
    assert (t3.status, t3.thread_action, t3.codex_thread_id) == (Turn.Status.SUCCEEDED, "resumed", thread1)


@pytest.mark.parametrize("action,expected", FATAL)
def test_non_rotating_resume_errors_fail_and_keep_the_binding(bound_session, user, scripted_codex, run_turn_now, action, expected):
    session, thread1 = bound_session
    scripted_codex.script({"thread/resume": [action]})
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert t2.status == Turn.Status.FAILED
    assert expected in t2.error
    assert "thread/start" not in scripted_codex.processes()[-1]
    assert_untouched(session, thread1)
    # The binding survived: the next turn resumes the same thread.
    t3 = run_turn_now(session=session, text="hello three", user=user)
    assert (t3.status, t3.thread_action, t3.codex_thread_id) == (Turn.Status.SUCCEEDED, "resumed", thread1)


def test_failed_codex_turn_keeps_the_binding_and_records_the_reason(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    scripted_codex.script({"turn/start": [{"turn_status": "failed", "turn_error": {"message": "model said no"}}]})
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t2.status, t2.thread_action) == (Turn.Status.FAILED, "resumed")
    assert "model said no" in t2.error
    assert active_binding(session).thread_id == t1.codex_thread_id
    assert not Notice.objects.exists()


def test_first_turn_that_never_completes_binds_nothing(user, scripted_codex, run_turn_now, settings):
    settings.CODEX_TURN_TIMEOUT = 1.0
    session = services.session_create(owner=user)
    scripted_codex.script({"turn/start": [{"no_completion": True}]})
    t1 = run_turn_now(session=session, text="hello one", user=user)
    assert t1.status == Turn.Status.FAILED
    assert "did not arrive within" in t1.error
    # I1: the thread's turn is not in our transcript as completed, so it must not be bound.
    assert not CodexBinding.objects.filter(session=session).exists()


def test_turns_of_one_session_run_in_order_one_at_a_time(user, scripted_codex, django_capture_on_commit_callbacks):
    session = services.session_create(owner=user)
    with django_capture_on_commit_callbacks(execute=True):
        turns = [services.turn_enqueue(session=session, input_text=f"msg {i}", user=user) for i in range(3)]
    for t in turns:
        t.refresh_from_db()
    assert [t.status for t in turns] == [Turn.Status.SUCCEEDED] * 3
    assert scripted_codex.turn_inputs() == ["msg 0", "msg 1", "msg 2"]
    assert [t.thread_action for t in turns] == ["started", "resumed", "resumed"]
    contents = list(Message.objects.filter(session=session).values_list("content", flat=True))
    assert contents == ["msg 0", "echo: msg 0", "msg 1", "echo: msg 1", "msg 2", "echo: msg 2"]


def test_a_second_delivery_of_a_finished_turn_changes_nothing(user, scripted_codex, run_turn_now):
    from hermes_sessions.tasks import run_turn

    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    before = (Message.objects.count(), CodexBinding.objects.count(), len(scripted_codex.calls()))
    assert run_turn(str(t1.id)) == {"turn": str(t1.id), "turn_status": "skipped"}
    assert (Message.objects.count(), CodexBinding.objects.count(), len(scripted_codex.calls())) == before


def test_codex_losing_a_rollout_postgresql_holds_is_not_rotated(user, scripted_codex, run_turn_now):
    """PostgreSQL holds the thread's rollout (restored into the turn's home): codex's "no rollout found"
    is then an infrastructure failure, not proof the thread is gone — fail, keep the binding, no notice."""
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    gone = {"error": {"code": -32600, "message": "no rollout found for thread id {thread_id}"}}
    scripted_codex.script({"thread/resume": [gone]})
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert t2.status == Turn.Status.FAILED
    assert "restored from PostgreSQL" in t2.error and "not rotating" in t2.error
    assert scripted_codex.processes()[-1] == ["initialize", "thread/resume"]
    assert active_binding(session).thread_id == t1.codex_thread_id
    assert not Notice.objects.exists()


def test_resume_uses_codex_spelling_of_the_thread_id(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    CodexBinding.objects.filter(session=session).update(thread_id=t1.codex_thread_id.upper())
    # The scripted stand-in, like codex, accepts the upper-case id but answers and notifies with
    # its own canonical (lower-case) spelling.
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t2.status, t2.final_text) == (Turn.Status.SUCCEEDED, "echo: hello two"), t2.error
    assert t2.codex_thread_id == t1.codex_thread_id


def test_operator_ends_a_binding_codex_cannot_read_and_the_session_goes_on(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    damaged = {"error": {"code": -32603, "message": "failed to read session metadata"}}
    scripted_codex.script({"thread/resume": [damaged]})
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert t2.status == Turn.Status.FAILED and active_binding(session).thread_id == t1.codex_thread_id

    assert services.binding_end(session=session, reason="ended by operator admin") is True
    t3 = run_turn_now(session=session, text="hello three", user=user)
    assert (t3.status, t3.thread_action) == (Turn.Status.SUCCEEDED, "started")
    assert "[USER]\nhello one" in scripted_codex.turn_inputs()[-1]  # seeded, not amnesic
    assert active_binding(session).thread_id == t3.codex_thread_id
    assert list(Notice.objects.values_list("text", flat=True)) == [services.NOTICE_BINDING_ENDED]
