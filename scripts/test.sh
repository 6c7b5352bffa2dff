#!/usr/bin/env bash
# Quickstart 2: set up with test extras, then run the test suite (extra pytest arguments pass through).
# The ledger tests also run against PostgreSQL: a throwaway server (scripts/postgres.sh, which installs
# Debian's package when missing and it can) unless $MESHNET_TEST_POSTGRES_URL names a database already;
# MESHNET_TEST_POSTGRES=0 runs them on SQLite only. The dashboard's browser tests use Debian's chromium
# (scripts/chromium.sh installs it when missing and it can; MESHNET_TEST_CHROMIUM=0 skips that).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
if [ "${MESHNET_TEST_CHROMIUM:-1}" != 0 ]; then
  bash scripts/chromium.sh || true  # exit 3: no Chromium here; the browser tests skip saying why
fi
pg_dir=""
cleanup() { if [ -n "$pg_dir" ]; then bash scripts/postgres.sh stop "$pg_dir"; fi; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
if [ -z "${MESHNET_TEST_POSTGRES_URL:-}" ] && [ "${MESHNET_TEST_POSTGRES:-1}" != 0 ]; then
  pg_dir=$(mktemp -d "${TMPDIR:-/tmp}/meshnet-postgres.XXXXXX")
  started=$SECONDS
  if url=$(bash scripts/postgres.sh start "$pg_dir"); then
    export MESHNET_TEST_POSTGRES_URL="$url"
    echo "test.sh: PostgreSQL for the ledger tests at $url (ready in $((SECONDS - started)) s)"
  else
    bash scripts/postgres.sh stop "$pg_dir"
    pg_dir=""
  fi
fi
# The default run must stay within about 15 minutes on 2 cores: the slowest tests are listed at the end.
# Two pytest processes share the test files ($MESHNET_TEST_WORKERS, 0 = one process): alone, the suite
# kept the machine about half idle (mesh tests wait on timeouts, restarts and heartbeats), 17-19.5 min.
# A file's tests stay in one process, in order, with its module fixtures.
.venv/bin/python -m pytest -q --durations=15 -n "${MESHNET_TEST_WORKERS:-2}" --dist loadfile "$@"
