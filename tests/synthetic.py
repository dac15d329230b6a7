"""Synthetic data for the tests: HeadFeatures with known head types (no model, no corpus), a tiny
random-weight BERT with a WordPiece tokenizer built in code, and tiny random encoders of each supported
architecture with padded inputs."""
from __future__ import annotations

import math

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
    elif kind == "vertical+dense":  # Guan et al.'s dense+vertical: more weight on [SEP] than spread out
        special, self_, win = np.array([0.10, 0.30, 0.02, 0.03]), 0.02, win_uniform
    elif kind == "dense":
        special, self_, win = np.array([0.03, 0.05, 0.02, 0.02]), 0.03, win_uniform
    else:
        raise ValueError(kind)
    rest = 1.0 - special.sum() - self_
    return np.concatenate([special, [self_], rest * win])


KINDS = ("vertical", "diagonal", "vertical+dense", "dense")  # the names attnkit gives these prototypes


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
    """Kind ids per head: dense early, vertical+dense in the middle, vertical late, diagonal everywhere."""
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


# the encoder families attnkit names (README, attnkit/arch/architectures.py); XLM-R and CamemBERT run RoBERTa's code
ENCODER_KINDS = ("bert", "roberta", "electra", "distilbert", "xlm-roberta", "camembert", "modernbert")


def tiny_config(n_layers: int = 2, vocab: int = 120) -> dict:
    """BertConfig-style sizes of the tiny random encoders: hidden 32, 4 heads, `n_layers` layers."""
    return dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=64)


def tiny_encoder(kind: str, n_layers: int = 2, vocab: int = 120):
    """A random-weight encoder of `kind` (one of ENCODER_KINDS, seed 0) with tiny_config's sizes, in eval mode.
    ModernBERT: global attention on layers 0, 2, …, local attention on the others with `local_attention` 4, i.e. the
    bidirectional window |s − t| ≤ 2 (transformers passes sliding_window = 3 to the attention function)."""
    import torch
    from transformers import (
        BertConfig,
        BertModel,
        CamembertConfig,
        CamembertModel,
        DistilBertConfig,
        DistilBertModel,
        ElectraConfig,
        ElectraModel,
        ModernBertConfig,
        ModernBertModel,
        RobertaConfig,
        RobertaModel,
        XLMRobertaConfig,
        XLMRobertaModel,
    )

    torch.manual_seed(0)
    cfg = tiny_config(n_layers, vocab)
    if kind == "bert":
        model = BertModel(BertConfig(**cfg))
    elif kind == "roberta":
        model = RobertaModel(RobertaConfig(**cfg, pad_token_id=1))
    elif kind == "xlm-roberta":
        model = XLMRobertaModel(XLMRobertaConfig(**cfg, pad_token_id=1))
    elif kind == "camembert":
        model = CamembertModel(CamembertConfig(**cfg, pad_token_id=1))
    elif kind == "electra":
        model = ElectraModel(ElectraConfig(**cfg, embedding_size=16))
    elif kind == "distilbert":
        model = DistilBertModel(DistilBertConfig(vocab_size=vocab, dim=32, n_layers=n_layers, n_heads=4, hidden_dim=64,
                                                 max_position_embeddings=64))
    elif kind == "modernbert":
        model = ModernBertModel(ModernBertConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
            max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=2, pad_token_id=0,
            bos_token_id=None, eos_token_id=None, cls_token_id=None, sep_token_id=None))
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


