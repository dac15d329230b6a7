"""Synthetic data for the tests: HeadFeatures with known head types (no model, no corpus), a tiny
random-weight BERT with a WordPiece tokenizer built in code, and tiny random encoders of each supported
architecture with padded inputs."""
from __future__ import annotations

import numpy as np

from attnkit.features import feature_names
from attnkit.run import HeadFeatures

N_WIN = 16


def prototype(kind: str) -> np.ndarray:
    """A 21-bucket distance profile (cls, sep, comma, period, self, win_0..win_15) summing to 1."""
    win_uniform = np.array([2.0 * (N_WIN - w) - 1 for w in range(N_WIN)])  # pairs per window, uniform attention
    win_uniform /= win_uniform.sum()
    near = np.zeros(N_WIN)
    near[0], near[1] = 0.8, 0.2
    if kind == "vertical":
        special, self_, win = np.array([0.15, 0.65, 0.03, 0.05]), 0.01, win_uniform
    elif kind == "diagonal":
        special, self_, win = np.array([0.05, 0.10, 0.02, 0.03]), 0.15, near
    elif kind == "dense+vertical":
        special, self_, win = np.array([0.10, 0.30, 0.02, 0.03]), 0.02, win_uniform
    elif kind == "dense":
        special, self_, win = np.array([0.03, 0.05, 0.02, 0.02]), 0.03, win_uniform
    else:
        raise ValueError(kind)
    rest = 1.0 - special.sum() - self_
    return np.concatenate([special, [self_], rest * win])


KINDS = ("vertical", "diagonal", "dense+vertical", "dense")


def make_features(truth: np.ndarray, *, noise: float = 0.01, seed: int = 0, structureless: bool = False) -> HeadFeatures:
    """HeadFeatures whose buckets follow the prototypes given by `truth` (layers × heads of kind ids),
    plus small noise; the remaining 7 features are filled consistently (prev/next/entropy...).
    `structureless`: every head is the mean profile plus isotropic noise (no clusters)."""
    rng = np.random.default_rng(seed)
    L, H = truth.shape
    names = feature_names(N_WIN)
    F = len(names)
    mean = np.zeros((L, H, F))
    protos = np.stack([prototype(k) for k in KINDS])
    for l in range(L):
        for h in range(H):
            base = protos.mean(0) if structureless else protos[truth[l, h]]
            v = np.abs(base + rng.normal(0.0, noise, size=base.shape))
            v /= v.sum()
            mean[l, h, :21] = v
            mean[l, h, 21] = mean[l, h, 22] = v[5] / 2  # prev, next
            mean[l, h, 23] = -np.sum(v * np.log(v))  # entropy of the bucket profile (a stand-in)
            mean[l, h, 24] = v.max()
            mean[l, h, 25], mean[l, h, 26] = 0.7, 0.3  # intra, inter
            mean[l, h, 27] = mean[l, h, 23]
    return HeadFeatures(mean, np.full_like(mean, 0.01), names, n_samples=100, n_tokens=3000,
                        meta={"model": "synthetic", "num_windows": N_WIN})


def layered_truth(L: int = 6, H: int = 12, seed: int = 0) -> np.ndarray:
    """Kind ids per head: dense early, dense+vertical in the middle, vertical late, diagonal everywhere."""
    rng = np.random.default_rng(seed)
    t = np.zeros((L, H), dtype=int)
    for l in range(L):
        p = np.array([l / L, 0.25, 1 - abs(l - L / 2) / L, 1 - l / L]) + 0.05
        t[l] = rng.choice(4, size=H, p=p / p.sum())
    return t


WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "a", "big", "red", "house", "is", "here", "and", "then"]


def tiny_bert(n_layers: int = 2, n_heads: int = 2, seed: int = 0):
    """A random-weight BERT (n_layers × n_heads, hidden 16) with sharp attention, and a fast WordPiece tokenizer
    over WORDS, built in code."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ",", ".", "!", "?"] + WORDS
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                     intermediate_size=32, max_position_embeddings=64, attn_implementation="eager")
    model = BertModel(cfg).eval()
    with torch.no_grad():  # sharper attention than the default init, so heads differ
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(8.0)
            layer.attention.self.key.weight.mul_(8.0)
    return model, tok


ENCODER_KINDS = ("bert", "roberta", "electra", "distilbert")


def tiny_config(n_layers: int = 2, vocab: int = 120) -> dict:
    """BertConfig-style sizes of the tiny random encoders: hidden 32, 4 heads, `n_layers` layers."""
    return dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=64)


def tiny_encoder(kind: str, n_layers: int = 2, vocab: int = 120):
    """A random-weight encoder of `kind` (one of ENCODER_KINDS, seed 0) with tiny_config's sizes, in eval mode."""
    import torch
    from transformers import (
        BertConfig,
        BertModel,
        DistilBertConfig,
        DistilBertModel,
        ElectraConfig,
        ElectraModel,
        RobertaConfig,
        RobertaModel,
    )

    torch.manual_seed(0)
    cfg = tiny_config(n_layers, vocab)
    if kind == "bert":
        model = BertModel(BertConfig(**cfg))
    elif kind == "roberta":
        model = RobertaModel(RobertaConfig(**cfg, pad_token_id=1))
    elif kind == "electra":
        model = ElectraModel(ElectraConfig(**cfg, embedding_size=16))
    elif kind == "distilbert":
        model = DistilBertModel(DistilBertConfig(vocab_size=vocab, dim=32, n_layers=n_layers, n_heads=4, hidden_dim=64,
                                                 max_position_embeddings=64))
    else:
        raise ValueError(kind)
    return model.eval()


