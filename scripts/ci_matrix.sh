#!/usr/bin/env bash
# CI matrix for the ggml engine's lanes: cpu, cuda, rocm, vulkan, metal.
#
# usage: scripts/ci_matrix.sh [--out FILE] [--build]
#   --out    where the JSON report goes (default bench-results/backends.json)
#   --build  also build every lane whose toolchain and device are here ("available") into its own
#            environment .ci-venvs/LANE (scripts/build_ggml_lane.sh; needs network and minutes to hours),
#            run that lane's self-test there (report: bench-results/backends-LANE.json) and then its
#            end-to-end tests, tests/test_accelerator_lane.py (log: bench-results/tests-LANE.log), and
#            `meshnet bench engine --backend LANE` (bench-results/engine-LANE.json).
#            On a Debian 12 machine without a GPU, scripts/vulkan_sw_setup.sh makes the vulkan lane
#            available on a software device first.
#
# Always: the CPU lane runs in full (its self-test against the llama.cpp golden, then
# `meshnet backends --json --certify`), every lane's build command is printed (--dry-run), and each
# accelerator lane is reported as the probe found it: skipped with its exact reason on a machine without
# its SDK or device. Nothing is reported as passed without a recorded self-test behind it.
#
# Exit status: 0 when the CPU lane is certified and no lane claims success without proof (a passed
# self-test on these very libraries, within its tolerance); 1 otherwise.
# Environment: PYTHON (default .venv/bin/python, else python3); MESHNET_CACHE_DIR for the certification
# records (default ~/.cache/meshnet).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

OUT="bench-results/backends.json"
BUILD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "error: --out needs a file" >&2; exit 2; }; OUT="$2"; shift 2 ;;
    --build) BUILD=1; shift ;;
    -h|--help) sed -n '4,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1" >&2; exit 2 ;;
  esac
done

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$(dirname "$OUT")"
LANES="cpu cuda rocm vulkan metal"

echo "== build commands (one switch per lane on top of the cpu default)"
for lane in $LANES; do
  printf '%-7s %s\n' "$lane" "$(PYTHON="$PY" scripts/build_ggml_lane.sh --dry-run "$lane" 2>/dev/null)"
done

echo "== self-tests and lane report ($PY)"
rc=0
"$PY" -m meshnet.backends.cli --json --certify --threads "${THREADS:-2}" > "$OUT.tmp" || rc=$?
if [ "$rc" -gt 1 ] || [ ! -s "$OUT.tmp" ]; then
  echo "error: meshnet backends --certify failed (status $rc)" >&2
  rm -f "$OUT.tmp"
  exit 1
fi
mv "$OUT.tmp" "$OUT"

if [ "$BUILD" = 1 ]; then
  for lane in $(PYTHONPATH="$PYTHONPATH" "$PY" -c 'import json,sys; print(" ".join(r["lane"] for r in json.load(open(sys.argv[1]))["lanes"] if r["state"] == "available"))' "$OUT"); do
    venv=".ci-venvs/$lane"
    echo "== building the $lane lane into $venv"
    VENV="$venv" scripts/setup.sh --test
    PYTHON="$PY" scripts/build_ggml_lane.sh --venv "$venv" "$lane"
    "$venv/bin/python" -m meshnet.backends.cli --json --certify --lane cpu --lane "$lane" \
      > "bench-results/backends-$lane.json" || true
    echo "== end-to-end tests of the $lane lane (bench-results/tests-$lane.log)"
    if ! "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_accelerator_lane.py \
        > "bench-results/tests-$lane.log" 2>&1; then
      tail -5 "bench-results/tests-$lane.log" >&2
      LANE_TEST_FAILURES="${LANE_TEST_FAILURES:-} $lane"
    fi
    tail -1 "bench-results/tests-$lane.log"
    echo "== the $lane lane's speed beside the CPU's (bench-results/engine-$lane.json)"
    "$venv/bin/python" -m meshnet.cli bench engine --backend "$lane" --no-llama-cpp --repeats 1 \
      --out "bench-results/engine-$lane.json" >/dev/null 2>"bench-results/engine-$lane.log" \
      || tail -3 "bench-results/engine-$lane.log" >&2
  done