def features_from_maps(attn, lengths, classes, sentences, num_windows, sink: bool = False, first_row: int = 0):
    """docs/features.md's features of every sample from full attention maps (per layer B × H × L × L, each
    sample's tokens first), written independently of attnkit.reference: samples × layers × heads × features.
    Keys a causal row does not see have weight 0 in the maps, so the same sums give the features of causal rows.
    `sink`: one more feature, the mass a row's keys leave (1 − the row's sum), averaged over the rows. `first_row`:
    only the rows from that position on count (the query rows of a KV-cache step; a sample without one: 0)."""
    L_, H = len(attn), attn[0].shape[1]
    out = []
    for b, n in enumerate(lengths):
        per = np.zeros((L_, H, 5 + num_windows + 7 + int(sink)))
        cls_of = classes[b][:n]
        sent = sentences[b][:n]
        for layer in range(L_):
            for h in range(H):
                A = attn[layer][b, h, :n, :n].astype(np.float64)
                rows = []
                if first_row >= n:
                    continue
                for s in range(first_row, n):
                    r = np.zeros(5 + num_windows + 6)
                    for t in range(n):
                        c = cls_of[t]
                        if c in (1, 2, 3, 4):
                            r[c - 1] += A[s, t]
                        elif t == s:
                            r[4] += A[s, t]
                        else:
                            r[5 + abs(s - t) * num_windows // n] += A[s, t]
                    k = 5 + num_windows
                    r[k] = A[s, s - 1] if s > 0 else 0
                    r[k + 1] = A[s, s + 1] if s + 1 < n else 0
                    p = A[s][A[s] > 0]
                    r[k + 2] = -(p * np.log(p)).sum()
                    r[k + 3] = A[s].max()
                    same = sent == sent[s]
                    r[k + 4] = A[s][same].sum()
                    r[k + 5] = A[s][~same].sum()
                    rows.append(r)
                rows = np.array(rows)
                cls_rows = [s - first_row for s in range(first_row, n) if cls_of[s] == 1]
                cls_ent = rows[cls_rows, 5 + num_windows + 2].mean() if cls_rows else 0.0
                extra = [1.0 - A[first_row:].sum(1).mean()] if sink else []
                per[layer, h] = np.concatenate([rows.mean(0), [cls_ent], extra])
        out.append(per)
    return np.array(out)


DECODER_KINDS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "gpt2", "gpt_neox", "phi3", "gpt_oss",
                 "olmo2")


