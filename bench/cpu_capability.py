"""The CPU kernel's builds per instruction set (docs/cuda.md, "The CPU kernel: one build per instruction set"), timed
side by side in ONE process (ATTNKIT_CPU_CAPABILITY is read at every call), interleaved rounds, medians:

  op       attnkit.ops.attention with features, B×H×L×D fp32, per capability, against sdpa's forward
  causal   the same op causal vs full (the causal kernel skips the key tiles above the diagonal)
  lengths  the op with features against sdpa (ATen's CPU flash kernel: is_causal, enable_gqa) at SmolLM2-135M's
           shapes (B=1, H=9, Hkv=3, D=64), causal GQA and bidirectional, L = 128 ... 8192 (--lengths), wall and
           CPU-time ratios (CPU time: what the process used, the fairer figure on a shared machine)
  products the op with the tile's two products in place (the default for tiles of up to 2^19 multiply-adds, BQ·BK·D)
           against the same op with every product through BLAS (ATTNKIT_CPU_SMALL_PRODUCTS=0) and sdpa, from
           sentences (B=16, L=20-40) to SmolLM2's L=512, one thread (--threads)
  groups   the op with the query heads of one KV head in one task (the default) against one head per task
           (ATTNKIT_CPU_GROUP_HEADS=1) and sdpa, at SmolLM2-135M's shapes (causal GQA and bidirectional, --lengths)
  wrapper  the op with features through attnkit.ops.attention (its Python: the arguments checked and converted, the
           backend chosen) against the compiled op called directly with the arguments the wrapper passes, and sdpa,
           at SmolLM2-135M's shapes, bidirectional, per length of --lengths: what the Python costs per call
  minilm   attnkit extraction on the embedded MiniLM (bench/extract.py's "fused") per capability, against the
           plain sdpa forward ("plain-sdpa"), B=16, L=128

    python bench/cpu_capability.py                 # all three
    python bench/cpu_capability.py --only op --rounds 50
    python bench/cpu_capability.py --only lengths --lengths 128 512 2048 4096 8192
    python bench/cpu_capability.py --only products --threads 1
    python bench/cpu_capability.py --only groups --lengths 128 512 2048 8192
    python bench/cpu_capability.py --only wrapper --lengths 128 512 --rounds 30
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


def with_env(var: str, value: str, fn):
    """fn, called with the environment variable `var` set to `value` (the kernel reads its settings at every call),
    then restored."""
    def run():
        old = os.environ.get(var)
        os.environ[var] = value
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old
    return run


def forced(cap, fn):
    """fn on the build `cap` ("": torch's choice)."""
    return with_env("ATTNKIT_CPU_CAPABILITY", cap, fn)


def load() -> str:
    try:
        return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load ?"


# A timed sample lasts at least this long: a call shorter than that is repeated within the sample and the mean per
# call taken (a single call of a fraction of a millisecond measures the clock and the scheduler, not the call).
MIN_SAMPLE_S = 0.02


def timed(cfgs: dict, rounds: int, title: str, budget_s: float | None = None) -> dict:
    """Interleaved rounds (every case once per round), medians of wall and process CPU time per call. A case whose
    call takes less than MIN_SAMPLE_S is called that many times per sample (the same count in every round, set by
    its warm-up call). Stops early, after at least 3 rounds, once budget_s seconds have passed. Returns
    {case: (wall s, cpu s)}."""
    reps = {}
    for k, fn in cfgs.items():
        t0 = time.perf_counter()
        fn()  # warm-up
        took = time.perf_counter() - t0
        if took < MIN_SAMPLE_S:  # (a warm call may be faster still: time one)
            t0 = time.perf_counter()
            fn()
            took = time.perf_counter() - t0
        reps[k] = 1 if took >= MIN_SAMPLE_S else min(1000, int(MIN_SAMPLE_S / max(took, 1e-6)) + 1)
    times = {k: [] for k in cfgs}
    cpu = {k: [] for k in cfgs}
    start = time.perf_counter()
    for i in range(rounds):
        for k, fn in cfgs.items():
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(reps[k]):
                fn()
            times[k].append((time.perf_counter() - t0) / reps[k])
            cpu[k].append((time.process_time() - c0) / reps[k])
        if budget_s is not None and i >= 2 and time.perf_counter() - start > budget_s:
            break
    if max(reps.values()) > 1:
        title += " [calls per sample: " + ", ".join(f"{k} {r}" for k, r in reps.items()) + "]"
    base = statistics.median(times[next(iter(times))])
    print(f"-- {title} ({len(times[next(iter(times))])} rounds, {load()} after)")
    for k, v in times.items():
        m = statistics.median(v)
        c = statistics.median(cpu[k])
        print(f"  {k:18s} {m * 1e3:9.2f} ms   {base / m:5.2f}x the first row's speed   cpu {c * 1e3:9.2f} ms")
    return {k: (statistics.median(times[k]), statistics.median(cpu[k])) for k in cfgs}


def special_classes(B: int, L: int, g: torch.Generator) -> torch.Tensor:
    """Token classes as a tokenised text has them: CLS first, about 10% commas and periods (the special-key
    work scales with them), SEP last."""
    tc = torch.zeros(B, L, dtype=torch.int32)
    r = torch.rand(B, L, generator=g)
    tc[r < 0.10] = 3  # COMMA
    tc[r < 0.04] = 4  # PERIOD
    tc[:, 0] = 1
    tc[:, -1] = 2
    return tc


def op_inputs(B, H, L, D, g: torch.Generator, Hkv=None):
    """q, k, v (B×H×L×D, k and v with Hkv heads), lengths and token classes (`special_classes`)."""
    q = torch.randn(B, L, H, D, generator=g).transpose(1, 2)
    k, v = (torch.randn(B, L, Hkv or H, D, generator=g).transpose(1, 2) for _ in range(2))
    return q, k, v, torch.full((B,), L), special_classes(B, L, g)


def lengths(lens, rounds: int, budget_s: float, g: torch.Generator | None = None) -> list[tuple]:
    """The op with features against sdpa at SmolLM2-135M's shapes, causal GQA and bidirectional, per length (the
    module docstring). Returns [(L, "causal" | "full", wall op/sdpa, cpu op/sdpa)], medians."""
    g = g if g is not None else torch.Generator().manual_seed(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    summary = []
    with torch.inference_mode():
        for L in lens:
            q, k, v, n, tc = op_inputs(1, 9, L, 64, g, Hkv=3)
            for causal in (True, False):
                mask = "causal" if causal else "full"
                def op(q=q, k=k, v=v, n=n, tc=tc, causal=causal):
                    return ops.attention(q, k, v, n, tc, want_features=True, causal=causal, backend="fused")

                res = timed({
                    "sdpa": lambda q=q, k=k, v=v, causal=causal: sdpa(q, k, v, is_causal=causal, enable_gqa=True),
                    "attnkit+features": op,
                }, rounds, f"L={L} {mask} GQA B=1 H=9 Hkv=3 D=64", budget_s=budget_s)
                (ws, cs), (wo, co) = res["sdpa"], res["attnkit+features"]
                summary.append((L, mask, wo / ws, co / cs))
    print(f"-- summary: op with features / sdpa (medians; {load()})")
    print(f"{'L':>6s} {'mask':6s} {'wall op/sdpa':>12s} {'cpu op/sdpa':>12s}")
    for L, mask, w, c in summary:
        print(f"{L:6d} {mask:6s} {w:12.3f} {c:12.3f}")
    return summary


PRODUCT_SHAPES = ((16, 2, 36, 8), (16, 12, 20, 32), (16, 12, 40, 32), (16, 12, 64, 32), (16, 12, 128, 32),
                  (4, 12, 128, 64), (2, 12, 256, 64), (1, 9, 512, 64))


def products(rounds: int, g: torch.Generator) -> list[tuple]:
    """The op (features, lengths L/2..L) with its default products against every product through BLAS and sdpa,
    per shape of PRODUCT_SHAPES (B, H, L, D). Returns [(shape, in place / BLAS, in place / sdpa)], medians."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = []
    for B, H, L, D in PRODUCT_SHAPES:
        q, k, v, _, tc = op_inputs(B, H, L, D, g)
        n = torch.randint(L // 2, L + 1, (B,), generator=g)
        n[0] = L
        mask = (torch.arange(L)[None] < n[:, None])[:, None, None, :]

        def op(q=q, k=k, v=v, n=n, tc=tc):
            return ops.attention(q, k, v, n, tc, want_features=True, backend="fused")

        res = timed({"in place": op, "BLAS": with_env("ATTNKIT_CPU_SMALL_PRODUCTS", "0", op),
                     "sdpa": lambda q=q, k=k, v=v, m=mask: sdpa(q, k, v, m)},
                    rounds, f"products B={B} H={H} L={L} D={D}", budget_s=10.0)
        out.append(((B, H, L, D), res["in place"][0] / res["BLAS"][0], res["in place"][0] / res["sdpa"][0]))
    print(f"-- summary: the op with products in place / with BLAS products, and / sdpa (wall medians; {load()})")
    for shape, rb, rs in out:
        print(f"  B={shape[0]:2d} H={shape[1]:2d} L={shape[2]:4d} D={shape[3]:2d}: {rb:5.2f}  {rs:5.2f}")
    return out


def groups(lens, rounds: int, budget_s: float, g: torch.Generator) -> list[tuple]:
    """The op with features, its query heads grouped per KV head (the default) against one head per task and sdpa,
    SmolLM2-135M's shapes (B=1, H=9, Hkv=3, D=64), causal and bidirectional, per length of `lens`. Returns
    [(L, "causal" | "full", grouped / one head per task, grouped / sdpa)], wall medians."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = []
    for L in lens:
        q, k, v, n, tc = op_inputs(1, 9, L, 64, g, Hkv=3)
        for causal in (True, False):
            def op(q=q, k=k, v=v, n=n, tc=tc, causal=causal):
                return ops.attention(q, k, v, n, tc, want_features=True, causal=causal, backend="fused")

            mask = "causal" if causal else "full"
            res = timed({"grouped": op, "one head per task": with_env("ATTNKIT_CPU_GROUP_HEADS", "1", op),
                         "sdpa": lambda q=q, k=k, v=v, causal=causal: sdpa(q, k, v, is_causal=causal, enable_gqa=True)},
                        rounds, f"groups L={L} {mask} GQA B=1 H=9 Hkv=3 D=64", budget_s=budget_s)
            out.append((L, mask, res["grouped"][0] / res["one head per task"][0], res["grouped"][0] / res["sdpa"][0]))
    print(f"-- summary: the op with its heads grouped per KV head / one head per task, and / sdpa (wall medians; "
          f"{load()})")
    for L, mask, rg, rs in out:
        print(f"  L={L:5d} {mask:6s}: {rg:5.3f}  {rs:5.3f}")
    return out


def wrapper(lens, rounds: int, budget_s: float, g: torch.Generator) -> list[tuple]:
    """The op with features through `ops.attention` and called directly (`torch.ops.attnkit.fused_attention` on the
    arguments the wrapper gives it, captured once), against sdpa, SmolLM2-135M's shapes, bidirectional, per length
    of `lens`. Returns [(L, wrapper / sdpa, direct / sdpa)], wall medians."""
    from attnkit.reference import AttentionParams

    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = []
    for L in lens:
        q, k, v, n, tc = op_inputs(1, 9, L, 64, g, Hkv=3)
        p = ops._for_kernels(AttentionParams.of(tc, None, want_features=True), q)
        args = (q, k, v, n.to(torch.int64), *ops._compiled_args(p))
        res = timed({"sdpa": lambda q=q, k=k, v=v: sdpa(q, k, v, enable_gqa=True),
                     "ops.attention": lambda q=q, k=k, v=v, n=n, tc=tc: ops.attention(
                         q, k, v, n, tc, want_features=True, backend="fused"),
                     "the op directly": lambda args=args: torch.ops.attnkit.fused_attention.default(*args)},
                    rounds, f"wrapper L={L} full GQA B=1 H=9 Hkv=3 D=64", budget_s=budget_s)
        s = res["sdpa"][0]
        out.append((L, res["ops.attention"][0] / s, res["the op directly"][0] / s))
    print(f"-- summary: the op with features through ops.attention and called directly, / sdpa (wall medians; "
          f"{load()})")
    for L, w, d in out:
        print(f"  L={L:5d}: {w:5.3f}  {d:5.3f}")
    return out


def minilm(rounds: int, caps=None) -> dict:
    """attnkit extraction on MiniLM, B=16, L=128, per build of `caps` (default: every build this CPU runs; "" is
    torch's choice), against the plain sdpa forward. Returns timed()'s {case: (wall s, cpu s)}: "plain-sdpa" and
    "extract <cap>"."""
    from bench.extract import build_model, make_batch, make_runner

    dev = torch.device("cpu")
    model = build_model("minilm", 128, dev, torch.float32)
    batch = make_batch(model, 16, 128, dev)
    cfgs = {"plain-sdpa": make_runner("plain-sdpa", model, batch)}
    fused = make_runner("fused", model, batch)
    for c in (ops.cpu_capabilities() if caps is None else caps):
        cfgs["extract " + (c or "(torch's choice)")] = forced(c, fused)
    return timed(cfgs, rounds, "MiniLM B=16 L=128: attnkit extraction vs the plain sdpa forward")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["op", "causal", "minilm", "lengths", "products", "groups", "wrapper"],
                   default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096, 8192])
    p.add_argument("--budget", type=float, default=60.0, help="seconds per length and mask (lengths)")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    caps = ops.cpu_capabilities()
    print(f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}; builds timed: {', '.join(caps)}")
    g = torch.Generator().manual_seed(0)

    with torch.inference_mode():
        if args.only in (None, "op"):
            q, k, v, n, tc = op_inputs(16, 12, 128, 32, g)
            cfgs = {"sdpa (no features)": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)}
            for c in caps:
                cfgs[f"attnkit {c}"] = forced(c, lambda: ops.attention(q, k, v, n, tc, want_features=True,
                                                                       backend="fused"))
            timed(cfgs, args.rounds * 3, "op, B=16 H=12 L=128 D=32, features")
        if args.only == "lengths":
            lengths(args.lengths, args.rounds, args.budget, g)
        if args.only == "products":
            products(args.rounds, g)
        if args.only == "groups":
            groups(args.lengths, args.rounds, args.budget, g)
        if args.only == "wrapper":
            wrapper(args.lengths, args.rounds, args.budget, g)
        if args.only in (None, "causal"):
            q, k, v, n, tc = op_inputs(1, 9, 2048, 64, g)
            def run(causal):  # torch's choice of build
                return forced("", lambda: ops.attention(q, k, v, n, tc, want_features=True, causal=causal,
                                                        backend="fused"))

            sdpa = torch.nn.functional.scaled_dot_product_attention
            timed({"attnkit full": run(False), "attnkit causal": run(True),
                   "sdpa full": lambda: sdpa(q, k, v), "sdpa causal": lambda: sdpa(q, k, v, is_causal=True)},
                  args.rounds, "causal vs full, B=1 H=9 L=2048 D=64 (SmolLM2-like), features for attnkit")
    if args.only in (None, "minilm"):
        minilm(max(3, args.rounds // 2), caps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
