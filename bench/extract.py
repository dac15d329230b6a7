"""Benchmark: the plain forward vs naive extraction vs attnkit's fused extraction (issue 3).

    python bench/extract.py --model minilm --length 128 --batch 16
    python bench/extract.py --model bert-base-2048 --length 2048 --batch 1 --json out.json

Configurations, timed side by side in one process (interleaved rounds, median after warm-up):
  plain-eager   transformers eager attention, no statistics
  plain-sdpa    transformers sdpa attention
  naive         eager with output_attentions=True + a vectorised PyTorch computation of attnkit's
                features from the returned B×H×L×L maps (written here, independent of attnkit.reference)
  fused         attnkit: the instrumented model + attnkit.engine.forward_features (fused op)
  intervened    a forward through the fused op with a mix of modes/regions on some heads, no features
Peak memory of each configuration is measured in a fresh subprocess (CPU: peak RSS over the forward,
VmHWM reset just before it, minus the RSS before it; CUDA: torch.cuda.max_memory_allocated).
Inputs are random token ids with real padding (lengths drawn in [L/2, L], one sample full length),
[CLS] first, [SEP] last, some commas/periods, and two sentences per sample.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

try:
    import attnkit  # noqa: F401
except ImportError:  # run from a source checkout: python bench/extract.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = ("plain-eager", "plain-sdpa", "naive", "fused", "intervened")
MODELS = ("minilm", "bert-base", "bert-large", "bert-base-2048", "bert-base-4096", "tiny")


# --- models and inputs -------------------------------------------------------------------------------
def build_model(name: str, length: int, device, dtype):
    from transformers import BertConfig, BertModel

    import attnkit

    torch.manual_seed(0)
    if name == "minilm":
        model, _ = attnkit.load_model(device=device, dtype=dtype)
        return model
    cfg = {
        "bert-base": dict(),
        "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
        "bert-base-2048": dict(num_hidden_layers=4, max_position_embeddings=2048),
        "bert-base-4096": dict(max_position_embeddings=4096),
        # a seconds-long smoke test of the script itself (tools/gpu_check.sh --dry-run)
        "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                     max_position_embeddings=512),
    }[name]
    config = BertConfig(**cfg)
    if length > config.max_position_embeddings:
        sys.exit(f"--length {length} exceeds {name}'s {config.max_position_embeddings} positions")
    model = BertModel(config).to(device=device, dtype=dtype).eval()
    attnkit.instrument(model)
    return model


def make_batch(model, B: int, L: int, device):
    from attnkit.features import CLS, COMMA, PERIOD, SEP
    from attnkit.tokens import Batch

    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    lengths = torch.randint(max(2, L // 2), L + 1, (B,), generator=g)
    lengths[0] = L
    ids = torch.randint(1000, min(vocab, 20000), (B, L), generator=g)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    tc = torch.zeros(B, L, dtype=torch.int32)
    punct = torch.rand(B, L, generator=g)
    tc[punct < 0.05] = COMMA
    tc[punct > 0.95] = PERIOD
    sid = torch.zeros(B, L, dtype=torch.int32)
    for b in range(B):
        n = int(lengths[b])
        tc[b, 0] = CLS
        tc[b, n - 1] = SEP
        sid[b, n // 2:] = 1
        tc[b, n:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    batch = Batch(inputs, lengths, tc, sid, 0)
    return batch.to(device)


# --- the naive way: features from the returned maps ----------------------------------------------------
def naive_features(attentions, lengths, token_class, sentence_id, num_windows: int = 16) -> torch.Tensor:
    """B × layers × H × F features from output_attentions maps (same definitions as docs/features.md)."""
    A = torch.stack(attentions, 1).float()  # B×Ly×H×L×L
    B, Ly, H, L, _ = A.shape
    dev = A.device
    pos = torch.arange(L, device=dev)
    valid = pos[None, :] < lengths[:, None]  # B×L
    A = A * valid[:, None, None, None, :]
    dist = (pos[:, None] - pos[None, :]).abs()
    win = torch.div(dist[None] * num_windows, lengths.view(B, 1, 1), rounding_mode="floor").clamp(max=num_windows - 1)
    idx = torch.where(dist[None] == 0, 4, 5 + win)
    kc = token_class.long()[:, None, :].expand(B, L, L)
    idx = torch.where(kc != 0, kc - 1, idx)  # B×L×L
    nb = 5 + num_windows
    flat = A.reshape(B, Ly * H, L, L)
    buckets = torch.zeros(B, Ly * H, L, nb, device=dev).scatter_add_(-1, idx[:, None].expand_as(flat), flat)
    prev = torch.nn.functional.pad(torch.diagonal(flat, -1, -2, -1), (1, 0))
    nxt = torch.nn.functional.pad(torch.diagonal(flat, 1, -2, -1), (0, 1))
    ent = -torch.special.xlogy(flat, flat).sum(-1)
    mx = flat.amax(-1)
    same = (sentence_id[:, :, None] == sentence_id[:, None, :])[:, None].float()  # B×1×L×L
    intra = (flat * same).sum(-1)
    inter = flat.sum(-1) - intra
    rows = torch.cat([buckets, torch.stack([prev, nxt, ent, mx, intra, inter], -1)], -1)
    rv = valid[:, None, :, None].float()
    means = (rows * rv).sum(2) / lengths.view(B, 1, 1).float()
    is_cls = ((token_class == 1) & valid).float()  # B×L
    cls_ent = (ent * is_cls[:, None]).sum(-1) / is_cls.sum(-1, keepdim=True).clamp(min=1)
    return torch.cat([means, cls_ent[..., None]], -1).view(B, Ly, H, -1)


# --- the configurations ----------------------------------------------------------------------------------
def make_runner(cfg: str, model, batch):
    import attnkit
    from attnkit.engine import forward_features, measuring
    from attnkit.models import runtime_of

    inputs = batch.inputs
    rt = runtime_of(model)
    iv = attnkit.Intervention.for_model(model)
    n_layers, n_heads = iv.shape
    modes, regions = ("zero", "uniform", "keep", "keep"), ("all", "all", "no_intra", "no_inter")
    for layer in range(n_layers):
        for j, h in enumerate(range(layer % 3, n_heads, 3)):  # a third of the heads, mixed
            iv.set(layer, h, mode=modes[j % 4], region=regions[(j + layer) % 4])

    def plain(impl):
        def run():
            model.set_attn_implementation(impl)
            with torch.inference_mode():
                return model(**inputs).last_hidden_state
        return run

    def naive():
        model.set_attn_implementation("eager")
        with torch.inference_mode():
            out = model(**inputs, output_attentions=True)
            return naive_features(out.attentions, batch.lengths, batch.token_class, batch.sentence_id)

    def fused():
        model.set_attn_implementation("attnkit")
        with measuring(model, backend="fused") as r:
            return forward_features(model, batch, r)

    def intervened():
        model.set_attn_implementation("attnkit")
        rt.backend = "fused"
        try:
            with rt.batch_of(batch), attnkit.intervene(model, iv), torch.inference_mode():
                return model(**inputs).last_hidden_state
        finally:
            rt.backend = "auto"

    return {"plain-eager": plain("eager"), "plain-sdpa": plain("sdpa"), "naive": naive, "fused": fused,
            "intervened": intervened}[cfg]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measure_memory(args) -> dict:
    """Run in a fresh process: peak memory of one configuration's forward (after one warm-up run)."""
    device = torch.device(args.device)
    model = build_model(args.model, args.length, device, DTYPES[args.dtype])
    batch = make_batch(model, args.batch, args.length, device)
    run = make_runner(args._memory, model, batch)
    run()  # warm-up: one-time allocations (thread pools, caches) do not count
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        sync(device)
        peak = torch.cuda.max_memory_allocated()
        return {"peak_mb": peak / 2**20, "delta_mb": (peak - base) / 2**20}
    import gc

    gc.collect()
    before = rss_kb("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    run()
    peak = rss_kb("VmHWM")
    return {"peak_mb": peak / 1024, "delta_mb": max(0, peak - before) / 1024, "hwm_reset": reset}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def time_configs(runners: dict, device, args) -> tuple[dict, set]:
    """({configuration: its timed rounds' seconds}, the configurations that ran out of memory)."""
    times = {c: [] for c in runners}
    oom = set()
    for rnd in range(args.warmup + args.repeats):
        for c in runners:  # interleaved: every round runs every configuration, so load drifts hit all alike
            if c in oom:
                continue
            sync(device)
            t = time.perf_counter()
            try:
                runners[c]()
                sync(device)
            except torch.OutOfMemoryError:  # naive extraction at long lengths: recorded, not fatal
                oom.add(c)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            if rnd >= args.warmup:
                times[c].append(time.perf_counter() - t)
    return times, oom


def memory_of(c: str, args) -> dict | None:
    """The memory of configuration `c`, measured in a subprocess of its own (None when it failed)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_memory", c, "--model", args.model, "--length",
           str(args.length), "--batch", str(args.batch), "--dtype", args.dtype, "--device", args.device,
           "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        print(res.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="minilm")
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--no-memory", action="store_true", help="skip the per-configuration memory subprocesses")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    p.add_argument("--_memory", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args._memory:
        print(json.dumps(measure_memory(args)))
        return 0

    import attnkit
    from attnkit import ops

    device = torch.device(args.device)
    cfgs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in cfgs:
        if c not in CONFIGS:
            p.error(f"unknown configuration {c!r}")
    if "fused" in cfgs or "intervened" in cfgs:
        if not ops.has_kernel(device.type):  # (`attnkit.ops` is not an attribute until something imports it)
            sys.exit(f"attnkit's fused op has no {device.type} kernel: build it (python setup.py build_ext --inplace)")
    model = build_model(args.model, args.length, device, DTYPES[args.dtype])
    batch = make_batch(model, args.batch, args.length, device)
    runners = {c: make_runner(c, model, batch) for c in cfgs}
    times, oom = time_configs(runners, device, args)
    n_tokens = int(batch.lengths.sum())
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the subprocesses below need the memory this process cached while timing
    mem = {} if args.no_memory else {c: memory_of(c, args) for c in cfgs}
    rows = {}
    for c in cfgs:
        if c in oom:
            rows[c] = {"oom": True, "median_s": float("nan"), "times_s": [], "tokens_per_s": 0.0, "spread": 0.0,
                       **({"memory": None} if mem else {})}
            continue
        med = statistics.median(times[c])
        rows[c] = {"median_s": med, "times_s": times[c], "tokens_per_s": n_tokens / med,
                   "spread": (max(times[c]) - min(times[c])) / med, **({"memory": mem.get(c)} if mem else {})}

    def ratio(a, b, key="tokens_per_s"):
        return rows[a][key] / rows[b][key] if a in rows and b in rows else None

    ratios = {
        "fused/plain-eager": ratio("fused", "plain-eager"),
        "fused/plain-sdpa": ratio("fused", "plain-sdpa"),
        "fused/naive": ratio("fused", "naive") if "naive" not in oom else "naive out of memory",
        "intervened/plain-eager": ratio("intervened", "plain-eager"),
    }
    what = "GPU memory" if device.type == "cuda" else "RSS"
    for plain in ("plain-eager", "plain-sdpa"):
        if mem and mem.get("fused") and mem.get(plain):
            ratios[f"fused/{plain} peak {what}"] = mem["fused"]["peak_mb"] / mem[plain]["peak_mb"]
            ratios[f"fused/{plain} forward {what} delta"] = (
                mem["fused"]["delta_mb"] / max(mem[plain]["delta_mb"], 1e-9))
    result = {
        "model": args.model, "length": args.length, "batch": args.batch, "dtype": args.dtype, "device": args.device,
        "threads": args.threads if device.type == "cpu" else None, "repeats": args.repeats, "tokens": n_tokens,
        "backend": attnkit.backend_info(), "torch": torch.__version__, "configs": rows, "ratios": ratios,
    }
    print(f"{args.model} L={args.length} B={args.batch} {args.dtype} {args.device} "
          f"({n_tokens} non-padding tokens, median of {args.repeats} after {args.warmup} warm-up)")
    print(f"{'config':<13}{'ms':>10}{'tokens/s':>11}{'spread':>8}{'peak MB':>10}{'fwd Δ MB':>10}")
    for c, r in rows.items():
        if r.get("oom"):
            print(f"{c:<13}{'out of memory':>21}")
            continue
        m = r.get("memory") or {}
        pk = f"{m['peak_mb']:.0f}" if m else "-"
        dl = f"{m['delta_mb']:.0f}" if m else "-"
        print(f"{c:<13}{r['median_s'] * 1e3:>10.1f}{r['tokens_per_s']:>11.0f}{r['spread']:>8.0%}{pk:>10}{dl:>10}")
    for k, v in ratios.items():
        if isinstance(v, str):
            print(f"{k:<40}{v}")
        elif v is not None:
            print(f"{k:<40}{v:.3f}")
    if args.json:
        text = json.dumps(result, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
