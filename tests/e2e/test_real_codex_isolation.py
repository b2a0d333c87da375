"""One session's codex cannot read another session's files (real codex 0.171.0, permission profiles).

Real turns through the real task code (eager, in-process) on the pinned binary; the model stand-in's
``RUNCMD`` makes codex run the command. Assertions are on content, not on an errno: the other session's
words must not appear in anything the command printed (openai/codex#36852: a masked path may look empty).
"""
import uuid
from pathlib import Path

import pytest

from devtools.model_stand_in import ModelStandIn
from hermes_sessions import services
from hermes_sessions.codex import sandbox_check
from hermes_sessions.models import Message, Turn
from tests.support.real_codex import use_real_codex

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def real_codex(codex_dirs, settings, real_codex_bin, monkeypatch):
    settings.HERMES_VAR_DIR = codex_dirs  # the service's var/: the homes, the work root and secrets live here
    sandbox_check.reset_cache()
    with ModelStandIn() as stand_in:
        use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-S3CR3T-PROVIDER")
        yield stand_in


def tool_output(session) -> str:
    return "\n".join(Message.objects.filter(session=session, role="tool").values_list("content", flat=True))


def test_a_session_cannot_read_another_sessions_rollout_work_dir_or_var(user, real_codex, run_turn_now, settings):
    other_word, work_word, var_word = (f"{w}-{uuid.uuid4().hex}" for w in ("PELICAN", "WALRUS", "VARSECRET"))
    other = services.session_create(owner=user)
    first = run_turn_now(session=other, text=f"RUNCMD echo {other_word}", user=user)
    assert first.status == Turn.Status.SUCCEEDED, first.error
    # The other session's home on this host's disk (its last turn's, restored from PostgreSQL).
    rollouts = list(Path(settings.CODEX_HOMES_ROOT).rglob("rollout-*.jsonl"))
    assert rollouts and other_word in rollouts[0].read_text()  # the other session's words are on disk
    (Path(settings.CODEX_WORK_ROOT) / other.id / "notes.txt").write_text(work_word)
    (Path(settings.HERMES_VAR_DIR) / "secret.env").write_text(var_word)

    me = services.session_create(owner=user)
    own = f"OWN-{uuid.uuid4().hex}"
    (Path(settings.CODEX_WORK_ROOT) / me.id).mkdir(parents=True, exist_ok=True)
    (Path(settings.CODEX_WORK_ROOT) / me.id / "mine.txt").write_text(own)
    cmd = (
        f"cat {rollouts[0]}; grep -r {other_word[:7]} {settings.CODEX_HOMES_ROOT} {settings.CODEX_HOME} {settings.CODEX_WORK_ROOT}; "
        f"cat {settings.CODEX_WORK_ROOT}/{other.id}/notes.txt; cat {settings.HERMES_VAR_DIR}/secret.env; "
        f"cat {settings.BASE_DIR}/project/settings.py | head -3; ls {settings.CODEX_WORK_ROOT}; "
        f"cat mine.txt; ls /usr/bin | head -1; cat /etc/hostname; echo DONE"
    )
    turn = run_turn_now(session=me, text=f"RUNCMD {cmd}", user=user)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    seen = tool_output(me)
    assert "DONE" in seen and own in seen  # the command ran, and its own work dir is readable
    assert Path("/etc/hostname").read_text().strip() in seen  # ordinary reads work
    for word in (other_word, work_word, var_word, "DJANGO_SETTINGS_MODULE", "env_path("):
        assert word not in seen, f"{word!r} leaked into the other session's command output"
    # `ls` of the work root shows no other session (the paths the command itself named aside).
    named = seen.replace(f"{settings.CODEX_WORK_ROOT}/{other.id}/", "").replace(f"{settings.CODEX_HOMES_ROOT}/{other.id}/", "")
    assert other.id not in named


def test_workspace_write_writes_its_own_dir_and_reads_no_one_elses(user, real_codex, run_turn_now, settings):
    other = services.session_create(owner=user)
    secret = f"OTTER-{uuid.uuid4().hex}"
    (Path(settings.CODEX_WORK_ROOT) / other.id).mkdir(parents=True)
    (Path(settings.CODEX_WORK_ROOT) / other.id / "notes.txt").write_text(secret)
    me = services.session_create(owner=user, model_config={"sandbox": "workspace-write"})
    name = f"made-{uuid.uuid4().hex}"
    turn = run_turn_now(
        session=me, user=user,
        text=f"RUNCMD echo hi > {name}; cat {name}; cat {settings.CODEX_WORK_ROOT}/{other.id}/notes.txt; "
             f"echo x > {settings.CODEX_WORK_ROOT}/{other.id}/planted; echo DONE",
    )
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert (Path(settings.CODEX_WORK_ROOT) / me.id / name).read_text() == "hi\n"
    assert "DONE" in tool_output(me) and secret not in tool_output(me)
    assert not (Path(settings.CODEX_WORK_ROOT) / other.id / "planted").exists()


def test_no_environment_a_command_can_see_holds_the_provider_key(user, real_codex, run_turn_now):
    session = services.session_create(owner=user)
    turn = run_turn_now(
        session=session, user=user,
        text="RUNCMD env; for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f 2>/dev/null; done; echo DONE",
    )
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    seen = tool_output(session)
    assert "PATH=" in seen and "DONE" in seen
    for secret in ("S3CR3T", "HERMES_STAND_IN_API_KEY", "OPENAI_API_KEY", "stand-in\n"):
        assert secret not in seen


def test_the_turn_runs_under_the_sessions_profile_after_a_restart(user, real_codex, run_turn_now):
    """Each turn is a fresh app-server: the resume reports the session's profile (else the turn fails)."""
    session = services.session_create(owner=user)
    for text in ("hello", "RUNCMD echo again"):
        turn = run_turn_now(session=session, text=text, user=user)
        assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert turn.thread_action == "resumed"


def test_danger_full_access_is_staff_only_and_still_fenced_from_other_sessions(django_user_model, real_codex,
                                                                                run_turn_now, settings):
    staff = django_user_model.objects.create_user(username="root-ish", password="pw", is_staff=True)
    other = services.session_create(owner=staff)
    secret = f"HERON-{uuid.uuid4().hex}"
    (Path(settings.CODEX_WORK_ROOT) / other.id).mkdir(parents=True)
    (Path(settings.CODEX_WORK_ROOT) / other.id / "notes.txt").write_text(secret)
    me = services.session_create(owner=staff, model_config={"sandbox": "danger-full-access"})
    outside = Path(settings.HERMES_VAR_DIR).parent / f"full-{uuid.uuid4().hex}"
    turn = run_turn_now(
        session=me, user=staff,
        text=f"RUNCMD touch {outside}; cat {settings.CODEX_WORK_ROOT}/{other.id}/notes.txt; echo ok > own.txt; echo DONE",
    )
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert outside.exists()  # full access: writes outside its own dir
    assert (Path(settings.CODEX_WORK_ROOT) / me.id / "own.txt").exists()
    assert "DONE" in tool_output(me) and secret not in tool_output(me)
