"""``hermes_sessions.latency_marks``: off unless ``HERMES_LATENCY_MARKS`` names a file; then one line per mark."""
from __future__ import annotations

import os
import threading

import pytest

from hermes_sessions import latency_marks


def test_nothing_is_written_when_off(tmp_path, monkeypatch):
    monkeypatch.setattr(latency_marks, "_enabled", False)
    monkeypatch.setenv(latency_marks.ENV, str(tmp_path / "marks"))
    latency_marks.mark("claim.start", "t1")
    assert not (tmp_path / "marks").exists()
    assert latency_marks.enabled() is False


@pytest.fixture
def marks_file(tmp_path, monkeypatch):
    path = tmp_path / "marks"
    monkeypatch.setenv(latency_marks.ENV, str(path))
    monkeypatch.setattr(latency_marks, "_enabled", True)
    monkeypatch.setattr(latency_marks, "_pid", 0)  # as in a process that has not opened the file yet
    monkeypatch.setattr(latency_marks, "_fd", None)
    yield path
    if latency_marks._fd is not None:
        os.close(latency_marks._fd)


def test_each_mark_is_one_line_with_key_name_time_cpu_pid_and_thread(marks_file):
    latency_marks.mark("claim.start", "7d0c")
    done = threading.Thread(target=latency_marks.mark, args=("hub.notified",), name="hub thread")
    done.start()
    done.join()
    lines = marks_file.read_text().splitlines()
    assert len(lines) == 2
    key, name, at, cpu, pid, thread = lines[0].split(" ", 5)
    assert (key, name, int(pid), thread) == ("7d0c", "claim.start", os.getpid(), threading.current_thread().name)
    assert float(at) > 1.7e9 and float(cpu) >= 0
    key, name, *_, thread = lines[1].split(" ", 5)
    assert (key, name, thread) == ("-", "hub.notified", "hub thread")  # no key: "-"; a thread name with a space


def test_a_forked_process_opens_the_file_again(marks_file, monkeypatch):
    latency_marks.mark("a", "k")
    first = latency_marks._fd
    monkeypatch.setattr(latency_marks, "_pid", -1)  # what a child sees: another pid than the one that opened it
    latency_marks.mark("b", "k")
    assert latency_marks._fd != first
    os.close(first)  # type: ignore[arg-type]
    assert [line.split(" ")[1] for line in marks_file.read_text().splitlines()] == ["a", "b"]
