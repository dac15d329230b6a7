#!/usr/bin/env bash
# One command for a GPU machine: build attnkit's CUDA kernels for the visible GPU, run every CUDA test,
# run the kernels under compute-sanitizer, run the GPU benchmarks, and print one summary table.
# Everything it prints also lands in OUTDIR: one log per step, steps.tsv (step, status, seconds),
# the benchmarks' JSON files and summary.txt. Meant to finish in under 10 minutes on an H100/H200.
#
#   tools/gpu_check.sh OUTDIR                 # the whole job
#   tools/gpu_check.sh OUTDIR --dry-run       # on a CPU machine: every step in its CPU form (no build,
#                                             # tests collected, benchmarks in --quick CPU mode)
#   STEPS="build tests" tools/gpu_check.sh OUTDIR      # a subset (names: see STEPS below)
#
# Environment:
#   PYTHON                the interpreter (default: python3)
#   ATTNKIT_BENCH_CORPUS  real text for bench/pipeline.py gpu (default: ../shared/data/stsb/dev.tsv when
#                         it exists, else the generated corpus)
#   KERNELS               the CUDA kernel variants to test and time (default: "v1 v2"; a variant the build
#                         does not have is skipped, see ATTNKIT_CUDA_KERNEL in docs/pipeline.md)
#   BENCH_KERNEL          the kernel of the end-to-end benchmarks (default v2 where it exists, the kernel under tuning)
#   BUILD                 0: use the extension already built in place (default 1: build it)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${1:-}"
[[ -n "$OUTDIR" ]] || { echo "usage: tools/gpu_check.sh OUTDIR [--dry-run]" >&2; exit 2; }
shift
DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    *) echo "gpu_check: unknown argument $a" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
STEPS="${STEPS:-env build backend tests sanitize kernels extract512 extract4096 pipeline}"
KERNELS="${KERNELS:-v1 v2}"
# the kernel the end-to-end benchmarks run (kernels.py times every variant side by side)
BENCH_KERNEL="${BENCH_KERNEL:-$(ls csrc/cuda/instantiations/fused_attention_v2_*.cu >/dev/null 2>&1 && echo v2 || echo v1)}"
CORPUS="${ATTNKIT_BENCH_CORPUS:-}"
if [[ -z "$CORPUS" && -f "$ROOT/../shared/data/stsb/dev.tsv" ]]; then CORPUS="$ROOT/../shared/data/stsb/dev.tsv"; fi
: >"$OUTDIR/steps.tsv"

# step NAME COMMAND...: run it, log to OUTDIR/NAME.log (and to the terminal), record status and time.
step() {
  local name="$1"; shift
  case " $STEPS " in *" ${name%%.*} "*) ;; *) return 0 ;; esac
  echo "== $name: $*"
  local t0=$SECONDS
  ( "$@" ) 2>&1 | tee "$OUTDIR/$name.log"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$([[ $rc == 0 ]] && echo ok || echo "FAIL($rc)")" "$((SECONDS - t0))" \
    >>"$OUTDIR/steps.tsv"
  return 0
}

# the kernel variants this build has (v2 only where its sources exist)
variants() {
  local out=""
  for k in $KERNELS; do
    if [[ $k == v1 ]] || ls csrc/cuda/instantiations/fused_attention_v2_*.cu >/dev/null 2>&1; then out="$out $k"; fi
  done
  echo $out
}

if [[ $DRY == 1 ]]; then
  echo "gpu_check: dry run (CPU forms of every step)"
  step env "$PYTHON" -c "import torch, attnkit; print('torch', torch.__version__, 'backend', attnkit.backend_info())"
  step build echo "would run: TORCH_CUDA_ARCH_LIST=(the visible GPU) MAX_JOBS=$(nproc) ATTNKIT_BUILD_CUDA=1" \
    "$PYTHON setup.py build_ext --inplace"
  step tests "$PYTHON" -m pytest -q --collect-only tests/test_fused_cuda.py tests/test_words.py -m "cuda or not cuda"
  step sanitize bash -n tools/sanitize_cuda.sh
  step kernels "$PYTHON" bench/kernels.py --device cpu --quick --json "$OUTDIR/kernels.json"
  step extract512 "$PYTHON" bench/extract.py --model tiny --length 64 --batch 2 --repeats 1 --no-memory \
    --json "$OUTDIR/extract512.json"
  step extract4096 "$PYTHON" bench/extract.py --model tiny --length 96 --batch 1 --repeats 1 --no-memory \
    --configs plain-sdpa,naive,fused --json "$OUTDIR/extract4096.json"
  step pipeline "$PYTHON" bench/pipeline.py gpu --dry-run --segments 200 --repeats 1 --workers 0 \
    ${CORPUS:+--corpus "$CORPUS"} --json "$OUTDIR/pipeline.json"
else
  step env bash -c "nvidia-smi; $PYTHON -c \"import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability())\"; nvcc --version | tail -2; nproc"
  ARCH="$("$PYTHON" -c 'import torch; c = torch.cuda.get_device_capability(); print(f"{c[0]}.{c[1]}")' 2>/dev/null)"
  if [[ "${BUILD:-1}" == 1 ]]; then
    step build env TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)" ATTNKIT_BUILD_CUDA=1 \
      timeout 400 "$PYTHON" setup.py build_ext --inplace
  fi
  step backend "$PYTHON" -c "import attnkit; b = attnkit.backend_info(); print(b); assert b == 'fused-cuda', b"
  for k in $(variants); do
    # every CUDA test (the sanitizer test runs as its own step below)
    # pytest-xdist when present: faster, and a test that crashes its process is reported, not fatal
    XDIST=(); "$PYTHON" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
    step "tests.$k" env ATTNKIT_CUDA_KERNEL="$k" timeout 300 "$PYTHON" -m pytest -q --no-header "${XDIST[@]}" \
      -p no:cacheprovider tests/test_fused_cuda.py tests/test_words.py tests/test_emulate_v2.py \
      -k "(cuda or emulate) and not sanitizer" --junitxml="$OUTDIR/tests_$k.xml"
    step "sanitize.$k" env ATTNKIT_CUDA_KERNEL="$k" TOOLS="memcheck racecheck synccheck initcheck" \
      timeout 240 bash tools/sanitize_cuda.sh
  done
  step kernels timeout 150 "$PYTHON" bench/kernels.py --device cuda --dtype bf16 --L 128 512 2048 --D 32 64 \
    --kernels "$(variants)" --json "$OUTDIR/kernels.json"
  export ATTNKIT_CUDA_KERNEL="$BENCH_KERNEL"
  step extract512 timeout 150 "$PYTHON" bench/extract.py --model bert-base --length 512 --batch 32 --dtype bfloat16 \
    --device cuda --repeats 5 --warmup 2 --configs plain-sdpa,plain-eager,naive,fused,intervened \
    --json "$OUTDIR/extract512.json"
  step extract4096 timeout 150 "$PYTHON" bench/extract.py --model bert-base-4096 --length 4096 --batch 4 --dtype bfloat16 \
    --device cuda --repeats 3 --warmup 1 --configs plain-sdpa,naive,fused \
    --json "$OUTDIR/extract4096.json"
  step pipeline timeout 150 "$PYTHON" bench/pipeline.py gpu --repeats 3 --workers 4 ${CORPUS:+--corpus "$CORPUS"} \
    --json "$OUTDIR/pipeline.json"
fi

"$PYTHON" "$ROOT/tools/gpu_summary.py" "$OUTDIR" | tee "$OUTDIR/summary.txt"
! grep -q FAIL "$OUTDIR/steps.tsv"
