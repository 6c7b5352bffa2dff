#!/usr/bin/env bash
# A throwaway PostgreSQL server for the tests (scripts/test.sh runs it around pytest).
#
# usage: scripts/postgres.sh start DIR   initdb into DIR (created; must be empty), start the server on a free
#                                        loopback port, create database `meshnet`, print its URL on stdout
#        scripts/postgres.sh stop DIR    stop that server and remove DIR
#
# `start` installs Debian's `postgresql` package when no server binaries are found (as root, with apt-get;
# non-interactive). Where it cannot (not root, no apt-get, no network, ...) it prints why on stderr and
# exits 3, so the caller runs without PostgreSQL. The server runs as the `postgres` system user that the
# package creates when this script runs as root (PostgreSQL refuses to run as root), else as the caller;
# it trusts loopback connections, keeps no data safe (fsync off) and listens on no public address.
set -euo pipefail

# Durability off: the data lives as long as the test run.
FAST="-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"

log() { echo "postgres.sh: $*" >&2; }
skip() { log "no PostgreSQL for the tests: $*"; exit 3; }

# The newest installed server's bin directory (Debian keeps it off PATH), or the one on PATH.
find_bindir() {
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$d" ] && [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then echo "$d"; return 0; fi
  if command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then dirname "$(command -v pg_ctl)"; return 0; fi
  return 1
}

install_postgres() {
  [ "$(id -u)" = 0 ] || skip "PostgreSQL is not installed and installing it needs root"
  command -v apt-get >/dev/null || skip "PostgreSQL is not installed and there is no apt-get to install it"
  log "installing Debian's postgresql package"
  export DEBIAN_FRONTEND=noninteractive
  # Wait for another apt or dpkg run (up to 5 minutes) instead of failing on its lock.
  local apt=(apt-get -q -y -o Dpkg::Use-Pty=0 -o Dpkg::Options::=--force-confold -o DPkg::Lock::Timeout=300)
  # A fresh machine may have no package lists yet: update them when the package is unknown.
  if ! apt-cache show postgresql >/dev/null 2>&1; then
    "${apt[@]}" update >/dev/null 2>&1 || skip "apt-get update failed (no network?)"
  fi
  "${apt[@]}" install --no-install-recommends postgresql >/dev/null 2>&1 \
    || skip "apt-get install postgresql failed (no network?)"
}

run_as() {  # run a server program as the user that owns DIR
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

start() {
  local dir="$1" bindir port
  bindir=$(find_bindir) || { install_postgres; bindir=$(find_bindir) || skip "no initdb/pg_ctl after installing"; }
  if [ "$(id -u)" = 0 ]; then
    id -u postgres >/dev/null 2>&1 || skip "no 'postgres' user to run the server as (the server refuses root)"
    command -v runuser >/dev/null || skip "no runuser to start the server as 'postgres'"
  fi
  mkdir -p "$dir"
  [ -z "$(ls -A "$dir")" ] || { log "$dir is not empty"; exit 2; }
  [ "$(id -u)" = 0 ] && chown postgres: "$dir"
  chmod 700 "$dir"
  run_as "$bindir/initdb" -D "$dir/data" -U meshnet -A trust -E UTF8 --locale=C --no-sync >"$dir/initdb.log" 2>&1 \
    || { cat "$dir/initdb.log" >&2; skip "initdb failed"; }
  local tries
  for tries in 1 2 3; do
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # Sockets in DIR (the default directory may not exist or be writable); a server for tests only.
    if run_as "$bindir/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 -s start \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $dir $FAST" >/dev/null 2>&1; then
      run_as "$bindir/createdb" -h 127.0.0.1 -p "$port" -U meshnet meshnet \
        || { stop "$dir"; skip "createdb failed"; }
      echo "postgresql://meshnet@127.0.0.1:$port/meshnet"
      return 0
    fi
    log "server did not start on port $port (try $tries)"
  done
  tail -n 20 "$dir/server.log" >&2 || true
  skip "the server did not start"
}

stop() {
  local dir="$1" bindir
  if [ -f "$dir/data/postmaster.pid" ] && bindir=$(find_bindir); then
    run_as "$bindir/pg_ctl" -D "$dir/data" -m immediate -s stop >/dev/null 2>&1 || true
  fi
  rm -rf "$dir"
}

case "${1:-}" in
  start) [ -n "${2:-}" ] || { log "usage: $0 start DIR"; exit 2; }; start "$2" ;;
  stop) [ -n "${2:-}" ] || { log "usage: $0 stop DIR"; exit 2; }; stop "$2" ;;
  *) log "usage: $0 start DIR | stop DIR"; exit 2 ;;
esac
