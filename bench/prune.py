"""Benchmark: a physically pruned model against the full one (issue 17; docs/pruning.md).

    python bench/prune.py --model minilm --length 128 --batch 16 --repeats 7
    python bench/prune.py --model bert-base --length 512 --batch 4 --repeats 5 --json out.json
    python bench/prune.py --model llama --length 128 --batch 8 --repeats 7 --by-kv-group
    python bench/prune.py --model smollm2 --length 128 --batch 4 --repeats 5

The pruned model is the full one with `--fraction` of the heads of every layer removed (heads 1, 3, 5, … of each
layer for 0.5; `--heads L0H1,...` for a list of your own) by attnkit.arch.prune_heads. Configurations, timed side
by side in one process (interleaved rounds: every configuration once per round; medians after one warm-up each):
  plain         the plain forward (transformers' sdpa attention, no measurement)
  extract       attnkit extraction: the fused op with features (attnkit.engine.forward_features)
  extract-norm  the same with norm-weighted features (the per-key norms added)
each for the full and the pruned model. Speed-up: the ratio of the medians, and the median of the per-round ratios
(full time / pruned time of the same round; robust to other load on the machine drifting over the run). FLOPs are
those of the plain forward counted by torch's FlopCounterMode on eager attention (attnkit/ablation/sizes.py); the
FLOP share removed is printed next to the measured speed-ups.
Inputs: bench/extract.py's batch (random ids with real padding, [CLS]/[SEP], some punctuation, two sentences).

Decoders (grouped-query attention, docs/pruning.md): `--model smollm2` (the embedded SmolLM2-135M: 30 layers, 9
query heads, 3 KV heads, hidden 576) or `--model llama` (a random Llama of SmolLM2's width with 8 layers). With
`--by-kv-group`, whole groups are removed: round(fraction · Hkv) KV heads of every layer with all their query heads
(a KV head goes with its last query head); without it, the query heads of `--fraction` as above, which for SmolLM2
(1, 3, 6, 8 of 9 at 0.5) leaves every KV head in place, in uneven groups (the op's kv_head).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

# this checkout's attnkit (not another installed one), and bench/extract.py's model and batch
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from extract import DTYPES, MODELS, build_model, make_batch, sync  # noqa: E402

CONFIGS = ("plain", "extract", "extract-norm")
DECODERS = ("llama", "smollm2")


def build_decoder(name: str, device, dtype):
    """The embedded SmolLM2 (base model), or a random Llama of its width with 8 layers, instrumented."""
    import attnkit

    if name == "smollm2":
        model, _ = attnkit.load_model("smollm2", device=device, dtype=dtype)
        return model
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_hidden_layers=8, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                               max_position_embeddings=2048)
    return attnkit.instrument(AutoModel.from_config(cfg).to(device=device, dtype=dtype).eval())


def whole_kv_groups(model, fraction: float) -> list[tuple[int, int]]:
    """Heads to remove: every query head of round(fraction · Hkv) KV heads of every layer (spread as above)."""
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    Hkv = model.config.num_key_value_heads
    k = round(fraction * Hkv)
    picks = sorted({int(x) for x in torch.linspace(1, Hkv - 1, k).round().tolist()}) if k < Hkv else range(Hkv)
    g = H // Hkv
    return [(l, h) for l in range(L) for kv in picks for h in range(kv * g, (kv + 1) * g)]


def half_of_every_layer(model, fraction: float) -> list[tuple[int, int]]:
    """Heads to remove: round(fraction · H) of every layer, spread over the layer (1, 3, 5, … for 0.5)."""
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    k = round(fraction * H)
    picks = sorted({int(x) for x in torch.linspace(1, H - 1, k).round().tolist()}) if k < H else list(range(H))
    return [(l, h) for l in range(L) for h in picks]


def runner(cfg: str, model, batch):
    from attnkit.engine import forward_features, measuring

    def plain():
        model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            return model(**batch.inputs).last_hidden_state

    def extract(weighting):
        def run():
            model.set_attn_implementation("attnkit")
            with measuring(model, backend="auto", weighting=weighting) as rt:
                return forward_features(model, batch, rt)
        return run

    return {"plain": plain, "extract": extract("attention"), "extract-norm": extract("norm")}[cfg]


def main(argv=None) -> dict:
    from attnkit.ablation.sizes import count_parameters, forward_flops
    from attnkit.arch import prune_heads
    from attnkit.interventions import format_heads, parse_heads

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS + DECODERS, default="minilm")
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.5, help="share of every layer's heads to remove")
    ap.add_argument("--heads", default=None, help="heads to remove instead, e.g. L0H1,L2 (L2: all of layer 2)")
    ap.add_argument("--by-kv-group", action="store_true",
                    help="decoders: remove whole KV groups (--fraction of the KV heads of every layer)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the results (every timing) to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    decoder = args.model in DECODERS
    full = (build_decoder(args.model, device, DTYPES[args.dtype]) if decoder else
            build_model(args.model, args.length, device, DTYPES[args.dtype]))
    shape = (full.config.num_hidden_layers, full.config.num_attention_heads)
    pick = whole_kv_groups if args.by_kv_group else half_of_every_layer
    heads = parse_heads(args.heads, shape) if args.heads else pick(full, args.fraction)
    pruned = prune_heads(copy.deepcopy(full), heads)
    batch = make_batch(full, args.batch, args.length, device)
    if decoder:  # a decoder takes no token_type_ids
        batch.inputs.pop("token_type_ids", None)
    n_tokens = int(batch.lengths.sum())
    models = {"full": full, "pruned": pruned}
    runs = {(m, c): runner(c, models[m], batch) for m in models for c in CONFIGS}
    for run in runs.values():  # warm-up
        run()
    times = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, run in runs.items():
            sync(device)
            t0 = time.perf_counter()
            run()
            sync(device)
            times[key].append(time.perf_counter() - t0)
    for m in models.values():
        m.set_attn_implementation("sdpa")
    flops = {m: forward_flops(models[m], batch.inputs) for m in models}
    params = {m: count_parameters(models[m]) for m in models}
    tok_s = {f"{m} {c}": n_tokens / statistics.median(times[(m, c)]) for m, c in runs}
    res = {"model": args.model, "by_kv_group": args.by_kv_group, "length": args.length, "batch": args.batch,
           "tokens": n_tokens,
           "repeats": args.repeats, "threads": torch.get_num_threads(), "heads_removed": format_heads(heads),
           "n_removed": len(heads), "n_heads": shape[0] * shape[1], "params": params, "flops": flops,
           "flop_share_removed": 1 - flops["pruned"] / flops["full"],
           "param_share_removed": 1 - params["pruned"] / params["full"], "tokens_per_s": tok_s,
           "speedup": {c: tok_s[f"pruned {c}"] / tok_s[f"full {c}"] for c in CONFIGS},
           # the same round's two timings side by side: robust to load that drifts over the run
           "speedup_paired": {c: statistics.median(f / p for f, p in zip(times[("full", c)], times[("pruned", c)]))
                              for c in CONFIGS},
           "times_s": {f"{m} {c}": t for (m, c), t in times.items()}}
    print(f"{args.model}, L = {args.length}, B = {args.batch} ({n_tokens} real tokens), {res['threads']} threads, "
          f"medians of {args.repeats}; removed {len(heads)} of {res['n_heads']} heads")
    print(f"FLOPs of the plain forward: {flops['full'] / 1e9:.2f} G → {flops['pruned'] / 1e9:.2f} G "
          f"({res['flop_share_removed']:.1%} removed); parameters {params['full']:,} → {params['pruned']:,} "
          f"({res['param_share_removed']:.1%} removed)")
    print("| configuration | full tok/s | pruned tok/s | speed-up | per-round speed-up | FLOP share removed |")
    print("|---|---|---|---|---|---|")
    for c in CONFIGS:
        print(f"| {c} | {tok_s[f'full {c}']:,.0f} | {tok_s[f'pruned {c}']:,.0f} | {res['speedup'][c]:.2f}× | "
              f"{res['speedup_paired'][c]:.2f}× | {res['flop_share_removed']:.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