fi

# The verdict: read the report back and check every claim in it.
LANE_TEST_FAILURES="${LANE_TEST_FAILURES:-}" "$PY" - "$OUT" "$BUILD" <<'EOF'
import glob
import json
import math
import os
import sys

path = sys.argv[1]
report = json.load(open(path))
lib = report["environment"]["ggml"]["lib_sha256"]
states = {"available", "built", "certified", "skipped"}
problems = []


def proved(r: dict, lib_sha: str) -> bool:
    """A certified lane must carry a passed self-test on these libraries, within its tolerance."""
    c = r.get("certification") or {}
    dev, tol = c.get("max_dev"), c.get("logit_atol")
    return (c.get("passed") is True and c.get("lib_sha256") == lib_sha and isinstance(dev, (int, float))
            and isinstance(tol, (int, float)) and math.isfinite(dev) and dev <= tol)


reports = [(path, report)]
if sys.argv[2] == "1":  # --build: the per-lane reports written by this run
    reports += [(p, json.load(open(p))) for p in sorted(glob.glob("bench-results/backends-*.json"))]
for src, rep in reports:
    lib_sha = rep["environment"]["ggml"]["lib_sha256"]
    for r in rep["lanes"]:
        if r["state"] not in states:
            problems.append(f"{src}: {r['lane']}: unknown state {r['state']!r}")
        if not r["reason"]:
            problems.append(f"{src}: {r['lane']}: {r['state']} without a reason")
        if r["state"] == "certified" and not proved(r, lib_sha):
            problems.append(f"{src}: {r['lane']}: claims certified without a passed self-test on these libraries")
    certified = [r["lane"] for r in rep["lanes"] if r["state"] == "certified"]
    if rep["advertisable"] != ["cpu"] + [n for n in certified if n != "cpu"]:
        problems.append(f"{src}: advertisable {rep['advertisable']} is not cpu plus the certified lanes")
    for t in rep["self_tests"]:
        if t["state"] == "certified" and t["lane"] not in certified:
            problems.append(f"{src}: self-test of {t['lane']} passed but the lane is not reported certified")

for lane in os.environ.get("LANE_TEST_FAILURES", "").split():
    problems.append(f"{lane}: tests/test_accelerator_lane.py failed (bench-results/tests-{lane}.log)")

cpu = next(r for r in report["lanes"] if r["lane"] == "cpu")
if cpu["state"] != "certified":
    problems.append(f"cpu lane is {cpu['state']}: {cpu['reason']}")

print(f"{'lane':<7} {'state':<10} reason")
for r in report["lanes"]:
    print(f"{r['lane']:<7} {r['state']:<10} {r['reason']}")
if cpu["state"] == "certified":
    c = cpu["certification"]
    print(f"cpu self-test: {c['model']} against {c['reference']}: max deviation {c['max_dev']:.3g} "
          f"(tolerance {c['logit_atol']}), {c['n_values']} logits")
print(f"advertisable to a tracker: {', '.join(report['advertisable'])}")
for src, rep in reports[1:]:  # --build: each built lane as its own environment reports it
    for r in rep["lanes"]:
        if r["lane"] != "cpu" and r["state"] in ("built", "certified"):
            print(f"{r['lane']} ({src}): {r['state']}: {r['reason']}")

report["ci"] = {"verdict": "fail" if problems else "pass", "problems": problems}
with open(path, "w") as f:
    json.dump(report, f, indent=1)
    f.write("\n")
for p in problems:
    print(f"FAIL: {p}", file=sys.stderr)
print(f"wrote {path}: {'FAIL' if problems else 'pass'}")
sys.exit(1 if problems else 0)
EOF
