"""The CPU kernel's builds per instruction set (docs/cuda.md, "The CPU kernel: one build per instruction set"), timed
side by side in ONE process (ATTNKIT_CPU_CAPABILITY is read at every call), interleaved rounds, medians:

  op       attnkit.ops.attention with features, B×H×L×D fp32, per capability, against sdpa's forward
  causal   the same op causal vs full (the causal kernel skips the key tiles above the diagonal)
  minilm   attnkit extraction on the embedded MiniLM (bench/extract.py's "fused") per capability, against the
           plain sdpa forward ("plain-sdpa"), B=16, L=128

    python bench/cpu_capability.py                 # all three
    python bench/cpu_capability.py --only op --rounds 50
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attnkit import ops  # noqa: E402


def forced(cap, fn):
    def run():
        os.environ["ATTNKIT_CPU_CAPABILITY"] = cap
        return fn()
    return run


def timed(cfgs: dict, rounds: int, title: str) -> None:
    for fn in cfgs.values():
        fn()
    times = {k: [] for k in cfgs}
    for _ in range(rounds):
        for k, fn in cfgs.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times[next(iter(times))])
    print(f"-- {title}")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"  {k:18s} {m * 1e3:9.2f} ms   {base / m:5.2f}x the first row's speed")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["op", "causal", "minilm"], default=None)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    caps = ops.cpu_capabilities()
    print(f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}; builds timed: {', '.join(caps)}")
    g = torch.Generator().manual_seed(0)

    def op_inputs(B, H, L, D):
        q, k, v = (torch.randn(B, L, H, D, generator=g).transpose(1, 2) for _ in range(3))
        tc = torch.zeros(B, L, dtype=torch.int32)
        tc[:, 0] = 1
        return q, k, v, torch.full((B,), L), tc

    with torch.inference_mode():
        if args.only in (None, "op"):
            q, k, v, lengths, tc = op_inputs(16, 12, 128, 32)
            cfgs = {"sdpa (no features)": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)}
            for c in caps:
                cfgs[f"attnkit {c}"] = forced(c, lambda: ops.attention(q, k, v, lengths, tc, want_features=True,
                                                                       backend="fused"))
            timed(cfgs, args.rounds * 3, "op, B=16 H=12 L=128 D=32, features")
        if args.only in (None, "causal"):
            q, k, v, lengths, tc = op_inputs(1, 9, 2048, 64)
            def run(causal):  # torch's choice of build
                return forced("", lambda: ops.attention(q, k, v, lengths, tc, want_features=True, causal=causal,
                                                        backend="fused"))

            sdpa = torch.nn.functional.scaled_dot_product_attention
            timed({"attnkit full": run(False), "attnkit causal": run(True),
                   "sdpa full": lambda: sdpa(q, k, v), "sdpa causal": lambda: sdpa(q, k, v, is_causal=True)},
                  args.rounds, "causal vs full, B=1 H=9 L=2048 D=64 (SmolLM2-like), features for attnkit")
    if args.only in (None, "minilm"):
        from bench.extract import build_model, make_batch, make_runner

        dev = torch.device("cpu")
        model = build_model("minilm", 128, dev, torch.float32)
        batch = make_batch(model, 16, 128, dev)
        cfgs = {"plain-sdpa": make_runner("plain-sdpa", model, batch)}
        fused = make_runner("fused", model, batch)
        for c in caps:
            cfgs[f"extract {c}"] = forced(c, fused)
        cfgs["plain-sdpa"] = forced("", cfgs["plain-sdpa"])  # (no attnkit op inside; the last row forced one)
        timed(cfgs, max(3, args.rounds // 2), "MiniLM B=16 L=128: attnkit extraction vs the plain sdpa forward")
    os.environ.pop("ATTNKIT_CPU_CAPABILITY", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
