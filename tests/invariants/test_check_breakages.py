"""``check_breakages.py``'s measure of whether a breakage's edited lines ran: which lines a row edits, and
``line_probe.py`` recording them in every process of a run (a child, a thread, a fork that ends by
``os._exit``) and no line that did not run — a row no test runs is N/A, never caught."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.invariants import check_breakages
from tests.invariants.check_breakages import Breakage, edited_lines, lines_run, probe_env

SOURCE = textwrap.dedent('''\
    import os
    import threading


    def on_postgresql():
        return "postgresql"


    def on_sqlite():
        return "sqlite"


    def in_a_thread():
        return "thread"


    def in_a_fork():
        return "fork"


    def run():
        on_postgresql()
        worker = threading.Thread(target=in_a_thread)
        worker.start()
        worker.join()
        pid = os.fork()
        if pid == 0:
            in_a_fork()
            os._exit(0)
        os.waitpid(pid, 0)
''')


def _line(text: str) -> int:
    return SOURCE.splitlines().index(text) + 1


def test_edited_lines_are_the_lines_of_new_and_a_deletion_is_the_line_at_its_place():
    def lines(old: str, new: str) -> list[int]:
        return edited_lines(SOURCE, Breakage("b", "I0", "m.py", old, new, ()))

    one = '    return "sqlite"\n'
    assert lines(one, '    return "postgresql"\n') == [_line('    return "sqlite"')]
    assert lines('"sqlite"', '"other"') == [_line('    return "sqlite"')]  # part of a line
    assert lines(one, '    x = 1\n    return "x"\n') == [_line('    return "sqlite"'), _line('    return "sqlite"') + 1]
    # Taken out: the line that now follows it, or what is left of the line.
    assert lines('    on_postgresql()\n', "") == [_line("    on_postgresql()")]
    assert lines(' "fork"', "") == [_line('    return "fork"')]


def test_the_probe_records_the_lines_each_process_ran_and_none_it_did_not(tmp_path: Path):
    module = tmp_path / "probed.py"
    module.write_text(SOURCE)
    wanted = {'    return "postgresql"', '    return "sqlite"', '    return "thread"', '    return "fork"'}
    out = tmp_path / "hits"
    env = probe_env(check_breakages.REPO, {str(module.resolve()): sorted(_line(w) for w in wanted)}, out)
    subprocess.run([sys.executable, "-c", "import probed; probed.run()"], cwd=tmp_path, env=env, check=True, timeout=60)

    ran = {line for path, line in lines_run(out) if path == str(module.resolve())}
    assert ran == {_line(w) for w in wanted - {'    return "sqlite"'}}
    assert len(list(out.iterdir())) == 2  # the child and its fork, each in its own record


def test_without_the_probe_variables_the_sitecustomize_does_nothing(tmp_path: Path):
    env = probe_env(check_breakages.REPO, {}, tmp_path / "hits")
    del env["HERMES_LINE_PROBE"]
    code = "import sys, sitecustomize; assert sys.gettrace() is None, sys.gettrace(); print(sitecustomize.__file__)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "probe-site" / "sitecustomize.py")


def test_a_breakage_that_breaks_the_syntax_is_stale(tmp_path: Path):
    (tmp_path / "m.py").write_text("def f():\n    if x:\n        y = g()\n")
    reindented = Breakage("b", "I0", "m.py", "    y = g()\n", "    y = g()\n  z = 1\n", ())  # old, a level in
    assert "does not compile" in (check_breakages.apply(tmp_path, reindented) or "")
    assert (tmp_path / "m.py").read_text() == "def f():\n    if x:\n        y = g()\n"  # left as it was
    aimed = Breakage("b", "I0", "m.py", "        y = g()\n", "        y = None\n", ())
    assert check_breakages.apply(tmp_path, aimed) is None
    assert (tmp_path / "m.py").read_text() == "def f():\n    if x:\n        y = None\n"
