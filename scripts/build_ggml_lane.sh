#!/usr/bin/env bash
# Build ggml-python (the ggml engine's C library) for one lane, into a virtual environment.
#
# usage: scripts/build_ggml_lane.sh [--venv DIR] [--dry-run] LANE
#   LANE       cpu | cpu-avx2 | cuda | rocm | vulkan | metal
#   --venv     the environment to install into (default .venv; it must exist, e.g. from scripts/setup.sh)
#   --dry-run  print the exact install command and exit 0; the toolchain check is skipped (a note on
#              stderr says what it would find)
#
# Each lane is the default build plus exactly one backend switch, passed to ggml's CMake through
# scikit-build-core's CMAKE_ARGS:
#   cpu     (none: ggml's default build; on macOS ggml itself turns Metal on by default)
#   cuda    -DGGML_CUDA=on     needs nvcc and cuBLAS, and a GPU: with no other switch ggml compiles for
#                              the GPUs it finds (CMAKE_CUDA_ARCHITECTURES=native), so build where it runs
#   rocm    -DGGML_HIP=on      needs hipcc and hipconfig on PATH (HIPCXX and HIP_PATH come from hipconfig)
#   vulkan  -DGGML_VULKAN=on   needs glslc on PATH, the Vulkan headers (1.3.272 or newer; $VULKAN_SDK/include
#                              first) and the Vulkan loader
#   metal   -DGGML_METAL=on    needs macOS and xcrun (Xcode command line tools)
# and one CPU variant, the cpu lane with its kernels fixed instead of tuned to this machine:
#   cpu-avx2  -DGGML_NATIVE=OFF with AVX, AVX2, FMA, F16C and BMI2 on and AVX512 off: on an AVX-512
#             machine it runs the kernels of an AVX2 machine, so the AVX2 goldens hold exactly there too
#             (scripts/test_cpu_variants.sh runs the suite under both builds)
# Inherited CMAKE_ARGS / SKBUILD_CMAKE_ARGS / SKBUILD_CMAKE_DEFINE are cleared first, so nothing else
# leaks into a lane and the cpu lane really is the default.
#
# The install is
#   [CMAKE_ARGS=<switch>] VENV/bin/python -m pip install --force-reinstall --no-deps --no-cache-dir \
#       --no-binary ggml-python ggml-python==0.0.45
# --no-binary forces a source build (a prebuilt wheel would carry someone else's switches);
# --no-cache-dir stops pip from reusing a wheel it built earlier with other switches (its wheel cache
# does not key on CMAKE_ARGS); --no-deps leaves numpy and the rest alone.
#
# Afterwards the script checks that ggml's backend registry really lists the lane's backend and writes
# VENV/share/meshnet/ggml-lane.json (lane, switch, command, versions, sha256 of the libraries), which
# `meshnet backends --json` reports as the lane's build options. Building does not certify: run
# `meshnet backends --certify` on the machine with the device before a node may advertise the lane.
# Tip: build accelerator lanes into their own environment (--venv .venv-cuda) to keep .venv on the CPU lane.
#
# Exit status: 0 built (or --dry-run); 2 usage or no such venv; 3 the toolchain is missing (the exact
# reason on stderr, e.g. "nvcc is not on PATH"); 4 built, but the backend is not in the result;
# otherwise pip's status.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# Keep in step with the ggml-python pin in pyproject.toml.
GGML_PYTHON_VERSION="0.0.45"

usage() { sed -n '4,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

VENV=".venv"
DRY_RUN=0
LANE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) [ $# -ge 2 ] || usage; VENV="$2"; shift 2 ;;
    --venv=*) VENV="${1#--venv=}"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage ;;
    -*) echo "error: unknown option $1" >&2; usage ;;
    *) [ -z "$LANE" ] || { echo "error: one lane only (got $LANE and $1)" >&2; exit 2; }; LANE="$1"; shift ;;
  esac
done

