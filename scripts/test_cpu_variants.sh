#!/usr/bin/env bash
# Run the test suite under every CPU kernel variant this machine can run: the native build (.venv, what
# scripts/test.sh uses) and, where the native ggml has AVX-512, an AVX2 build of ggml-python too
# (.venv-avx2, scripts/build_ggml_lane.sh cpu-avx2). Each run picks the llama.cpp goldens made with its
# own ggml's SIMD features (the avx512/ set natively, the AVX2 set under the AVX2 build), so an AVX-512
# machine checks both golden sets exactly, and the logic that picks them.
#
# usage: scripts/test_cpu_variants.sh [pytest arguments]
# The AVX2 build compiles ggml-python from source (about 80 s on 2 cores) once; later runs reuse it.
# Exit status: the first failing run's, else 0.
set -euo pipefail
cd "$(dirname "$0")/.."

features() { "$1/bin/python" -c "from meshnet.backends.cpu_features import ggml_cpu_features as f; print(' '.join(f()))"; }

echo "== native build (.venv)" >&2
bash scripts/test.sh "$@"
native="$(features .venv)"
echo "native ggml CPU kernels: $native" >&2

case " $native " in
  *" AVX512 "*) ;;
  *)
    echo "== AVX2 build: not run: the native ggml here has no AVX-512 (its kernels are already the AVX2" \
         "set's), so one build covers this machine" >&2
    exit 0 ;;
esac

echo "== AVX2 build (.venv-avx2)" >&2
if [ ! -x .venv-avx2/bin/python ] || ! features .venv-avx2 >/dev/null 2>&1 \
   || [[ " $(features .venv-avx2) " == *" AVX512 "* ]]; then
  VENV=.venv-avx2 bash scripts/setup.sh --test
  bash scripts/build_ggml_lane.sh --venv .venv-avx2 cpu-avx2
fi
variant="$(features .venv-avx2)"
echo "AVX2 build's ggml CPU kernels: $variant" >&2
if [[ " $variant " == *" AVX512 "* ]]; then
  echo "error: the cpu-avx2 build still reports AVX512 ($variant)" >&2
  exit 1
fi
exec .venv-avx2/bin/python -m pytest -q "$@"
