#!/usr/bin/env bash
# Make sure Debian's Chromium is installed for the browser tests (tests/browser, Playwright's
# executable_path): install it with apt-get when missing (sudo when not root); otherwise stop with a
# message saying what to provide. Playwright's own browser download is never used.
# Usage: scripts/ensure_chromium.sh [PATH]   (default: $CHROMIUM_PATH, else /usr/bin/chromium)
set -euo pipefail
chromium=${1:-${CHROMIUM_PATH:-/usr/bin/chromium}}

works() { [ -x "$chromium" ] && "$chromium" --version >/dev/null 2>&1; }

if works; then
  echo "$("$chromium" --version 2>/dev/null) at $chromium"
  exit 0
fi
if [ "$chromium" != /usr/bin/chromium ]; then
  echo "Chromium is not runnable at $chromium (CHROMIUM_PATH); point it at a working Chromium or unset it." >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "Chromium is missing at $chromium and apt-get is not available: install Chromium (Debian package 'chromium')." >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    echo "Chromium is missing at $chromium; installing it needs root: run 'sudo apt-get install -y chromium'." >&2
    exit 1
  fi
fi
echo "installing Debian's chromium for the browser tests…"
export DEBIAN_FRONTEND=noninteractive
# The package lists may be absent or stale on a fresh machine: update once if the first try fails.
$sudo apt-get install -y --no-install-recommends chromium >/tmp/hermes-chromium-install.log 2>&1 || {
  $sudo apt-get update >>/tmp/hermes-chromium-install.log 2>&1 &&
    $sudo apt-get install -y --no-install-recommends chromium >>/tmp/hermes-chromium-install.log 2>&1
} || {
  tail -20 /tmp/hermes-chromium-install.log >&2
  echo "Could not install Chromium with apt-get (log: /tmp/hermes-chromium-install.log); install the 'chromium' package by hand." >&2
  exit 1
}
works || { echo "Chromium was installed but $chromium --version fails." >&2; exit 1; }
echo "$("$chromium" --version 2>/dev/null) at $chromium"
