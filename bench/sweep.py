"""Benchmark: the `heads` experiment of `attnkit ablate` (issue 19), cached and stacked against the plain loop.

    python bench/sweep.py --model minilm --pairs 80 --repeats 3
    python bench/sweep.py --model bert-base --pairs 40 --repeats 3 --json out.json

The task is STS-B (the first --pairs pairs of --data, default ../shared/data/stsb/dev.tsv): each sentence embedded by
mean pooling, the cosine of each pair against the gold score, Spearman ×100. Every head of the model, one at a time,
in mode zero (72 settings for the MiniLM, 144 for a 12-layer BERT-base with random weights and the MiniLM's
tokenizer), plus the baseline. Timed side by side in one process, in rounds whose order alternates, median of
--repeats rounds:

  intervene-loop   a plain Python loop of attnkit.intervene over the heads: tokenizer(..., padding=True) batches of
                   --batch-size, model, mean pooling, cosine, scipy's Spearman (what a user writes by hand)
  ablate-before    what `attnkit ablate --experiment heads` did before this change: one full evaluation per setting
                   (TaskEvaluator(sweep=False)) and its bootstrap, 1,000 resamples each scored by scipy's spearmanr
  plain-loop       run_settings with one full evaluation per setting and 10,000 vectorised resamples
  cached           the sweep: layers before a setting's first changed layer run once per batch, one setting per
                   forward (stack 1), 10,000 resamples
  cached+stacked   the sweep with settings stacked per forward (as many as ~1 GiB allows), 10,000 resamples

Numbers: the Spearman of every setting and every pair's cosine are compared between the configurations (the
report says whether they are bit for bit equal, else the largest difference).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

try:
    import attnkit  # noqa: F401
except ImportError:  # run from a source checkout: python bench/sweep.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = ("intervene-loop", "ablate-before", "plain-loop", "cached", "cached+stacked")
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "stsb", "dev.tsv")


def build(name: str):
    import attnkit

    model, tok = attnkit.load_model(device="cpu")
    if name == "bert-base":
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        model = attnkit.instrument(BertModel(BertConfig(vocab_size=tok.vocab_size)).eval(), tok)
    return model, tok


def intervene_loop(model, tok, task, settings, batch_size):
    """The loop a user writes: attnkit.intervene around a plain embedding of every sentence."""
    import attnkit
    from attnkit.ablation import metrics
    from attnkit.ablation.tasks import mean_pool

    ex = task.examples
    sentences = list(dict.fromkeys(s for a, b, _ in ex for s in (a, b)))
    where = {s: i for i, s in enumerate(sentences)}
    batches = [tok(sentences[i:i + batch_size], padding=True, truncation=True, max_length=128, return_tensors="pt")
               for i in range(0, len(sentences), batch_size)]
    gold = np.array([e[2] for e in ex])
    out = []
    for s in settings:
        with attnkit.intervene(model, s.intervention), torch.inference_mode():
            emb = torch.cat([mean_pool(model(**b)[0], b["attention_mask"]) for b in batches])
        cos = torch.nn.functional.cosine_similarity(emb[[where[e[0]] for e in ex]], emb[[where[e[1]] for e in ex]],
                                                    dim=-1).numpy()
        out.append((metrics.spearman(cos, gold), cos.astype(np.float64)))
    return out


def ablate_before(model, tok, task, settings, batch_size):
    """The former ablate: a full evaluation per setting, then 1,000 resamples each scored by scipy's spearmanr."""
    from attnkit.ablation import TaskEvaluator, metrics

    evaluate = TaskEvaluator(task, model, tok, batch_size=batch_size, sweep=False)
    draws = np.random.default_rng(0).integers(0, len(task), size=(1000, len(task)))
    out = []
    for s in settings:
        m = evaluate(s.intervention)
        a = evaluate.last_examples.arrays
        _ = [metrics.spearman(a["pred"][i], a["gold"][i]) for i in draws]
        out.append((m["spearman"], a["pred"]))
    return out


def ablate_now(model, tok, task, settings, batch_size, sweep, stack):
    from attnkit.ablation import TaskEvaluator, run_settings

    evaluate = TaskEvaluator(task, model, tok, batch_size=batch_size, sweep=sweep, stack=stack)
    table = run_settings("heads", settings, evaluate, "spearman", progress=False)
    return [(r["spearman"], ex.arrays["pred"]) for r, ex in zip(table.rows, table.examples)]


def run(config, model, tok, task, settings, batch_size):
    if config == "intervene-loop":
        return intervene_loop(model, tok, task, settings, batch_size)
    if config == "ablate-before":
        return ablate_before(model, tok, task, settings, batch_size)
    return ablate_now(model, tok, task, settings, batch_size, sweep=config != "plain-loop",
                      stack=1 if config == "cached" else None)


def difference(a, b) -> dict:
    rho = max(abs(x[0] - y[0]) for x, y in zip(a, b))
    cos = max(float(np.abs(x[1] - y[1]).max()) for x, y in zip(a, b))
    return {"identical": rho == 0 and cos == 0, "max_spearman_diff": rho, "max_cosine_diff": cos}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("minilm", "bert-base"), default="minilm")
    p.add_argument("--data", default=DATA)
    p.add_argument("--pairs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from attnkit.ablation import get_task
    from attnkit.ablation.experiments import heads_settings

    configs = args.configs.split(",")
    model, tok = build(args.model)
    task = get_task("stsb", args.data).head(args.pairs)
    shape = (model.config.num_hidden_layers, model.config.num_attention_heads)
    settings = heads_settings(shape, "zero")
    print(f"{args.model}: {len(settings) - 1} heads + baseline, {args.pairs} STS-B pairs, batch {args.batch_size}, "
          f"{torch.get_num_threads()} threads", flush=True)
    times = {c: [] for c in configs}
    results = {}
    for r in range(args.repeats):
        for c in (configs if r % 2 == 0 else configs[::-1]):
            t0 = time.perf_counter()
            results[c] = run(c, model, tok, task, settings, args.batch_size)
            times[c].append(time.perf_counter() - t0)
            print(f"  round {r + 1}: {c:15s} {times[c][-1]:8.1f} s", flush=True)
    ref = configs[0]
    rows = []
    for c in configs:
        med = statistics.median(times[c])
        row = {"config": c, "median_s": med, "times_s": times[c], "vs_" + ref: med / statistics.median(times[ref])}
        if c != ref:
            row["numbers_vs_" + ref] = difference(results[c], results[ref])
        if "plain-loop" in results and c != "plain-loop":
            row["numbers_vs_plain-loop"] = difference(results[c], results["plain-loop"])
        rows.append(row)
    print(f"\n| config | median s | × {ref} | numbers vs plain-loop |")
    print("|---|---|---|---|")
    for row in rows:
        d = row.get("numbers_vs_plain-loop")
        same = "—" if d is None else ("identical" if d["identical"] else
                                      f"max Δρ {d['max_spearman_diff']:.2e}, max Δcos {d['max_cosine_diff']:.2e}")
        print(f"| {row['config']} | {row['median_s']:.1f} | {row['vs_' + ref]:.2f} | {same} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
