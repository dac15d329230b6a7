#!/usr/bin/env bash
# Runs attnkit's CUDA kernels on small cases under compute-sanitizer (memcheck, racecheck, synccheck,
# initcheck); fails on any reported error. ATTNKIT_CUDA_KERNEL (v1/v2) picks the kernel under test. Needs a GPU and attnkit._C built with CUDA
# (python setup.py build_ext --inplace). Called by tests/test_fused_cuda.py when compute-sanitizer exists.
#
#   tools/sanitize_cuda.sh              # all four tools
#   TOOLS="memcheck" tools/sanitize_cuda.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
PYTHON="${PYTHON:-python}"
TOOLS="${TOOLS:-memcheck racecheck synccheck initcheck}"
SAN="$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")"
[[ -x "$SAN" ]] || { echo "sanitize_cuda: compute-sanitizer not found" >&2; exit 2; }

CASE="$(mktemp --suffix=.py)"
trap 'rm -f "$CASE"' EXIT
cat >"$CASE" <<'PY'
import torch
import attnkit.ops  # loads attnkit._C
from attnkit.ops import has_kernel
assert torch.cuda.is_available() and has_kernel("cuda"), "needs a GPU and the CUDA kernels"
torch.manual_seed(0)
B, H, L = 2, 3, 70  # L not a multiple of any tile; sample 1 padded
lengths = torch.tensor([70, 9], device="cuda")
tc = torch.zeros(B, L, dtype=torch.int32, device="cuda"); tc[:, 0] = 1; tc[0, 69] = 2; tc[1, 8] = 2
sid = (torch.arange(L, device="cuda") > 30).int().expand(B, L).contiguous()
mode = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
region = torch.tensor([1, 0, 2], dtype=torch.int32, device="cuda")
gates = torch.tensor([1.0, 0.5, 2.0], device="cuda")
key_scale = torch.rand(B, H, L, device="cuda")
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for D in (32, 64, 128):
        q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(3))
        for want in (True, False):
            for renorm in (False, True):
                for ks in ((None, key_scale) if want else (None,)):
                    torch.ops.attnkit.fused_attention(q, k, v, lengths, tc, sid, D ** -0.5, 16, mode, region,
                                                      renorm, gates, want, ks)
attn = torch.softmax(torch.randn(2, 40, 70, 70, device="cuda"), -1)
torch.ops.attnkit.js_distances(attn, lengths)
torch.cuda.synchronize()
print("sanitize case done")
PY

FILTER=()
if "$SAN" --help 2>&1 | grep -q -- "--kernel-name"; then
  FILTER=(--kernel-name kns=attnkit)  # check only attnkit's kernels (torch's own are not ours to fix)
fi
STATUS=0
for tool in $TOOLS; do
  echo "== compute-sanitizer --tool $tool"
  if ! (cd "$ROOT" && "$SAN" --tool "$tool" --error-exitcode 1 "${FILTER[@]}" "$PYTHON" "$CASE"); then
    echo "sanitize_cuda: $tool reported errors" >&2
    STATUS=1
  fi
done
exit $STATUS
