"""Times attnkit's ops alone against PyTorch (issue 4, "Tests and benchmark").

Attention rows, per (L, D):
  fused+features  attnkit.fused_attention with want_features (the fused CUDA/CPU kernel when built;
                  otherwise the PyTorch reference, labelled so)
  fused           the same op without features
  sdpa-flash      F.scaled_dot_product_attention restricted to the flash backend (CUDA fp16/bf16)
  sdpa-efficient  ... restricted to the memory-efficient backend (CUDA)
  sdpa            on CPU: F.scaled_dot_product_attention as it runs by default (ATen's CPU flash kernel, with
                  is_causal and enable_gqa), which is what a model's sdpa forward uses; the MATH backend would
                  flatter the op
  eager+features  eager attention with every map materialised + PyTorch feature reductions
                  (attnkit.reference.reference_attention, what naive extraction does)
TFLOP/s counts the two products, 4·B·H·L²·D, for every row (features are extra work the others skip);
`vs sdpa` is the row's TFLOP/s over the best SDPA backend of the same (L, D). Batches have no padding
(the flash backend takes no per-sample mask), tokens per batch are fixed (--tokens).

JS rows: attnkit.js_distances for M heads (default 144 = BERT-base), B samples of length L, against a
chunked PyTorch implementation (one head against all others at a time; no M²×L×L tensor).

    python bench/kernels.py                         # CUDA when available, else CPU (small sizes)
    python bench/kernels.py --device cpu --quick    # smoke test
    python bench/kernels.py --dtype fp16 --L 2048 --D 64 --json out.json
    python bench/kernels.py --L 8192 --D 64 --heads 9 --kv-heads 3 --causal --tokens 8192 --kernels triton
                                                    # a causal GQA decoder layer (SmolLM2-135M's shapes)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attnkit import ops  # noqa: E402
from attnkit.features import CLS, COMMA, PERIOD, SEP  # noqa: E402
from attnkit.reference import reference_attention  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def timeit(fn, device: str, repeats: int, warmup: int = 2) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_inputs(B, H, L, D, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(B, L, H, D, generator=g).to(device, dtype).transpose(1, 2) for _ in range(3))
    lengths = torch.full((B,), L, dtype=torch.int64, device=device)
    token_class = torch.zeros(B, L, dtype=torch.int32)
    token_class[:, 0] = CLS
    token_class[:, -1] = SEP
    # about 10% commas and periods, as text has them (the op's special-key work grows with them)
    token_class[:, L // 3 :: 11] = PERIOD
    token_class[:, 5::13] = COMMA
    sentence_id = (torch.arange(L) > L // 2).int().expand(B, L).contiguous()
    return q, k, v, lengths, token_class.to(device), sentence_id.to(device)


def sdpa_backends(device: str, dtype: torch.dtype):
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # very old torch
        return {}
    if device == "cuda":
        out = {"sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
        if dtype in (torch.float16, torch.bfloat16):
            out = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, **out}
        return {name: (sdpa_kernel, b) for name, b in out.items()}
    return {"sdpa": (lambda _backend: contextlib.nullcontext(), None)}  # ATen's own choice: its flash kernel


def with_kernel(variant, fn):
    """fn run with the CUDA kernel variant `variant` (ATTNKIT_CUDA_KERNEL, read by the op at each call)."""
    if variant is None:
        return fn

    def run():
        old = os.environ.get("ATTNKIT_CUDA_KERNEL")
        os.environ["ATTNKIT_CUDA_KERNEL"] = variant
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop("ATTNKIT_CUDA_KERNEL", None)
            else:
                os.environ["ATTNKIT_CUDA_KERNEL"] = old
    return run


def bench_attention(args, device, dtype, rows):
    fused_label = ops.backend_label("auto", device)
    for L in args.L:
        for D in args.D:
            B = max(1, args.tokens // L)
            H = args.heads or (768 // D if D >= 64 else 12)
            q, k, v, lengths, tc, sid = attention_inputs(B, H, L, D, dtype, device)
            Hkv = args.kv_heads or H
            k, v = k[:, :Hkv], v[:, :Hkv]  # grouped-query attention: K/V of Hkv heads, never repeated
            dec = {"causal": True} if args.causal else {}
            flops = 4.0 * B * H * L * L * D / (2 if args.causal else 1)  # causal: the visible half
            scaling = D**-0.5
            cases = {}
            variants = args.kernels or [None]
            if args.causal or Hkv != H:  # v2 refuses the decoder arguments
                variants = [x for x in variants if x != "v2"] or [None]
            for variant in variants:
                label = fused_label + (f"-{variant}" if variant else "")
                cases[f"{label}+features"] = with_kernel(variant, lambda: ops.attention(
                    q, k, v, lengths, tc, sid, scaling=scaling, want_features=True, **dec))
                cases[label] = with_kernel(variant, lambda: ops.attention(q, k, v, lengths, tc, sid, scaling=scaling,
                                                                          **dec))
            for name, (ctx, backend) in sdpa_backends(device, dtype).items():
                def run(ctx=ctx, backend=backend):
                    with ctx(backend):
                        return F.scaled_dot_product_attention(q, k, v, scale=scaling, is_causal=args.causal,
                                                              enable_gqa=Hkv != H)
                cases[name] = run
            # the naive path materialises B×H×L×L fp32 maps several times over: skip what cannot fit
            eager_bytes = 4 * 4 * B * H * L * L
            if eager_bytes < args.eager_limit_gb * 2**30:
                cases["eager+features"] = lambda: reference_attention(
                    q, k, v, lengths, tc, sid, scaling=scaling, want_features=True, **dec)
            results = {}
            for name, fn in cases.items():
                try:
                    results[name] = timeit(fn, device, args.repeats)
                except RuntimeError as exc:  # e.g. a backend that rejects this configuration
                    print(f"  skip {name} L={L} D={D}: {str(exc).splitlines()[0][:100]}", file=sys.stderr)
            sdpa_times = [t for n, t in results.items() if n.startswith("sdpa")]
            best_sdpa = min(sdpa_times) if sdpa_times else math.nan
            for name, t in results.items():
                rows.append({
                    "kind": "attention", "name": name, "L": L, "D": D, "B": B, "H": H, "Hkv": Hkv,
                    "causal": bool(args.causal),
                    "dtype": str(dtype).replace("torch.", ""), "ms": t * 1e3,
                    "tflops": flops / t / 1e12, "vs_sdpa": best_sdpa / t if sdpa_times else None,
                })
            del q, k, v
            if device == "cuda":
                torch.cuda.empty_cache()


def js_chunked(attn: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The PyTorch baseline: one head against all M at a time (B×M×L×L per step), fp32 math."""
    B, M, L, _ = attn.shape
    rows = (torch.arange(L, device=attn.device)[None, :] < lengths[:, None]).to(attn.dtype)  # B×L
    xl = torch.special.xlogy(attn, attn)
    out = torch.zeros(M, M, dtype=torch.float64, device=attn.device)
    for i in range(M):
        m = 0.5 * (attn[:, i : i + 1] + attn)
        js = 0.5 * (xl[:, i : i + 1] + xl) - torch.special.xlogy(m, m)
        out[i] = (js.sum(-1) * rows[:, None, :]).sum((0, 2)).double()
    return out


