#!/usr/bin/env bash
# The GPU check, in calls that each fit one lent command (at most 9 minutes) and stand alone: each one installs
# what it needs from the carried folder, builds the extension or reuses a carried build, and leaves its logs, JSON
# and steps.tsv in OUTDIR (docs/cuda.md, "Checking and measuring on a GPU").
#
#   tools/gpu_check.sh OUTDIR build-bench   # build (or reuse) + kernel bench (v1, v2, Triton vs SDPA-flash) + one ncu report
#   tools/gpu_check.sh OUTDIR tests         # CUDA tests of the changed kernels (C++ and Triton) + compute-sanitizer
#   tools/gpu_check.sh OUTDIR extract       # end-to-end extraction benches (BERT-base L=512 and L=4096) of one
#                                           # kernel (BENCH_KERNEL): one call per kernel, files extract*_KERNEL.json;
#                                           # with BENCH_KERNEL=triton also the causal GQA decoder at L=8192
#   tools/gpu_check.sh OUTDIR CALL --dry-run   # on a CPU machine: the call's CPU form (tests/test_gpu_check.py)
#   tools/gpu_check.sh .gpu_carry prepare   # here, before a lease: the nvidia-cutlass wheel into .gpu_carry/wheels
#
# Carry (the device tool's `carry`): .gpu_carry (wheels/ and, from an earlier call's OUTDIR, the built _C*.so in
# prebuilt/). A call finding .gpu_carry/prebuilt/_C*.so (or PREBUILT=path) uses it instead of building; every call
# that builds copies its .so into OUTDIR, so the next call (even on a restarted machine) can skip the build.
#
# Environment: PYTHON (default python3), CARRY (default .gpu_carry), PREBUILT (a _C*.so to use), KERNELS (kernels
# to test and time, default "v1 v2 triton"), CHANGED (the kernels the tests and the sanitizer check, default
# "v2 triton"), BENCH_KERNEL (the end-to-end benches' kernel, default v2), NCU_KERNEL (default v2).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${1:-}"
CALL="${2:-}"
[[ -n "$OUTDIR" && -n "$CALL" ]] || { echo "usage: tools/gpu_check.sh OUTDIR build-bench|tests|extract|prepare [--dry-run]" >&2; exit 2; }
shift 2
DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    *) echo "gpu_check: unknown argument $a" >&2; exit 2 ;;
  esac
done
case "$CALL" in build-bench|tests|extract|prepare) ;; *) echo "gpu_check: unknown call $CALL" >&2; exit 2 ;; esac
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
PYTHON="${PYTHON:-python3}"
CARRY="${CARRY:-$ROOT/.gpu_carry}"
KERNELS="${KERNELS:-v1 v2 triton}"
CHANGED="${CHANGED:-v1 v2 triton}"
BENCH_KERNEL="${BENCH_KERNEL:-v2}"
NCU_KERNEL="${NCU_KERNEL:-v2}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [[ $CALL == prepare ]]; then  # on this machine: what a lease must carry
  mkdir -p "$OUTDIR/wheels" "$OUTDIR/prebuilt"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$OUTDIR/wheels" nvidia-cutlass==4.2.0.0
  ls -la "$OUTDIR/wheels"
  exit 0
fi
: >"$OUTDIR/steps.tsv"

# step NAME SECONDS COMMAND...: run it under a timeout, log to OUTDIR/NAME.log, record status and time.
step() {
  local name="$1" limit="$2"; shift 2
  echo "== $name (≤ ${limit} s): $*"
  local t0=$SECONDS
  ( timeout "$limit" "$@" ) 2>&1 | tee "$OUTDIR/$name.log"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$([[ $rc == 0 ]] && echo ok || echo "FAIL($rc)")" "$((SECONDS - t0))" \
    >>"$OUTDIR/steps.tsv"
  return 0
}

# the extension: a carried build, else built here (the CUTLASS headers from the carried wheel); its .so goes back
extension() {
  local so="${PREBUILT:-$(ls "$CARRY"/prebuilt/_C*.so 2>/dev/null | head -1)}"
  if [[ $DRY == 1 ]]; then
    step build 60 echo "would use ${so:-a fresh build}: pip install $CARRY/wheels/nvidia_cutlass-*.whl;" \
      "TORCH_CUDA_ARCH_LIST=(the GPU) MAX_JOBS=$(nproc) ATTNKIT_BUILD_CUDA=1 $PYTHON setup.py build_ext --inplace"
    return
  fi
  if [[ -n "$so" && -f "$so" ]]; then
    step build 30 cp "$so" "$ROOT/attnkit/"
  else
    "$PYTHON" -c "import cutlass_library" 2>/dev/null || \
      "$PYTHON" -m pip install -q --no-index --no-deps "$CARRY"/wheels/nvidia_cutlass-*.whl
    local arch
    arch="$("$PYTHON" -c 'import torch; c = torch.cuda.get_device_capability(); print(f"{c[0]}.{c[1]}")')"
    step build 330 env TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="$(nproc)" ATTNKIT_BUILD_CUDA=1 \
      "$PYTHON" setup.py build_ext --inplace
  fi
  cp "$ROOT"/attnkit/_C*.so "$OUTDIR/" 2>/dev/null || true
  step backend 60 "$PYTHON" -c "import attnkit; b = attnkit.backend_info(); print(b); assert b == 'fused-cuda', b"
}

