#!/usr/bin/env bash
# Make sure Debian's PgBouncer is installed for the tests that run the service behind it in transaction
# mode (tests/e2e/test_pgbouncer.py): installed with apt-get when missing (scripts/ensure_debian_package.sh);
# quiet when installed. Only the binary is used: the tests start private instances with their own
# configuration; the package's own service (pgbouncer.service) is left as Debian sets it up.
# Usage: scripts/ensure_pgbouncer.sh [PATH]   (default: $PGBOUNCER_PATH, else /usr/sbin/pgbouncer)
set -euo pipefail
exec "$(dirname "$0")/ensure_debian_package.sh" PgBouncer pgbouncer /usr/sbin/pgbouncer \
  "${1:-${PGBOUNCER_PATH:-/usr/sbin/pgbouncer}}" PGBOUNCER_PATH "the PgBouncer tests"