def bench_js(args, device, rows):
    B, M, L = args.js_batch, args.js_heads, args.js_len
    g = torch.Generator(device="cpu").manual_seed(1)
    attn = torch.softmax(torch.randn(B, M, L, L, generator=g), -1).to(device)
    lengths = torch.full((B,), L, dtype=torch.int64, device=device)
    t_chunked = timeit(lambda: js_chunked(attn, lengths), device, max(1, args.repeats // 2), warmup=1)
    rows.append({"kind": "js", "name": "pytorch-chunked", "B": B, "M": M, "L": L, "ms": t_chunked * 1e3,
                 "speedup": 1.0})
    if not ops.has_kernel(device, "attnkit::js_distances"):
        print(f"  attnkit.js_distances has no {device} kernel in this build: only the baseline is timed",
              file=sys.stderr)
        return
    got = ops.js_distances(attn, lengths)
    want = js_chunked(attn, lengths)
    err = ((got - want).abs().max() / want.abs().max()).item()
    t = timeit(lambda: ops.js_distances(attn, lengths), device, args.repeats)
    rows.append({"kind": "js", "name": f"attnkit-{device}", "B": B, "M": M, "L": L, "ms": t * 1e3,
                 "speedup": t_chunked / t, "max_rel_diff": err})


def print_rows(rows):
    att = [r for r in rows if r["kind"] == "attention"]
    if att:
        print(f"{'name':<24}{'dtype':<10}{'L':>6}{'D':>5}{'B':>5}{'H':>4}{'ms':>10}{'TFLOP/s':>10}{'vs sdpa':>9}")
        for r in att:
            vs = f"{r['vs_sdpa']:.2f}" if r["vs_sdpa"] is not None else "-"
            print(f"{r['name']:<24}{r['dtype']:<10}{r['L']:>6}{r['D']:>5}{r['B']:>5}{r['H']:>4}"
                  f"{r['ms']:>10.3f}{r['tflops']:>10.4f}{vs:>9}")
    js = [r for r in rows if r["kind"] == "js"]
    if js:
        print(f"\n{'js_distances':<24}{'B':>5}{'M':>5}{'L':>6}{'ms':>10}{'speedup':>9}")
        for r in js:
            extra = f"  (max rel diff {r['max_rel_diff']:.1e})" if "max_rel_diff" in r else ""
            print(f"{r['name']:<24}{r['B']:>5}{r['M']:>5}{r['L']:>6}{r['ms']:>10.3f}{r['speedup']:>9.1f}{extra}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--L", type=int, nargs="+", default=None, help="default: 128 512 2048 (CPU: 128 512)")
    p.add_argument("--D", type=int, nargs="+", default=[32, 64])
    p.add_argument("--heads", type=int, default=None, help="default: 768 / D (12 for D=32)")
    p.add_argument("--tokens", type=int, default=None, help="B·L per batch (default 32768 CUDA, 1024 CPU)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--eager-limit-gb", type=float, default=24.0)
    p.add_argument("--js-heads", type=int, default=None, help="default 144 (CPU: 24)")
    p.add_argument("--js-batch", type=int, default=None, help="default 32 (CPU: 2)")
    p.add_argument("--js-len", type=int, default=None, help="default 128 (CPU: 64)")
    p.add_argument("--no-js", action="store_true")
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--causal", action="store_true", help="causal attention (decoders; TFLOP/s count the visible half)")
    p.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention: K/V heads (default: --heads)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
    p.add_argument("--kernels", default="", help="CUDA kernel variants to time side by side, e.g. 'v1 v2' "
                   "(ATTNKIT_CUDA_KERNEL); default: the one the op selects")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.kernels = args.kernels.split() if args.device == "cuda" else []
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    args.L = args.L or ([128, 512, 2048] if cuda else [128, 512])
    args.tokens = args.tokens or (32768 if cuda else 1024)
    args.repeats = args.repeats or (20 if cuda else 3)
    args.js_heads = args.js_heads or (144 if cuda else 24)
    args.js_batch = args.js_batch or (32 if cuda else 2)
    args.js_len = args.js_len or (128 if cuda else 64)
    if args.quick:
        args.L = [min(x, 128) for x in args.L][:1]
        args.tokens, args.repeats = min(args.tokens, 256), 2
        args.js_heads, args.js_batch, args.js_len = min(args.js_heads, 12), 1, min(args.js_len, 32)
    torch.manual_seed(0)
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "backend": ops.backend_label("auto", args.device), "threads": torch.get_num_threads()}
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    rows = []
    with torch.inference_mode():
        if not args.no_attention:
            bench_attention(args, args.device, dtype, rows)
        if not args.no_js:
            bench_js(args, args.device, rows)
    print_rows(rows)
    if args.json:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
