#!/usr/bin/env bash
# Quickstart 1: set up, start a local mesh (a tracker and 3 node processes serving SmolLM2's 30 layers
# as three ranges of about equal decode cost), complete a prompt through it, then stop the mesh.
set -euo pipefail
cd "$(dirname "$0")/.."
# Its arguments are the prompt; the tracker's port comes from $MESHNET_PORT (a flag would be prompt text).
case "${1:-}" in
  -*) echo "usage: [MESHNET_PORT=7700] bash scripts/demo.sh [PROMPT...]: no flags (got $1); set MESHNET_PORT" \
           "to move the tracker's port" >&2; exit 2 ;;
esac
PORT="${MESHNET_PORT:-7700}"
# checked here: meshnet up's own message would name its --port, and 0 ("any free port") leaves the demo
# without the port to give meshnet generate
if ! [[ "$PORT" =~ ^[0-9]+$ ]] || (( 10#$PORT < 1 || 10#$PORT > 65535 )); then
  echo "demo: MESHNET_PORT must be the tracker's port, 1 to 65535 (got '$PORT')" >&2
  exit 2
fi
echo "demo: setting up .venv and the bundled model (1-3 minutes the first time)..." >&2
scripts/setup.sh
echo "demo: starting a tracker and 3 nodes..." >&2
PROMPT="${*:-The capital of France is}"
log="$(mktemp)"
# The demo needs neither the API nor the dashboard: only the tracker's port (and the nodes' free ones) opens.
.venv/bin/meshnet up --stages 3 --port "$PORT" --api-port -1 --dashboard-port -1 >"$log" 2>&1 &
up_pid=$!
trap 'kill -TERM "$up_pid" 2>/dev/null; wait "$up_pid" 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 1 600); do
  grep -q MESHNET_UP_READY "$log" && break
  if ! kill -0 "$up_pid" 2>/dev/null; then
    # meshnet up's own advice names its flag; the demo takes the port from MESHNET_PORT instead
    sed "s/Pass another --port\./Set MESHNET_PORT to another port (it is $PORT)./" "$log" >&2
    exit 1
  fi
  sleep 0.2
done
grep -q MESHNET_UP_READY "$log" || { echo "the mesh did not come up:" >&2; cat "$log" >&2; exit 1; }
grep -v MESHNET_UP_READY "$log" | grep "route ready" >&2 || true
.venv/bin/meshnet generate --tracker "127.0.0.1:$PORT" --temperature 0 --max-tokens 48 "$PROMPT"
