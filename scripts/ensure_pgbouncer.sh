#!/usr/bin/env bash
# Make sure Debian's PgBouncer is installed for the tests that run the service behind it in transaction
# mode (tests/e2e/test_pgbouncer.py): install it with apt-get when missing (sudo when not root); otherwise
# stop with a message saying what to provide. Only the binary is used: the tests start private instances
# with their own configuration; the package's own service (pgbouncer.service) is left as Debian sets it up.
# Usage: scripts/ensure_pgbouncer.sh [PATH]   (default: $PGBOUNCER_PATH, else /usr/sbin/pgbouncer)
set -euo pipefail
pgbouncer=${1:-${PGBOUNCER_PATH:-/usr/sbin/pgbouncer}}

works() { [ -x "$pgbouncer" ] && "$pgbouncer" --version >/dev/null 2>&1; }

if works; then
  exit 0  # quiet when installed
fi
if [ "$pgbouncer" != /usr/sbin/pgbouncer ]; then
  echo "PgBouncer is not runnable at $pgbouncer (PGBOUNCER_PATH); point it at a working pgbouncer or unset it." >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "PgBouncer is missing at $pgbouncer and apt-get is not available: install PgBouncer (Debian package 'pgbouncer')." >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    echo "PgBouncer is missing at $pgbouncer; installing it needs root: run 'sudo apt-get install -y pgbouncer'." >&2
    exit 1
  fi
fi
echo "installing Debian's pgbouncer for the PgBouncer tests…"
export DEBIAN_FRONTEND=noninteractive
# The package lists may be absent or stale on a fresh machine: update once if the first try fails.
$sudo apt-get install -y --no-install-recommends pgbouncer >/tmp/hermes-pgbouncer-install.log 2>&1 || {
  $sudo apt-get update >>/tmp/hermes-pgbouncer-install.log 2>&1 &&
    $sudo apt-get install -y --no-install-recommends pgbouncer >>/tmp/hermes-pgbouncer-install.log 2>&1
} || {
  tail -20 /tmp/hermes-pgbouncer-install.log >&2
  echo "Could not install PgBouncer with apt-get (log: /tmp/hermes-pgbouncer-install.log); install the 'pgbouncer' package by hand." >&2
  exit 1
}
works || { echo "PgBouncer was installed but $pgbouncer --version fails." >&2; exit 1; }
echo "$("$pgbouncer" --version 2>/dev/null | head -1) at $pgbouncer"
