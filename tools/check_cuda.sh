#!/usr/bin/env bash
# Compile-check every csrc/cuda/*.cu (and the host API csrc/cuda/*.cpp, which nvcc hands to the host compiler
# with the CUDA include paths) to an object file against the installed torch's headers.
# Works with a CPU-only torch (no GPU, no libc10_cuda): nothing is linked, but CUDA syntax, template and
# type errors fail the check. Used by .ci/run; documented in README ("CUDA compile check").
#
#   tools/check_cuda.sh            # all files, sm_80 + sm_90, 2 parallel jobs
#   ARCHS="90" JOBS=4 tools/check_cuda.sh csrc/cuda/js_distances_kernel.cu
#
# Environment: CUDA_HOME (default /usr/local/cuda), PYTHON (default python), ARCHS (space-separated SM
# numbers, default "80 90"), JOBS (default 2), OUT_DIR (default: a temporary directory, removed after).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
PYTHON="${PYTHON:-python}"
ARCHS="${ARCHS:-80 90}"
JOBS="${JOBS:-2}"
NVCC="$CUDA_HOME/bin/nvcc"

if [[ ! -x "$NVCC" ]]; then
  echo "check_cuda: nvcc not found at $NVCC (set CUDA_HOME)" >&2
  exit 2
fi

mapfile -t INCLUDES < <("$PYTHON" -c "from torch.utils.cpp_extension import include_paths; print('\n'.join(include_paths()))")
PY_INCLUDE="$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")"
# CUTLASS/CuTe headers (the v2 kernel): $CUTLASS_INCLUDE or the nvidia-cutlass wheel's, as setup.py finds them
CUTLASS_INC="${CUTLASS_INCLUDE:-$("$PYTHON" -c "import os, cutlass_library as c; print(os.path.join(os.path.dirname(c.__file__), 'source', 'include'))" 2>/dev/null || true)}"
if [[ -z "$CUTLASS_INC" || ! -d "$CUTLASS_INC/cute" ]]; then
  echo "check_cuda: CUTLASS/CuTe headers not found: pip install nvidia-cutlass==4.2.0.0 (or set CUTLASS_INCLUDE)" >&2
  exit 2
fi

if [[ $# -gt 0 ]]; then
  FILES=("$@")
else
  mapfile -t FILES < <(ls "$ROOT"/csrc/cuda/*.cpp "$ROOT"/csrc/cuda/*.cu "$ROOT"/csrc/cuda/instantiations/*.cu)
fi

GENCODE=()
for a in $ARCHS; do GENCODE+=("-gencode=arch=compute_${a},code=sm_${a}"); done

# The same defines torch.utils.cpp_extension passes for CUDAExtension builds (half/bf16 operators off),
# plus the one that lets c10/cuda headers compile without torch's CMake-generated config.
FLAGS=(-std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -lineinfo
  -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -DATTNKIT_WITH_CUDA -DTORCH_EXTENSION_NAME=_C
  -DTORCH_API_INCLUDE_EXTENSION_H
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
  -D__CUDA_NO_HALF2_OPERATORS__
  -Xcompiler -fPIC -Xptxas -warn-spills
  "-I$ROOT/csrc" "-I$PY_INCLUDE" "-I$CUTLASS_INC")
for inc in "${INCLUDES[@]}"; do FLAGS+=("-isystem" "$inc"); done

TMP_OUT="${OUT_DIR:-$(mktemp -d)}"
mkdir -p "$TMP_OUT"
cleanup() { [[ -z "${OUT_DIR:-}" ]] && rm -rf "$TMP_OUT"; }
trap cleanup EXIT

compile_one() {
  local f="$1"
  local name; name="$(basename "$f")"; name="${name%.*}"
  local obj="$TMP_OUT/$name.o"
  local log="$TMP_OUT/$name.log"
  local start=$SECONDS
  if "$NVCC" "${FLAGS[@]}" "${GENCODE[@]}" -c "$f" -o "$obj" >"$log" 2>&1; then
    echo "ok   $(basename "$f") ($((SECONDS - start)) s)"
    # ptxas spill warnings are worth seeing but do not fail the check
    grep -i "spill" "$log" | grep -v " 0 bytes spill" | sed 's/^/     /' || true
    return 0
  fi
  echo "FAIL $(basename "$f") ($((SECONDS - start)) s)"
  sed 's/^/     /' "$log"
  return 1
}

echo "check_cuda: ${#FILES[@]} file(s), archs: $ARCHS, jobs: $JOBS, nvcc: $("$NVCC" --version | tail -1)"
T0=$SECONDS
for f in "${FILES[@]}"; do
  while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n || true; done
  name="$(basename "$f")"; name="${name%.*}"
  ( if compile_one "$f" >"$TMP_OUT/$name.result" 2>&1; then echo 0 >"$TMP_OUT/$name.status";
    else echo 1 >"$TMP_OUT/$name.status"; fi ) &
done
wait
FAILED=0
for f in "${FILES[@]}"; do
  name="$(basename "$f")"; name="${name%.*}"
  cat "$TMP_OUT/$name.result"
  [[ "$(cat "$TMP_OUT/$name.status" 2>/dev/null)" == 0 ]] || FAILED=$((FAILED + 1))
done
echo "check_cuda: $(( ${#FILES[@]} - FAILED ))/${#FILES[@]} compiled in $((SECONDS - T0)) s"
[[ $FAILED -eq 0 ]]