def tiny_decoder(kind: str, vocab: int = 120, n_layers: int = 2, window: int = 5, seed: int = 0):
    """A random-weight causal LM of `kind` (one of DECODER_KINDS) built offline from `AutoConfig.for_model`: hidden
    32, 4 query heads (2 KV heads where the architecture has grouped-query attention), head size 8, eager
    attention, in eval mode. Sliding windows of `window` tokens where the architecture has them (Mistral, Qwen2's
    upper layers, Gemma 2/3's local layers, gpt-oss), a soft cap of 2 (Gemma 2), random sink logits (gpt-oss), and
    queries sharpened so that heads differ. BOS 1, EOS 2, padding 0."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128, **ids)
    extra = {
        "llama": {}, "qwen3": {}, "phi3": {}, "olmo2": {},
        "qwen2": dict(use_sliding_window=True, sliding_window=window, max_window_layers=1),
        "mistral": dict(sliding_window=window),
        "gemma2": dict(sliding_window=window, attn_logit_softcapping=2.0, query_pre_attn_scalar=8),
        "gemma3_text": dict(sliding_window=window, query_pre_attn_scalar=8,
                            layer_types=["sliding_attention", "full_attention"] * (n_layers // 2)
                            + ["sliding_attention"] * (n_layers % 2)),
        "gpt_oss": dict(sliding_window=window, num_local_experts=2, num_experts_per_tok=1),
    }
    if kind == "gpt2":
        cfg = AutoConfig.for_model("gpt2", vocab_size=vocab, n_embd=32, n_layer=n_layers, n_head=4, n_positions=128,
                                   **ids)
    elif kind == "gpt_neox":
        cfg = AutoConfig.for_model("gpt_neox", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=n_layers, num_attention_heads=4, max_position_embeddings=128,
                                   **ids)
    else:
        cfg = AutoConfig.for_model(kind, **common, **extra[kind])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "c_attn.weight", "query_key_value.weight", "qkv_proj.weight")):
                p.mul_(4.0)
            elif name.endswith(".sinks"):
                p.copy_(torch.randn_like(p))
    return model


class CallCounter:
    """A consumer (attnkit/attention/consumers/base.py's protocol) that counts the calls of attnkit attention an
    instrumented model plans (every call outside training with attention dropout) and takes part in none:
    `with runtime_of(model).attached(CallCounter()) as counter: ...; counter.calls`."""

    role = "call counter"
    in_training = False

    def __init__(self):
        self.calls = 0

    def wants(self, call):
        self.calls += 1
        return None

    def before(self, call):
        return None

    def after(self, call, result):
        return None


def cross_features_from_maps(p, q_lengths, k_lengths, q_classes, k_classes, nw):
    """docs/features.md's features of cross-attention maps (B × H × Lq × Lk, each sequence's tokens first), by loops,
    written independently of attnkit.reference: B × H × features. Row i is position i, valid when i < n; the keys
    t < nk of classes k_classes; self t == i; window min(N − 1, |i − t|·N // nk); intra the row's mass, inter 0; the
    CLS rows (cls_entropy) by the queries' classes."""
    Bn, Hn = p.shape[:2]
    out = np.zeros((Bn, Hn, 5 + nw + 7))
    for b in range(Bn):
        n, nk = int(q_lengths[b]), int(k_lengths[b])
        for h in range(Hn):
            rows, cls_ent = [], []
            for i in range(n):
                A = np.asarray(p[b, h, i, :nk], dtype=np.float64)
                r = np.zeros(5 + nw + 6)
                for t in range(nk):
                    c = int(k_classes[b][t])
                    if c in (1, 2, 3, 4):
                        r[c - 1] += A[t]
                    elif t == i:
                        r[4] += A[t]
                    else:
                        r[5 + min(nw - 1, abs(i - t) * nw // nk)] += A[t]
                f = 5 + nw
                r[f] = A[i - 1] if 0 <= i - 1 < nk else 0.0
                r[f + 1] = A[i + 1] if i + 1 < nk else 0.0
                pos = A[A > 0]
                r[f + 2] = -(pos * np.log(pos)).sum()
                r[f + 3] = A.max()
                r[f + 4] = A.sum()
                rows.append(r)
                if int(q_classes[b][i]) == 1:
                    cls_ent.append(r[f + 2])
            out[b, h] = np.concatenate([np.mean(rows, 0), [np.mean(cls_ent) if cls_ent else 0.0]])
    return out


SEQ2SEQ_KINDS = ("bart", "marian", "t5", "whisper")


def alignment_from_maps(p, q_lengths, k_lengths=None, first_row=None):
    """docs/features.md's alignment features (align_offset, align_near) of B × H × Lq × Lk maps, by loops, written
    independently of attnkit.reference: B × H × 2 means over the valid rows. Self-attention (`k_lengths` None): row i
    is position s = first_row + i (default Lk − Lq), valid when s < n, aligned with itself; cross-attention: row i < n
    aligned with i·(nk − 1)/(n − 1) (0 when n = 1), keys t < nk."""
    Bn, Hn, Lq, Lk = p.shape
    first = Lk - Lq if first_row is None else first_row
    out = np.zeros((Bn, Hn, 2))
    for b in range(Bn):
        n = int(q_lengths[b])
        nk = n if k_lengths is None else int(k_lengths[b])
        rows = range(n) if k_lengths is not None else range(max(0, n - first))
        for h in range(Hn):
            acc, count = np.zeros(2), 0
            for i in rows:
                if k_lengths is None:
                    pos = float(first + i)
                else:
                    pos = i * (nk - 1) / (n - 1) if n > 1 else 0.0
                near = math.floor(pos + 0.5)
                for t in range(nk):
                    w = float(p[b, h, i, t])
                    acc[0] += w * abs(t - pos)
                    acc[1] += w if abs(t - near) <= 1 else 0.0
                count += 1
            out[b, h] = acc / max(count, 1)
    return out


def tiny_seq2seq(kind: str, vocab: int = 120, n_layers: int = 2, seed: int = 0):
    """A random-weight encoder–decoder of `kind` (one of SEQ2SEQ_KINDS) with its language-model head, built offline:
    hidden 32, 4 heads of size 8 in every layer, `n_layers` encoder and decoder layers, eager attention, eval mode,
    queries sharpened so that heads differ. Padding 0, EOS 2 (T5: 1); Whisper takes 8 mel bins × 16 frames (an
    encoder of 8 positions)."""
    import torch
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    layers = dict(encoder_layers=n_layers, decoder_layers=n_layers, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32)
    if kind == "t5":
        cfg = AutoConfig.for_model("t5", vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=n_layers,
                                   num_decoder_layers=n_layers, num_heads=4, relative_attention_num_buckets=8,
                                   relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0)
    elif kind == "whisper":
        cfg = AutoConfig.for_model("whisper", vocab_size=vocab, num_mel_bins=8, max_source_positions=8,
                                   max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                   decoder_start_token_id=1, **layers)
    else:
        cfg = AutoConfig.for_model(kind, vocab_size=vocab, max_position_embeddings=64, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, **layers)
    torch.manual_seed(seed)
    auto = AutoModelForSpeechSeq2Seq if kind == "whisper" else AutoModelForSeq2SeqLM
    model = auto.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", ".q.weight")):
                p.mul_(4.0)
    return model