def padded_inputs(vocab: int, lengths, pair: bool = False) -> dict:
    """Random ids (seed 1, ids ≥ 5) for samples of `lengths` tokens padded with 0 to the longest, their attention
    mask, and with `pair` token_type_ids of a text pair whose segment B starts at position 4."""
    import torch

    g = torch.Generator().manual_seed(1)
    L = max(lengths)
    ids = torch.randint(5, vocab, (len(lengths), L), generator=g)
    mask = (torch.arange(L)[None] < torch.tensor(lengths)[:, None]).long()
    out = {"input_ids": ids * mask, "attention_mask": mask}
    if pair:
        out["token_type_ids"] = (torch.arange(L)[None] >= 4).long() * mask
    return out


def mean_scores(values):
    """Per-example scores whose metric is 100 × their mean (attnkit.ablation.metrics.ExampleScores)."""
    from attnkit.ablation.metrics import ExampleScores, weighted_mean

    return ExampleScores({"v": np.asarray(values, dtype=float)}, lambda a, w: 100.0 * weighted_mean(a["v"], w))


def rich_run(path, *, L: int = 3, H: int = 4, n_samples: int = 30, seed: int = 3):
    """A run directory with everything the report can show, made without a model: features, per-sample features
    with their rows table, distances, clusters, pattern classes, a syntax probe (probe.csv/json) and a `heads`
    ablation table. Returns (features, per-sample array, texts, distances matrix)."""
    import csv
    import json
    from pathlib import Path

    from attnkit.analysis.clustering import cluster
    from attnkit.analysis.patterns import run_patterns
    from attnkit.analysis.results import save_clusters
    from attnkit.run.distances import HeadDistances
    from attnkit.run.per_sample import PerSampleWriter

    path = Path(path)
    rng = np.random.default_rng(seed)
    truth = np.arange(L * H).reshape(L, H) % len(KINDS)
    f = make_features(truth, seed=seed)
    F = len(f.names)
    per = np.clip(f.mean[None] + rng.normal(0, 0.05, (n_samples, L, H, F)), 0, None).astype(np.float32)
    f.n_samples = n_samples  # the run measured the samples its per-sample file holds: their mean is its mean
    f.mean = per.astype(np.float64).mean(0)
    f.save(path)
    texts = [f"Sample {i}: the {WORDS[i % len(WORDS)]} and the {WORDS[(3 * i) % len(WORDS)]}." for i in range(n_samples)]
    w = PerSampleWriter(path, L, H, f.names)
    order = rng.permutation(n_samples)
    w.add(order, per[order], [texts[i] for i in order])
    w.close()
    X = f.mean[:, :, :21].reshape(-1, 21)
    dist = np.abs(X[:, None] - X[None]).sum(-1) * 100
    HeadDistances(dist, 1000, L, H).save(path)
    save_clusters(path, cluster(f, k=4, n_stability=3), f)
    run_patterns(path, svg=False)
    rows = []
    for rel, base in (("nsubj", 0.4), ("det", 0.6), ("(all)", 0.3)):
        for l in range(L):
            for h in range(H):
                for d in ("dep->head", "dep<-head"):
                    acc = float(rng.random())
                    rows.append({"relation": rel, "layer": l, "head": h, "direction": d, "correct": int(acc * 50),
                                 "count": 50, "accuracy": acc, "baseline_offset": -1, "baseline_accuracy": base})
    with open(path / "probe.csv", "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    (path / "probe.json").write_text(json.dumps({"model": "synthetic", "layers": L, "heads": H,
                                                 "settings": {"min_count": 10}, "relations": {}}))
    arows = [{"setting": "baseline", "layer": None, "head": None, "spearman": 80.0}]
    for l in range(L):
        for h in range(H):
            d = float(rng.normal(-0.5, 0.5))
            arows.append({"setting": f"L{l}H{h} zero", "layer": l, "head": h, "spearman": 80 + d,
                          "delta_spearman": d, "delta_spearman_lo": d - 0.3, "delta_spearman_hi": d + 0.3})
    (path / "heads.json").write_text(json.dumps({"experiment": "heads", "main_metric": "spearman", "rows": arows}))
    (path / "heads.meta.json").write_text(json.dumps({"experiment": "heads", "model": "synthetic", "task": "stsb"}))
    return f, per, texts, dist


def pruned_run(path, removed=((1, 0), (1, 1), (1, 2), (1, 3), (2, 3)), **kwargs):
    """`rich_run` as a pruned model's run would be (docs/pruning.md): the `removed` heads (default: all of layer 1
    and L2H3) have NaN features in features.npz and per_sample.npy, and meta.json lists them as removed_heads.
    clusters.json is the one clustered before (every head labelled). Returns rich_run's tuple with the NaNs."""
    import json
    from pathlib import Path

    path = Path(path)
    f, per, texts, dist = rich_run(path, **kwargs)
    for l, h in removed:
        f.mean[l, h] = np.nan
        f.std[l, h] = np.nan
        per[:, l, h] = np.nan
    np.savez(path / "features.npz", mean=f.mean, std=f.std, names=np.array(f.names))
    arr = np.load(path / "per_sample.npy", mmap_mode="r+")
    arr[:] = per
    arr.flush()
    del arr
    meta = json.loads((path / "meta.json").read_text())
    meta["removed_heads"] = [list(x) for x in removed]
    (path / "meta.json").write_text(json.dumps(meta))
    f.meta = meta
    return f, per, texts, dist
