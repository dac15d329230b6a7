"""tools/sass_budget.py: the walk along the tile loop's common path (on a small made-up disassembly), and v2's
committed budget of SASS instructions per score (tools/sass_budget.json) on the real kernel, compiled for sm_90 with
this machine's nvcc and disassembled with nvdisasm (skipped without them: CI has both, docs/cuda.md)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import sass_budget  # noqa: E402

SOURCE = """\
void k() {
  for (int tile = 0; tile < n; ++tile) {  // sass-budget: tile loop
    a();
    if (grows) {  // sass-budget: rare
      rescale();
    }
    b();
  }
}
"""

SASS = """\
.text._ZN7attnkit4cuda2v225fused_attention_v2_kernelIfLb1ELb0EEEvv:
\t//## File "k.cuh", line 1
        /*0000*/                   MOV R1, R2 ;
.L_x_1:
\t//## File "k.cuh", line 3
        /*0010*/                   FADD R1, R1, R2 ;
\t//## File "k.cuh", line 4
        /*0020*/                   @!P0 BRA `(.L_x_2) ;
\t//## File "k.cuh", line 5
        /*0030*/                   FMUL R3, R3, R4 ;
        /*0040*/                   FMUL R5, R5, R4 ;
.L_x_2:
\t//## File "k.cuh", line 6
        /*0050*/                   BSYNC B0 ;
\t//## File "k.cuh", line 7
        /*0060*/                   FFMA R1, R1, R2, R3 ;
\t//## File "k.cuh", line 2
        /*0070*/                   @P1 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
"""


def test_walk_skips_rare_blocks_and_stops_at_the_back_edge(tmp_path):
    src = tmp_path / "k.cuh"
    src.write_text(SOURCE)
    loop, rare, opening, single = sass_budget.markers(src)
    assert (loop, rare, opening, single) == (2, {5, 6}, {4}, set())
    insts = sass_budget.parse(SASS, "Lb1ELb0E")
    path = sass_budget.walk(insts, "k.cuh", loop, rare, opening)
    assert [k[2] for k in path] == ["FADD R1, R1, R2", "@!P0 BRA `(.L_x_2)", "BSYNC B0", "FFMA R1, R1, R2, R3",
                                    "@P1 BRA `(.L_x_1)"]


def test_v2_stays_within_its_budget(tmp_path):
    try:
        sass_budget.find_nvcc()
        sass_budget.find_nvdisasm()
        sass_budget.cutlass_include()
    except sass_budget.ToolMissing as exc:
        pytest.skip(str(exc))
    budget = json.loads((ROOT / "tools/sass_budget.json").read_text())
    cubin = tmp_path / "v2.cubin"
    sass_budget.compile_cubin(ROOT / "csrc/cuda/instantiations/fused_attention_v2_bf16_hdim64.cu", cubin)
    for kernel in ("features", "plain"):
        r = sass_budget.measure(kernel, cubin=cubin)
        assert r["by_line"]
        assert r["per_score"] <= budget[kernel], sass_budget.report(r)
