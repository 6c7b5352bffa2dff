#!/usr/bin/env bash
# Debian's Chromium for the dashboard's browser tests (tests/test_dashboard_browser.py drives it with
# Playwright; Playwright's own browser downloads are never used).
#
# usage: scripts/chromium.sh    install the `chromium` package when /usr/bin/chromium is missing (as root,
#                               with apt-get; non-interactive). Where it cannot (not root, no apt-get, no
#                               network, ...) it says why on stderr and exits 3; the browser tests then skip,
#                               naming what is missing.
set -euo pipefail

log() { echo "chromium.sh: $*" >&2; }
skip() { log "no Chromium for the browser tests: $*"; exit 3; }

[ -x /usr/bin/chromium ] && exit 0
[ "$(id -u)" = 0 ] || skip "Chromium is not installed and installing it needs root"
command -v apt-get >/dev/null || skip "Chromium is not installed and there is no apt-get to install it"
log "installing Debian's chromium package"
export DEBIAN_FRONTEND=noninteractive
# Wait for another apt or dpkg run (up to 5 minutes) instead of failing on its lock.
apt=(apt-get -q -y -o Dpkg::Use-Pty=0 -o Dpkg::Options::=--force-confold -o DPkg::Lock::Timeout=300)
# A fresh machine may have no package lists yet: update them when the package is unknown.
if ! apt-cache show chromium >/dev/null 2>&1; then
  "${apt[@]}" update >/dev/null 2>&1 || skip "apt-get update failed (no network?)"
fi
"${apt[@]}" install --no-install-recommends chromium >/dev/null 2>&1 || skip "apt-get install chromium failed (no network?)"
[ -x /usr/bin/chromium ] || skip "the chromium package installed no /usr/bin/chromium"
log "installed $(/usr/bin/chromium --version 2>/dev/null || echo chromium)"
