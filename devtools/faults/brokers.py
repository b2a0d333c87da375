"""The private broker of a ``make faults`` run (``--broker redis|rabbitmq``): started on free ports in a
process group of its own, ``kill -9``-ed and restarted on the same ports by ``broker-restart``. The
shared brokers (``TEST_BROKER_URL``, the machine's RabbitMQ on 5672) are never touched."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from devtools.faults.supervisor import Proc
from devtools.processes import free_port

# Debian's /usr/sbin/rabbitmq-server re-runs itself as the rabbitmq user with that user's node name and
# data; the script it wraps runs as whoever calls it, on the RABBITMQ_* environment given below.
RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
RABBITMQCTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"


class Broker:
    """A private broker: ``url`` for Celery, ``start()`` (returns once it accepts clients), ``kill9()``,
    ``stop()``, and what it holds for a queue (``backlog``)."""

    kind = ""
    starts = 0
    #: Whether a (re)start takes longer than ``--broker-down``: broker-restart then starts it right after
    #: the kill, so the outage is its boot rather than the down time plus its boot.
    boots_slowly = False
    proc: Proc | None = None

    def __init__(self, scratch: Path, logdir: Path):
        self.scratch, self.logdir = scratch, logdir
        self.port = free_port()

    @property
    def url(self) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        """``private redis-server on :PORT`` or the like, for the run's first log line."""
        raise NotImplementedError

    def start(self, env: dict[str, str]) -> None:
        """Start the broker (the same ports and data as before, when restarted) and wait until it
        accepts clients. Raises ``RuntimeError`` with its log's tail."""
        raise NotImplementedError

    def answers(self) -> bool:
        raise NotImplementedError

    def _wait_answering(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self.answers():
            if time.monotonic() > deadline or not self.proc.alive():
                raise RuntimeError(f"{self.proc.name} did not start:\n{self.proc.log_tail()}")
            time.sleep(0.1)

    def kill9(self) -> None:
        """``kill -9`` the broker's whole process group (as a crash would)."""
        if self.proc is not None:
            self.proc.kill9()
            self.proc.stop()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def backlog(self, queue: str) -> tuple[int, int]:
        """(messages waiting in ``queue``, messages delivered but unacknowledged); (-1, -1) if the
        broker could not say."""
        raise NotImplementedError

    def queue_length(self, queue: str) -> int:
        """Messages waiting in ``queue`` (0 for a queue that does not exist)."""
        raise NotImplementedError

    def queue_exists(self, queue: str) -> bool:
        """Whether the broker knows ``queue`` (none is named after a worker: the check that none is left)."""
        raise NotImplementedError

    def loses_messages(self) -> str:
        """What a ``kill -9`` does to the messages it holds, for the scenario's log line."""
        raise NotImplementedError


class RedisBroker(Broker):
    """``redis-server`` with nothing kept on disk: a restart loses every queued and unacknowledged
    message (the sweep re-sends their turns)."""

    kind = "redis"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def describe(self) -> str:
        return f"private redis-server on :{self.port}"

    def start(self, env: dict[str, str]) -> None:
        self.starts += 1
        self.proc = Proc(f"redis{self.starts}", ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                                "--save", "", "--appendonly", "no", "--daemonize", "no"],
                         env, self.logdir)
        self._wait_answering(20)

    def answers(self) -> bool:
        """Whether it answers ``PING``."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def _client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, db=0, socket_timeout=5)

    def backlog(self, queue: str) -> tuple[int, int]:
        client = self._client()
        try:
            return int(client.llen(queue)), int(client.hlen("unacked"))
        finally:
            client.close()

    def queue_length(self, queue: str) -> int:
        client = self._client()
        try:
            return int(client.llen(queue))
        finally:
            client.close()

    def queue_exists(self, queue: str) -> bool:
        """Its list or a binding of it (a member ``<routing key>\\x06\\x16<pattern>\\x06\\x16<queue>`` of a kombu
        binding table ``_kombu.binding.<exchange>``: its worker's, in the default exchange's, or a
        publisher's, in an exchange of its own name) is still there."""
        client = self._client()
        try:
            if client.exists(queue):
                return True
            suffix = b"\x06\x16" + queue.encode()
            return any(m.endswith(suffix) for key in client.keys("_kombu.binding.*") for m in client.smembers(key))
        finally:
            client.close()

    def loses_messages(self) -> str:
        return "are lost"


class RabbitBroker(Broker):
    """A RabbitMQ node of its own (``rabbitmq-server``: node ``hermes-faults-<pid>@localhost`` on a free
    AMQP port and a free distribution port, its data, logs and Erlang cookie under the scratch directory,
    no plugins, user guest/guest). A restart keeps its data: Celery's queues are durable and its task
    messages persistent, so what the node had written survives a ``kill -9``; it registers with the
    machine's ``epmd`` (port 4369) beside any other node, under its own name."""

    kind = "rabbitmq"
    boots_slowly = True  # 9–17 s on a loaded 2-core machine

    def __init__(self, scratch: Path, logdir: Path):
        super().__init__(scratch, logdir)
        self.dist_port = free_port()
        self.node = f"hermes-faults-{os.getpid()}@localhost"
        self.base = scratch / "rabbitmq"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def describe(self) -> str:
        return f"private RabbitMQ node {self.node} on :{self.port}"

    def _environment(self, env: dict[str, str]) -> dict[str, str]:
        home = self.base / "home"  # its Erlang cookie, apart from the user's and the shared node's
        home.mkdir(parents=True, exist_ok=True)
        plugins = self.base / "enabled_plugins"
        plugins.write_text("[].\n")  # no management listener on 15672 (the shared node has it)
        (self.base / "rabbitmq.conf").write_text(f"listeners.tcp.default = 127.0.0.1:{self.port}\n")
        return {
            **env,
            "HOME": str(home),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_LOGS": "-",
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(plugins),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq"),
            "RABBITMQ_PID_FILE": str(self.base / "pid"),
        }

    def start(self, env: dict[str, str]) -> None:
        server = RABBITMQ_SERVER if os.path.exists(RABBITMQ_SERVER) else shutil.which("rabbitmq-server")
        if not server:
            raise RuntimeError("--broker rabbitmq needs rabbitmq-server (Debian: apt-get install rabbitmq-server)")
        self.env = self._environment(env)
        self.starts += 1
        self.proc = Proc(f"rabbitmq{self.starts}", [server], self.env, self.logdir)
        self._wait_answering(120)  # a node boots in 5–10 s on a loaded 2-core machine

    def answers(self) -> bool:
        """Whether guest/guest can open an AMQP connection."""
        import amqp

        conn = amqp.Connection(host=f"127.0.0.1:{self.port}", userid="guest", password="guest", connect_timeout=2)
        try:
            conn.connect()
            return True
        except Exception:  # noqa: BLE001 — any failure means "not yet"
            return False
        finally:
            try:
                conn.collect()
            except Exception:  # noqa: BLE001
                pass

    def backlog(self, queue: str) -> tuple[int, int]:
        ctl = RABBITMQCTL if os.path.exists(RABBITMQCTL) else shutil.which("rabbitmqctl") or "rabbitmqctl"
        try:
            out = subprocess.run([ctl, "-n", self.node, "-q", "list_queues", "name", "messages_ready",
                                  "messages_unacknowledged"], env=self.env, capture_output=True, text=True,
                                 timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return -1, -1
        for line in out.splitlines():
            fields = line.split()
            if len(fields) == 3 and fields[0] == queue:
                return int(fields[1]), int(fields[2])
        return 0, 0

    def queue_length(self, queue: str) -> int:
        from kombu import Connection

        with Connection(self.url, connect_timeout=5) as conn:
            try:
                _, count, _ = conn.default_channel.queue_declare(queue, passive=True)
            except conn.channel_errors:  # 404: nobody declared it yet
                return 0
            return int(count)

    def queue_exists(self, queue: str) -> bool:
        from kombu import Connection

        with Connection(self.url, connect_timeout=5) as conn:
            try:
                conn.default_channel.queue_declare(queue, passive=True)
            except conn.channel_errors:  # 404
                return False
            return True

    def loses_messages(self) -> str:
        return "are in it (RabbitMQ keeps the persistent ones it had written)"


def make_broker(kind: str, scratch: Path, logdir: Path) -> Broker:
    """The private broker for ``--broker kind``."""
    return {"redis": RedisBroker, "rabbitmq": RabbitBroker}[kind](scratch, logdir)
