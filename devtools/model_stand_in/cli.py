"""Command line of the model stand-in: ``python -m devtools.model_stand_in [--host H] [--port 8765]
[--port-file F] [--log F] [--slow-seconds S]`` (``make stand-in`` runs it on port 8765)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from devtools.model_stand_in.server import ModelStandIn

DEFAULT_CLI_PORT = 8765


def _write_port_file(path: str, port: int) -> None:
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write("%d\n" % port)
    os.replace(tmp, path)


def run_foreground(*, host: str = "127.0.0.1", port: int = DEFAULT_CLI_PORT, port_file: str | None = None,
                   log_path: str | None = None, slow_seconds: float = 20.0, out: Any = None) -> int:
    """Serve until SIGINT/SIGTERM; prints ``model stand-in listening on <base_url>`` to ``out``
    (default stdout) and writes the port to ``port_file`` if given. Returns the exit code 0.
    Raises ``ValueError`` for a non-loopback host and ``OSError`` if the port cannot be bound.
    Used by :func:`main`."""
    out = out or sys.stdout
    stand_in = ModelStandIn(host=host, port=port, log_path=log_path, slow_seconds=slow_seconds)
    done = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: done.set())
    try:
        stand_in.start()
        if port_file:
            _write_port_file(port_file, stand_in.port)
        out.write("model stand-in listening on %s\n" % stand_in.base_url)
        out.flush()
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        stand_in.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the CLI options (``--host --port --port-file --log --slow-seconds``) to ``parser``."""
    parser = parser or argparse.ArgumentParser(
        prog="model_stand_in",
        description="Offline stand-in for the OpenAI Responses API used by the demo and tests.")
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_CLI_PORT,
                        help="TCP port, 0 for any free port (default %d)" % DEFAULT_CLI_PORT)
    parser.add_argument("--port-file", default=None, help="write the bound port to this file")
    parser.add_argument("--log", default=None, help="append every recorded request to this JSONL file")
    parser.add_argument("--slow-seconds", type=float, default=20.0,
                        help="duration of a SLOW reply in seconds (default 20)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: ``python -m devtools.model_stand_in [--host H] [--port 8765]
    [--port-file F] [--log F] [--slow-seconds S]``. Runs until SIGINT/SIGTERM; returns 0
    (2 for a non-loopback host)."""
    args = build_arg_parser().parse_args(argv)
    try:
        return run_foreground(host=args.host, port=args.port, port_file=args.port_file,
                              log_path=args.log, slow_seconds=args.slow_seconds)
    except ValueError as exc:
        print("model stand-in: %s" % exc, file=sys.stderr)
        return 2

