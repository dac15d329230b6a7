"""Real-data run for the analysis note: MiniLM features + JS distances on STS-B dev and SQuAD 2.0 sample.

    python tools/analysis_real_run.py OUTDIR [N]

Writes OUTDIR/stsb and OUTDIR/squad run directories (features.npz, meta.json, distances.npz).
"""
import csv
import json
import sys
import time
from pathlib import Path

import attnkit
from attnkit.analysis import collect_distances

DATA = Path("/work/shared/data")


def stsb(n):
    with open(DATA / "stsb/dev.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [(r["sentence1"], r["sentence2"]) for r in rows[:n]]


def squad(n):
    d = json.load(open(DATA / "squad2-wiki-sample/dev-sample.json"))
    out = [(qa["question"], p["context"]) for art in d["data"] for p in art["paragraphs"] for qa in p["qas"]]
    return out[:n]


def main():
    out = Path(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    model = attnkit.load_model(device="cpu")
    for name, texts in (("stsb", stsb(n)), ("squad", squad(n))):
        t0 = time.perf_counter()
        feats, dist = collect_distances(texts, model, backend="reference", max_length=128, batch_size=16)
        feats.meta["corpus"] = name
        feats.save(out / name)
        dist.save(out / name)
        print(f"{name}: {feats.n_samples} samples, {feats.n_tokens} tokens, {dist.n_rows} rows, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