case "$LANE" in
  cpu) SWITCH="" ;;
  cuda) SWITCH="-DGGML_CUDA=on" ;;
  rocm) SWITCH="-DGGML_HIP=on" ;;
  vulkan) SWITCH="-DGGML_VULKAN=on" ;;
  metal) SWITCH="-DGGML_METAL=on" ;;
  cpu-avx2) SWITCH="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF" ;;
  "") echo "error: which lane? cpu, cpu-avx2, cuda, rocm, vulkan or metal" >&2; usage ;;
  *) echo "error: unknown lane '$LANE'; expected cpu, cpu-avx2, cuda, rocm, vulkan or metal" >&2; exit 2 ;;
esac
# A CPU variant is the cpu lane to meshnet (same backend, same checks); only its switches differ.
BASE_LANE="${LANE%%-*}"

PY="$VENV/bin/python"
PIP_ARGS=(-m pip install --force-reinstall --no-deps --no-cache-dir --no-binary ggml-python
          "ggml-python==$GGML_PYTHON_VERSION")
# CMake compiles HIP with ROCm's clang, which it finds through HIPCXX (llama.cpp's documented recipe);
# these are environment variables, not CMake switches, and a caller's own values are kept.
LANE_ENV=""
if [ "$LANE" = rocm ]; then
  [ -n "${HIPCXX:-}" ] || LANE_ENV+='HIPCXX="$(hipconfig -l)/clang" '
  [ -n "${HIP_PATH:-}" ] || LANE_ENV+='HIP_PATH="$(hipconfig -R)" '
fi
# CMake's FindVulkan takes headers, loader and glslc from $VULKAN_SDK first (the LunarG SDK's variable);
# it is recorded in the command because it decides which headers the lane was built with.
if [ "$LANE" = vulkan ] && [ -n "${VULKAN_SDK:-}" ]; then
  LANE_ENV+="VULKAN_SDK=$VULKAN_SDK "
fi
if [ -n "$SWITCH" ]; then
  if [[ "$SWITCH" == *" "* ]]; then QUOTED="\"$SWITCH\""; else QUOTED="$SWITCH"; fi
  COMMAND="${LANE_ENV}CMAKE_ARGS=$QUOTED $PY ${PIP_ARGS[*]}"
else
  COMMAND="$PY ${PIP_ARGS[*]}"
fi

# The toolchain check is meshnet's own (meshnet.backends.lanes), so this script and `meshnet backends`
# give the same reason word for word. It needs only the standard library.
HOST_PY="${PYTHON:-python3}"
toolchain_problem() {
  local out rc=0
  out="$(PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" "$HOST_PY" -m meshnet.backends.lanes toolchain "$BASE_LANE")" || rc=$?
  if [ "$rc" -eq 3 ]; then echo "$out"; return 0; fi
  if [ "$rc" -ne 0 ]; then echo "the toolchain check itself failed (status $rc) with $HOST_PY"; return 0; fi
  return 1
}

if [ "$DRY_RUN" = 1 ]; then
  if problem="$(toolchain_problem)"; then
    echo "note: --dry-run skips the toolchain check; here it would refuse: $problem" >&2
  fi
  echo "$COMMAND"
  exit 0
fi

if problem="$(toolchain_problem)"; then
  echo "error: cannot build the $LANE lane here: $problem" >&2
  exit 3
fi
if [ ! -x "$PY" ]; then
  echo "error: no virtual environment at $VENV (create it with scripts/setup.sh, or pass --venv DIR)" >&2
  exit 2
fi

unset CMAKE_ARGS SKBUILD_CMAKE_ARGS SKBUILD_CMAKE_DEFINE
if [ "$LANE" = rocm ]; then
  export HIPCXX="${HIPCXX:-$(hipconfig -l)/clang}" HIP_PATH="${HIP_PATH:-$(hipconfig -R)}"
fi
echo "building the $LANE lane: $COMMAND" >&2
if [ -n "$SWITCH" ]; then
  CMAKE_ARGS="$SWITCH" "$PY" "${PIP_ARGS[@]}"
else
  "$PY" "${PIP_ARGS[@]}"
fi
PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m meshnet.backends.lanes record "$BASE_LANE" \
  --cmake-args="$SWITCH" --command="$COMMAND"
