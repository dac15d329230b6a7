"""Benchmark: greedy generation with the KV cache on the embedded decoder SmolLM2-135M-Instruct (issue 35;
docs/decoders.md, "Generation with a KV cache").

    python bench/generate.py                          # 64 new tokens, 5 interleaved rounds
    python bench/generate.py --new-tokens 64 --rounds 7 --json generate.json

In one process, on the CPU with `--threads` threads (default 2), batch 1, fp32, the same prompt:
  sdpa      transformers' sdpa attention, `generate` with its default cache
  attnkit   the instrumented model (attn_implementation="attnkit"), `generate` with its default cache; the backend
            attnkit picks (`--backend`)
Each round times one `generate` of each configuration, in alternating order (sdpa first in even rounds, attnkit
first in odd ones), after one warm-up generate each. Reported per round: wall seconds (time.perf_counter) and CPU
seconds of the process (time.process_time: every thread), and the attnkit / sdpa ratios; then the medians of the
per-round ratios. The tokens of both are checked against eager attention's (the same greedy search, once).
`min_new_tokens` = `max_new_tokens`, so every configuration generates exactly `--new-tokens` tokens. The machine's
`uptime` load is printed before and after: on a shared machine only the interleaved ratios mean anything.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# the checkout this file is in, before an installed attnkit
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = ("The capital of France is Paris. The capital of Germany is Berlin. Rivers bend, and lakes form where the "
          "bend is cut off from the stream. A bridge is a promise made in steel, stone and patience.")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime unavailable"


def timed(model, enc, kw) -> tuple[float, float, object]:
    import torch

    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(**enc, **kw)
    return time.perf_counter() - t0, time.process_time() - c0, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="auto", choices=("auto", "fused", "reference"))
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import attnkit
    from attnkit.embedded import embedded_path
    from attnkit.models import runtime_of

    torch.set_num_threads(args.threads)
    path = str(embedded_path("smollm2"))
    ours, tok = attnkit.load_model("smollm2", task="causal-lm", device="cpu")
    runtime_of(ours).backend = args.backend
    sdpa = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    enc = tok(PROMPT, return_tensors="pt")
    n = args.new_tokens
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)

    print(f"prompt {enc['input_ids'].shape[1]} tokens, {n} new, {args.threads} threads, attnkit backend "
          f"{args.backend} ({attnkit.backend_info()}, CPU kernel takes decode steps: "
          f"{attnkit.ops.fused_fewer_queries('cpu')})")
    print("load before:", uptime())
    _, _, want = timed(eager, enc, kw)
    del eager
    configs = {"sdpa": sdpa, "attnkit": ours}
    same = {}
    for name, model in configs.items():  # warm-up, and the tokens against eager's
        _, _, out = timed(model, enc, kw)
        same[name] = bool(torch.equal(out, want))
    rounds = []
    for r in range(args.rounds):
        order = ["sdpa", "attnkit"] if r % 2 == 0 else ["attnkit", "sdpa"]
        row = {}
        for name in order:
            wall, cpu, out = timed(configs[name], enc, kw)
            same[name] = same[name] and bool(torch.equal(out, want))
            row[name] = {"wall_s": wall, "cpu_s": cpu}
        row["wall_ratio"] = row["attnkit"]["wall_s"] / row["sdpa"]["wall_s"]
        row["cpu_ratio"] = row["attnkit"]["cpu_s"] / row["sdpa"]["cpu_s"]
        rounds.append(row)
        print(f"round {r}: sdpa {row['sdpa']['wall_s']:.2f} s wall / {row['sdpa']['cpu_s']:.2f} s CPU, attnkit "
              f"{row['attnkit']['wall_s']:.2f} s / {row['attnkit']['cpu_s']:.2f} s: ratio {row['wall_ratio']:.3f} "
              f"wall, {row['cpu_ratio']:.3f} CPU")
    load_after = uptime()
    print("load after:", load_after)
    summary = {
        "new_tokens": n, "threads": args.threads, "backend": args.backend, "rounds": rounds,
        "median_wall_ratio": statistics.median(r["wall_ratio"] for r in rounds),
        "median_cpu_ratio": statistics.median(r["cpu_ratio"] for r in rounds),
        "same_tokens_as_eager": same, "load_after": load_after,
    }
    print(f"median attnkit / sdpa: {summary['median_wall_ratio']:.3f} wall, {summary['median_cpu_ratio']:.3f} CPU "
          f"(target <= 1.2); tokens equal eager's: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