if [[ $DRY == 0 ]]; then
  step env 60 bash -c "nvidia-smi; $PYTHON -c \"import torch, triton; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability(), 'triton', triton.__version__)\"; \
nvcc --version | tail -2; nproc"
else
  step env 60 "$PYTHON" -c "import torch, attnkit; print('torch', torch.__version__, 'backend', attnkit.backend_info())"
fi

case "$CALL" in
  build-bench)
    extension
    if [[ $DRY == 1 ]]; then
      step kernels 120 "$PYTHON" bench/kernels.py --device cpu --quick --json "$OUTDIR/kernels.json"
      step ncu 30 echo "would run: ncu --set full (one ATTNKIT_CUDA_KERNEL=$NCU_KERNEL launch with features, L=2048 D=64)"
    else
      step kernels 150 "$PYTHON" bench/kernels.py --device cuda --dtype bf16 --L 512 2048 --D 64 \
        --kernels "$KERNELS" --json "$OUTDIR/kernels.json"
      step ncu 120 env ATTNKIT_CUDA_KERNEL="$NCU_KERNEL" ncu --launch-skip 2 --launch-count 1 --kernel-name regex:fused \
        --metrics smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
        --section WarpStateStats --section SchedulerStats --section InstructionStats -o "$OUTDIR/ncu_$NCU_KERNEL" -f \
        "$PYTHON" bench/kernels.py --device cuda --dtype bf16 --L 2048 --D 64 --repeats 1 --kernels "$NCU_KERNEL"
    fi
    ;;
  tests)
    extension
    if [[ $DRY == 1 ]]; then
      step tests 120 "$PYTHON" -m pytest -q -p no:cacheprovider --collect-only tests/test_fused_cuda.py \
        tests/test_triton_attention.py tests/test_emulate_v2.py -m "cuda or not cuda"
      step sanitize 30 bash -c "bash -n tools/sanitize_cuda.sh && echo tools/sanitize_cuda.sh: syntax ok"
    else
      XDIST=(); "$PYTHON" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
      for k in $CHANGED; do
        name=$k
        if [[ $k == triton ]]; then  # the Triton kernel compiled for the GPU, on the interpreter tests' cases,
          # then as the op's kernel on the CUDA tests below
          step "tests.$k" 200 env ATTNKIT_TRITON_DEVICE=cuda "$PYTHON" -m pytest -q --no-header -p no:cacheprovider \
            "${XDIST[@]}" tests/test_triton_attention.py --junitxml="$OUTDIR/tests_$k.xml"
          name=$k-op
        fi
        step "tests.$name" 200 env ATTNKIT_CUDA_KERNEL="$k" "$PYTHON" -m pytest -q --no-header "${XDIST[@]}" \
          -p no:cacheprovider tests/test_fused_cuda.py -k "cuda and not sanitizer" --junitxml="$OUTDIR/tests_$name.xml"
        if [[ $k != triton ]]; then  # compute-sanitizer does not apply to Triton's launches
          step "sanitize.$k" 120 env ATTNKIT_CUDA_KERNEL="$k" TOOLS="memcheck racecheck" bash tools/sanitize_cuda.sh
        fi
      done
    fi
    ;;
  extract)
    if [[ $DRY == 1 ]]; then
      step extract512 120 "$PYTHON" bench/extract.py --model tiny --length 64 --batch 2 --repeats 1 --no-memory \
        --json "$OUTDIR/extract512.json"
      step extract4096 120 "$PYTHON" bench/extract.py --model tiny --length 96 --batch 1 --repeats 1 --no-memory \
        --configs plain-sdpa,naive,fused --json "$OUTDIR/extract4096.json"
    else
      extension
      export ATTNKIT_CUDA_KERNEL="$BENCH_KERNEL"
      step extract512 180 "$PYTHON" bench/extract.py --model bert-base --length 512 --batch 32 --dtype bfloat16 \
        --device cuda --repeats 3 --warmup 1 --configs plain-sdpa,fused,intervened --json "$OUTDIR/extract512_$BENCH_KERNEL.json"
      step extract4096 180 "$PYTHON" bench/extract.py --model bert-base-4096 --length 4096 --batch 4 \
        --dtype bfloat16 --device cuda --repeats 3 --warmup 1 --configs plain-sdpa,fused \
        --json "$OUTDIR/extract4096_$BENCH_KERNEL.json"
      if [[ $BENCH_KERNEL == triton ]]; then  # the decoder target: a causal GQA layer with SmolLM2-135M's shapes
        step decoder8192 120 "$PYTHON" bench/kernels.py --device cuda --dtype bf16 --L 8192 --D 64 --heads 9 \
          --kv-heads 3 --causal --tokens 16384 --no-js --kernels triton --json "$OUTDIR/kernels_decoder.json"
      fi
    fi
    ;;
esac

"$PYTHON" "$ROOT/tools/gpu_summary.py" "$OUTDIR" | tee "$OUTDIR/summary.txt"
! grep -q FAIL "$OUTDIR/steps.tsv"
