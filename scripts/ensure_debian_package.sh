#!/usr/bin/env bash
# Make sure a program from one of Debian's packages runs at PATH: install the package with apt-get when it
# is missing at its Debian path (sudo when not root); otherwise stop with a message saying what to provide.
# Quiet when it works, unless --say-version. Used by ensure_chromium.sh and ensure_pgbouncer.sh.
# Usage: scripts/ensure_debian_package.sh [--say-version] NAME PACKAGE DEBIAN_PATH PATH VARIABLE PURPOSE
#   NAME: the program's name in messages; PACKAGE: the Debian package; DEBIAN_PATH: where it installs the
#   program; PATH: where to look (another path is never installed into); VARIABLE: the setting that
#   chose PATH; PURPOSE: what it is for, in the progress line.
set -euo pipefail
say_version=""
if [ "${1:-}" = --say-version ]; then say_version=1; shift; fi
name=$1 package=$2 debian_path=$3 program=$4 variable=$5 purpose=$6

works() { [ -x "$program" ] && "$program" --version >/dev/null 2>&1; }
version() { [ -z "$say_version" ] || echo "$("$program" --version 2>/dev/null | head -1) at $program"; }

if works; then
  version
  exit 0
fi
if [ "$program" != "$debian_path" ]; then
  echo "$name is not runnable at $program ($variable); point it at a working $name or unset it." >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "$name is missing at $program and apt-get is not available: install $name (Debian package '$package')." >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    echo "$name is missing at $program; installing it needs root: run 'sudo apt-get install -y $package'." >&2
    exit 1
  fi
fi
echo "installing Debian's $package for $purpose…"
export DEBIAN_FRONTEND=noninteractive
log=/tmp/hermes-$package-install.log
# The package lists may be absent or stale on a fresh machine: update once if the first try fails.
$sudo apt-get install -y --no-install-recommends "$package" >"$log" 2>&1 || {
  $sudo apt-get update >>"$log" 2>&1 &&
    $sudo apt-get install -y --no-install-recommends "$package" >>"$log" 2>&1
} || {
  tail -20 "$log" >&2
  echo "Could not install $name with apt-get (log: $log); install the '$package' package by hand." >&2
  exit 1
}
works || { echo "$name was installed but $program --version fails." >&2; exit 1; }
say_version=1 version
