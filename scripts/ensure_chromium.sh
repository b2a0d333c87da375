#!/usr/bin/env bash
# Make sure Debian's Chromium is installed for the browser tests (tests/browser, Playwright's
# executable_path): installed with apt-get when missing (scripts/ensure_debian_package.sh). Playwright's
# own browser download is never used.
# Usage: scripts/ensure_chromium.sh [PATH]   (default: $CHROMIUM_PATH, else /usr/bin/chromium)
set -euo pipefail
exec "$(dirname "$0")/ensure_debian_package.sh" --say-version Chromium chromium /usr/bin/chromium \
  "${1:-${CHROMIUM_PATH:-/usr/bin/chromium}}" CHROMIUM_PATH "the browser tests"
