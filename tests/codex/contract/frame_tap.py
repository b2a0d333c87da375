#!/usr/bin/env python3
"""Record every stdio frame between a client and an app-server: ``frame_tap.py LOG -- ARGV...``.

Runs ``ARGV`` (the real ``codex app-server`` or the scripted stand-in) as a child, copies our stdin to
its stdin and its stdout to our stdout line by line, unchanged, and appends each line to ``LOG`` as
``{"pid": <child pid>, "from": "client"|"server", "line": <text>}``. The child's stderr is inherited,
so the client still drains it. Closing our stdin closes the child's; we exit with the child's code.

The contract test (tests/codex/contract/) puts this in front of the app-server so it sees the
exact bytes the client wrote, whatever the client does internally. Stdlib only.
"""
import json
import subprocess
import sys
import threading


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: frame_tap.py LOG -- ARGV...", file=sys.stderr)
        return 2
    log_path, child_argv = argv[0], argv[2:]
    child = subprocess.Popen(child_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    lock = threading.Lock()
    log = open(log_path, "a", encoding="utf-8")  # closed at exit below

    def record(source: str, raw: bytes) -> None:
        entry = {"pid": child.pid, "from": source, "line": raw.decode("utf-8", "replace").rstrip("\r\n")}
        with lock:
            log.write(json.dumps(entry) + "\n")
            log.flush()

    def pump_stdin() -> None:
        try:
            for raw in iter(sys.stdin.buffer.readline, b""):
                record("client", raw)
                child.stdin.write(raw)
                child.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        finally:
            try:
                child.stdin.close()
            except OSError:
                pass

    threading.Thread(target=pump_stdin, name="tap-stdin", daemon=True).start()
    try:
        for raw in iter(child.stdout.readline, b""):
            record("server", raw)
            sys.stdout.buffer.write(raw)
            sys.stdout.buffer.flush()
    except (BrokenPipeError, OSError):
        child.kill()
    code = child.wait()
    with lock:
        log.close()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
