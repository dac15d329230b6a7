#!/usr/bin/env python3
"""SASS instructions per score on the common path of the v2 kernel's tile loop, without a GPU (docs/cuda.md).

Compiles one v2 instantiation (default: bf16, head dim 64) for sm_90 with this machine's nvcc (CUDA_HOME) and the
CUTLASS/CuTe headers of the `nvidia-cutlass` wheel, disassembles it with `nvdisasm -g` (PATH, or the
`nvidia-cuda-nvdisasm` wheel), and walks one iteration of the tile loop along its common path: the path a tile
takes when it is not the first, no row max grows, every key is of class OTHER and no bucket run ends. The loop and
the rare branches are marked in the kernel source (`// sass-budget: tile loop`, `// sass-budget: rare` on the line
that opens a rare block; `// sass-budget: rare line` on a line that only rare template instantiations issue), so the
walk follows the code as it changes: a conditional forward branch is taken when the code it jumps over is rare (it
issues a rare line, or mostly lines of rare blocks), else the walk falls through; backward branches inside the body
are not taken. Every instruction issued on that path counts, predicated ones included.

Prints the count per score (one tile is kBlockM × kBlockN scores over kThreads threads), broken down by source line
(`-lineinfo`), next to FlashAttention-2's 8.9 (its hdim-64 bf16 forward loop, counted the same way in the review of
issue 28). The issue-bound model of that review: throughput ∝ 1 / (instructions per score).

    python tools/sass_budget.py                       # features kernel, bf16, hdim 64
    python tools/sass_budget.py --kernel plain        # the kernel without features
    python tools/sass_budget.py --json out.json --check tools/sass_budget.json   # exit 1 above the budget
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL_SRC = ROOT / "csrc/cuda/fused_attention_v2_kernel.cuh"
TRAITS_SRC = ROOT / "csrc/cuda/fused_attention_v2_traits.h"
FA2_PER_SCORE = 8.9  # FlashAttention-2 flash_fwd_kernel<64,128,128,4> bf16, main loop, sm_90 (review §1)
# the template flags <Traits, kFeatures, kScaled> in the mangled kernel name
KERNELS = {"features": "Lb1ELb0E", "plain": "Lb0ELb0E", "scaled": "Lb1ELb1E"}
FLAGS = ["-std=c++20", "-O3", "--use_fast_math", "--expt-relaxed-constexpr", "-lineinfo",
         "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "-DATTNKIT_WITH_CUDA", "-D__CUDA_NO_HALF_OPERATORS__",
         "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]


class ToolMissing(RuntimeError):
    """nvcc, nvdisasm or the CUTLASS headers are not on this machine."""


def find_nvcc() -> str:
    nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    if not nvcc.is_file():
        raise ToolMissing(f"nvcc not found at {nvcc} (set CUDA_HOME)")
    return str(nvcc)


def find_nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        hits = sorted(glob.glob(os.path.join(site, "nvidia", "**", "bin", "nvdisasm"), recursive=True))
        if hits:
            return hits[0]
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvdisasm"
    if cuda.is_file():
        return str(cuda)
    raise ToolMissing("nvdisasm not found: pip install nvidia-cuda-nvdisasm (attnkit's 'cuda' extra)")


def cutlass_include() -> str:
    inc = os.environ.get("CUTLASS_INCLUDE")
    if not inc:
        try:
            import cutlass_library
        except ImportError:
            raise ToolMissing("CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0") from None
        inc = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    if not os.path.isdir(os.path.join(inc, "cute")):
        raise ToolMissing(f"no CuTe headers under {inc}")
    return inc


def compile_cubin(source: Path, out: Path, arch: str = "90") -> None:
    from torch.utils.cpp_extension import include_paths

    cmd = [find_nvcc(), "-cubin", f"-arch=sm_{arch}", *FLAGS, f"-I{ROOT / 'csrc'}", f"-I{cutlass_include()}",
           f"-I{sysconfig.get_paths()['include']}"]
    for inc in include_paths():
        cmd += ["-isystem", inc]
    subprocess.run(cmd + ["-o", str(out), str(source)], check=True)


def disassemble(cubin: Path) -> str:
    return subprocess.run([find_nvdisasm(), "-g", "-c", str(cubin)], check=True, capture_output=True,
                          text=True).stdout


def parse(sass: str, name_part: str) -> list[tuple]:
    """The kernel whose section name contains `name_part`: ("L", label) and ("I", offset, text, file, line)."""
    out, inside, where = [], False, (None, 0)
    for ln in sass.splitlines():
        if ln.startswith(".text."):
            inside = name_part in ln and "fused_attention_v2_kernel" in ln
            continue
        if not inside:
            continue
        m = re.match(r'\s*//## File "(.*?)", line (\d+)', ln)
        if m:
            where = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = re.match(r"^(\.L_x_\d+):", ln)
        if m:
            out.append(("L", m.group(1)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", ln)
        if m:
            out.append(("I", int(m.group(1), 16), m.group(2), *where))
    if not out:
        raise SystemExit(f"sass_budget: no fused_attention_v2_kernel with {name_part!r} in the disassembly")
    return out


def markers(src: Path) -> tuple[int, set[int], set[int], set[int]]:
    """(the tile loop's line, the lines inside rare blocks, the lines that open them, the single rare lines) from
    the `sass-budget:` comments of the source."""
    lines = src.read_text().splitlines()
    loop, rare, opening, single = None, set(), set(), set()
    for no, text in enumerate(lines, 1):
        if "sass-budget: tile loop" in text:
            loop = no
        elif "sass-budget: rare line" in text:  # a line only rare instantiations issue (e.g. under if constexpr)
            single.add(no)
        elif "sass-budget: rare" in text:
            opening.add(no)
            depth, end = 0, None
            for j in range(no - 1, len(lines)):  # the block the marked line opens, to its closing brace
                code = lines[j].split("//")[0]
                if j == no - 1:
                    code = code[code.rindex("{"):]
                for ch in code:
                    depth += (ch == "{") - (ch == "}")
                    if depth == 0:
                        end = j + 1
                        break
                if end is not None:
                    break
            rare.update(range(no + 1, (end or no) + 1))
    if loop is None:
        raise SystemExit(f"sass_budget: no 'sass-budget: tile loop' marker in {src}")
    return loop, rare, opening, single


def walk(insts: list[tuple], kernel_file: str, loop_line: int, rare: set[int], opening: set[int],
         single: set[int] = frozenset()) -> list[tuple]:
    """One iteration of the tile loop along the common path (see the module docstring)."""
    labels = {k[1]: i for i, k in enumerate(insts) if k[0] == "L"}
    offset_of = {}
    for name, i in labels.items():
        j = i
        while j < len(insts) and insts[j][0] != "I":
            j += 1
        offset_of[name] = insts[j][1] if j < len(insts) else 1 << 40

    def target(k):
        m = re.search(r"`\((\.L_x_\d+)\)", k[2])
        return m.group(1) if m else None

    back = [(i, k) for i, k in enumerate(insts) if k[0] == "I" and re.search(r"\bBRA\b", k[2])
            and k[3] == kernel_file and k[4] == loop_line and target(k) and offset_of[target(k)] < k[1]]
    if not back:
        raise SystemExit(f"sass_budget: no backward branch at the tile loop's line {loop_line}")
    end, edge = max(back, key=lambda x: x[1][1] - offset_of[target(x[1])])
    head = labels[target(edge)]

    def rare_in(lo, hi):
        """Whether the code a forward branch skips, insts[lo:hi], is rare: it issues a single rare line (only rare
        instantiations do), or most of its own lines are in rare blocks (a common block may hold a rare one).
        A block's reconvergence point carries the line of the block it closes: barriers and predicate saves say
        nothing."""
        own = in_rare = 0
        for k in insts[lo:hi]:
            if k[0] != "I" or k[3] != kernel_file or k[4] in opening:
                continue
            if k[4] in single:
                return True
            if re.match(r"(@\S+\s+)?(BSYNC|BSSY|WARPSYNC|NOP|P2R|R2P)\b", k[2]):
                continue
            own += 1
            in_rare += k[4] in rare
        return in_rare * 2 > own

    path, i, steps = [], head, 0
    while head <= i <= end and steps < 100000:
        steps += 1
        k = insts[i]
        if k[0] == "L":
            i += 1
            continue
        path.append(k)
        text = k[2]
        if i == end or re.search(r"\b(EXIT|RET)\b", text):
            break
        if re.search(r"\bBRA\b", text):
            tgt = target(k)
            conditional = text.startswith("@")
            if tgt is None:
                break
            j = labels[tgt]
            if not conditional:
                i = j
                continue
            if offset_of[tgt] < k[1]:  # a loop inside the body: leave it
                i += 1
                continue
            take = rare_in(i + 1, j)  # jump over a block that holds rare code, else fall through
            i = j if take else i + 1
            continue
        i += 1
    return path


def scores_per_thread(traits: Path = TRAITS_SRC) -> int:
    env = {}
    for m in re.finditer(r"static constexpr int (k\w+) = ([^;]+);", traits.read_text()):
        try:
            env[m.group(1)] = eval(m.group(2), {"__builtins__": {}}, dict(env))  # simple integer arithmetic
        except Exception:
            continue
    return env["kBlockM"] * env["kBlockN"] // env["kThreads"]


def breakdown(path: list[tuple], kernel_file: str, per: int) -> dict:
    src = KERNEL_SRC.read_text().splitlines()
    by_line = collections.Counter()
    for k in path:
        key = f"{k[4]:4d}  {src[k[4] - 1].strip()[:70]}" if k[3] == kernel_file else f"      ({k[3]})"
        by_line[key] += 1
    ops = collections.Counter()
    for k in path:
        words = k[2].split()
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        ops[op.split(".")[0]] += 1
    return {
        "instructions_per_tile_per_thread": len(path),
        "scores_per_thread": per,
        "per_score": round(len(path) / per, 2),
        "fa2_per_score": FA2_PER_SCORE,
        "by_line": {key: round(c / per, 2) for key, c in sorted(by_line.items())},
        "opcodes": {op: round(c / per, 2) for op, c in ops.most_common()},
    }


def measure(kernel: str = "features", dtype: str = "bf16", head_dim: int = 64, cubin: Path | None = None,
            keep: Path | None = None) -> dict:
    source = ROOT / f"csrc/cuda/instantiations/fused_attention_v2_{dtype}_hdim{head_dim}.cu"
    with tempfile.TemporaryDirectory() as tmp:
        if cubin is None:
            cubin = Path(keep or tmp) / f"v2_{dtype}_hdim{head_dim}.cubin"
            compile_cubin(source, cubin)
        sass = disassemble(cubin)
    kernel_file = KERNEL_SRC.name
    loop, rare, opening, single = markers(KERNEL_SRC)
    path = walk(parse(sass, KERNELS[kernel]), kernel_file, loop, rare, opening, single)
    result = breakdown(path, kernel_file, scores_per_thread())
    result.update(kernel=kernel, dtype=dtype, head_dim=head_dim, arch="sm_90")
    return result


def report(r: dict) -> str:
    lines = [f"v2 {r['kernel']} kernel, {r['dtype']} hdim {r['head_dim']}, {r['arch']}: "
             f"{r['instructions_per_tile_per_thread']} instructions per tile per thread, "
             f"{r['per_score']} per score (FA2: {r['fa2_per_score']}; issue-bound model: "
             f"{r['fa2_per_score'] / r['per_score']:.2f}× FA2)",
             "  per score  line  source"]
    lines += [f"  {v:9.2f}  {k}" for k, v in r["by_line"].items()]
    lines.append("  opcodes per score: " + ", ".join(f"{op} {v}" for op, v in list(r["opcodes"].items())[:14]))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="features")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--head-dim", type=int, choices=[32, 64, 128], default=64)
    ap.add_argument("--cubin", type=Path, help="an already compiled cubin (skips nvcc)")
    ap.add_argument("--keep", type=Path, help="keep the compiled cubin in this folder")
    ap.add_argument("--json", type=Path, help="write the result as JSON")
    ap.add_argument("--check", type=Path, help="a budget JSON ({kernel: max per score}): exit 1 above it")
    a = ap.parse_args(argv)
    try:
        r = measure(a.kernel, a.dtype, a.head_dim, a.cubin, a.keep)
    except ToolMissing as exc:
        print(f"sass_budget: {exc}", file=sys.stderr)
        return 2
    print(report(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1) + "\n")
    if a.check:
        budget = json.loads(a.check.read_text())[a.kernel]
        if r["per_score"] > budget:
            print(f"sass_budget: {r['per_score']} per score is above the budget {budget} ({a.check})", file=sys.stderr)
            return 1
        print(f"within the budget of {budget} per score ({a.check})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
