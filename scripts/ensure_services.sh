#!/usr/bin/env bash
# Make sure the PostgreSQL and Redis that the tests need are up: start them when they are installed
# but not running; otherwise stop with a message saying what to provide.
# Usage: scripts/ensure_services.sh DATABASE_URL BROKER_URL
set -euo pipefail
db_url=${1:?DATABASE_URL}
broker_url=${2:?BROKER_URL}

hostport() { # scheme://[user@]host:port/... -> "host port"
  local rest=${1#*://}; rest=${rest#*@}; rest=${rest%%/*}
  echo "${rest%%:*} ${rest##*:}"
}
up() { timeout 1 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }
wait_up() { for _ in $(seq 1 60); do up "$1" "$2" && return 0; sleep 0.5; done; return 1; }

read -r pg_host pg_port < <(hostport "$db_url")
if ! up "$pg_host" "$pg_port"; then
  if command -v pg_ctlcluster >/dev/null && ls /etc/postgresql >/dev/null 2>&1; then
    echo "starting PostgreSQL…"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
  fi
  wait_up "$pg_host" "$pg_port" || {
    echo "PostgreSQL is not reachable at $pg_host:$pg_port and could not be started."
    echo "Install and start PostgreSQL (trust auth for user postgres) or set TEST_DATABASE_URL=postgres://user:pass@host:port/db." >&2
    exit 1
  }
fi

read -r r_host r_port < <(hostport "$broker_url")
if ! up "$r_host" "$r_port"; then
  if command -v redis-server >/dev/null; then
    echo "starting Redis…"
    mkdir -p /tmp/hermes-redis
    redis-server --daemonize yes --bind 127.0.0.1 --port "$r_port" --save "" --appendonly no --dir /tmp/hermes-redis \
      --logfile /tmp/hermes-redis/redis.log || true
  fi
  wait_up "$r_host" "$r_port" || {
    echo "Redis is not reachable at $r_host:$r_port and could not be started."
    echo "Install and start Redis, or set TEST_BROKER_URL=redis://host:port/db." >&2
    exit 1
  }
fi
echo "PostgreSQL $pg_host:$pg_port and Redis $r_host:$r_port are up."
