"""The data behind the report's per-head panel (report.js reads it): every head's features with their spread,
its type, its nearest heads, its top and bottom examples from per_sample.npy with their texts, its example maps,
and what the probe, the pattern classes, the ablations and detect-heads say about it (attnkit/analysis/attached.py).
"""
from __future__ import annotations

import base64
import csv
import itertools
import math
from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from ..run.files import PER_SAMPLE_ROWS
from ..run.schemas import LOWER_IS_BETTER
from .attached import Attached
from .clustering import head_matrix
from .naming import short_names

EXAMPLE_FEATURES = ("cls", "sep", "prev", "next", "self", "entropy", "intra")
N_EXAMPLES = 3  # top and bottom examples per head and feature
N_NEAR = 5
TEXT_CHARS = 300


def _rounded(a, digits: int = 5) -> list:
    a = np.round(np.asarray(a, dtype=np.float64), digits)
    return np.where(np.isfinite(a), a, None).tolist()


def _ranked(rows, values) -> list:
    """[[row, value], ...] of the samples whose value is a number (a removed head's NaN values have no rank)."""
    return [[int(r), round(float(v), 5)] for r, v in zip(rows, values) if np.isfinite(v)]


def nearest(D: np.ndarray, n: int = N_NEAR, removed=None) -> list:
    """For each head, the `n` others nearest by the M × M dissimilarities `D`: [[head, value], ...]; `removed` (M
    booleans): heads that are nobody's neighbour and have none. An infinite (or NaN) dissimilarity pairs no heads: a
    head has fewer neighbours, or none, when fewer others are compared with it."""
    D = np.array(D, dtype=np.float64)
    gone = np.zeros(len(D), dtype=bool) if removed is None else np.asarray(removed, dtype=bool).ravel()
    D[:, gone] = np.inf
    D[~np.isfinite(D)] = np.inf
    np.fill_diagonal(D, np.inf)
    n = min(n, int((~gone).sum()) - 1)
    order = np.argsort(D, axis=1, kind="stable")[:, :max(n, 0)]
    return [[] if gone[i] else [[int(j), round(float(D[i, j]), 6)] for j in row if np.isfinite(D[i, j])]
            for i, row in enumerate(order)]


def feature_scales(features) -> list[dict]:
    """How the panel's bar shows each feature: shares of the weight (buckets, prev, intra, max, ...) on 0..1;
    entropies (nats) against ln n, the entropy of uniform attention over the run's mean tokens per sample (or, when
    the run records no tokens, the largest value over the heads). [{"kind": "share" | "nats", "max": ...}]"""
    L, H, _ = features.mean.shape
    n = features.n_tokens / features.n_samples if features.n_samples > 0 and features.n_tokens > 0 else 0.0
    out = []
    for j, name in enumerate(features.names):
        if "entropy" in name:
            col = np.asarray(features.mean[..., j], dtype=np.float64)
            top = math.log(n) if n > 1 else (float(np.nanmax(col)) if np.isfinite(col).any() else 1.0)
            out.append({"kind": "nats", "max": round(max(top, 1e-9), 5)})
        else:
            out.append({"kind": "share", "max": 1.0})
    return out


def extremes(per_sample, names, features=EXAMPLE_FEATURES, k: int = N_EXAMPLES, chunk: int = 4096) -> dict:
    """Per feature, per head: the rows of the `k` samples with the highest and with the lowest value, streamed
    over `per_sample` (N × L × H × F, e.g. memory-mapped) `chunk` samples at a time. {feature: {"top": M × k rows,
    "top_values", "bottom", "bottom_values"}} (float32 comparisons; ties: the earlier row)."""
    feats = [f for f in features if f in names]
    idx = [list(names).index(f) for f in feats]
    N, L, H, _ = per_sample.shape
    M = L * H
    k = min(k, N)
    best = {s: (np.full((len(feats), M, 0), np.nan, dtype=np.float32), np.zeros((len(feats), M, 0), dtype=np.int64))
            for s in ("top", "bottom")}
    for i in range(0, N, chunk):
        x = np.asarray(per_sample[i:i + chunk][..., idx], dtype=np.float32)  # c × L × H × f
        c = x.shape[0]
        vals = x.reshape(c, M, len(feats)).transpose(2, 1, 0)  # f × M × c
        rows = np.broadcast_to(np.arange(i, i + c), vals.shape)
        for side, sign in (("top", -1.0), ("bottom", 1.0)):
            v = np.concatenate([best[side][0], vals], axis=-1)
            r = np.concatenate([best[side][1], rows], axis=-1)
            key = np.where(np.isnan(v), np.inf, sign * v)
            order = np.lexsort((r, key), axis=-1)[..., :k]  # by value, then by row
            best[side] = (np.take_along_axis(v, order, -1), np.take_along_axis(r, order, -1))
    return {f: {"top": best["top"][1][j], "top_values": best["top"][0][j], "bottom": best["bottom"][1][j],
                "bottom_values": best["bottom"][0][j]} for j, f in enumerate(feats)}


def _text_of(text: str, pair: str | None) -> str:
    t = text if not pair else f"{text} ||| {pair}"
    return t if len(t) <= TEXT_CHARS else t[:TEXT_CHARS - 1] + "…"


def unverifiable_corpus(meta: dict) -> str | None:
    """Why the corpus that a run's meta.json names may not be read into a report without being asked for (None:
    it may): every recorded input must carry its SHA-256, so the bytes read are those the run measured. A crafted
    meta.json that names some other file of the reader's machine (and cannot know its hash) then puts none of it
    on the page."""
    reading = (meta.get("settings") or {}).get("reading") or {}
    paths = reading.get("paths") or ([meta["corpus"]] if meta.get("corpus") else [])
    inputs = meta.get("inputs")
    if not paths:
        return "the run records no corpus"
    if not (isinstance(inputs, list) and len(inputs) == len(paths)
            and all(isinstance(x, dict) and isinstance(x.get("sha256"), str) for x in inputs)):
        return "meta.json records no SHA-256 of the run's inputs to check them against"
    return None


def texts_of_rows(run_dir, meta: dict, rows) -> tuple[dict, str | None]:
    """{row: text} of some per-sample rows, from RUN/per_sample_rows.csv, else from the run's recorded inputs
    read again (checked to be the same bytes); and a note when the texts could not be found (None: found)."""
    wanted = sorted({int(r) for r in rows})
    if not wanted:
        return {}, None
    table = Path(run_dir) / PER_SAMPLE_ROWS
    out: dict[int, str] = {}
    if table.is_file():
        want = set(wanted)
        try:
            with open(table, newline="", encoding="utf-8") as f:
                for i, r in enumerate(csv.DictReader(f), start=2):
                    row = int(r["row"])
                    if row in want:
                        if not isinstance(r["text"], str):
                            raise ValueError(f"line {i} has no text")
                        out[row] = _text_of(r["text"], r.get("text_pair"))
        except (KeyError, ValueError, TypeError, UnicodeDecodeError, csv.Error) as exc:
            raise AttnkitError(f"{table} is unreadable: {type(exc).__name__}: {exc}") from None
        return out, None
    from ..corpus import corpus_of_run

    why = unverifiable_corpus(meta)
    if why:
        return out, f"the examples' texts were not read again ({why})"
    try:
        corpus = corpus_of_run(run_dir, meta)
        want = set(wanted)
        for i, seg in enumerate(itertools.islice(corpus, wanted[-1] + 1)):
            if i in want:
                out[i] = _text_of(*((seg, None) if isinstance(seg, str) else seg))
    except AttnkitError as exc:
        return out, f"the examples' texts could not be read again ({exc})"
    return out, None


def encode_maps(weights: np.ndarray) -> tuple[list[str], list[float]]:
    """Per head of a layers × heads × n × n map array: the map scaled to its own maximum as base64 uint8, and that
    maximum."""
    L, H, n, _ = weights.shape
    flat = weights.reshape(L * H, n * n).astype(np.float64)
    mx = flat.max(1)
    q = np.round(255.0 * flat / np.where(mx > 0, mx, 1.0)[:, None]).clip(0, 255).astype(np.uint8)
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in q], [round(float(v), 5) for v in mx]


def panel_data(features, clusters: dict, colors: dict, *, distances=None, extremes: dict | None = None,
               row_texts=None, maps=None, attached: Attached | None = None, docs: dict, notes: dict,
               removed=None, shown=None, js_source: str = "distances.npz") -> dict:
    """Everything report.js shows about each head (the format: docs/files.md, "report.html"). `extremes`: the
    top and bottom examples (`extremes(per_sample, names)`), `row_texts` their texts, `maps` AttentionMaps of the
    example inputs, `removed` (L × H booleans) the heads removed from a pruned model, `shown` the features the
    panel lists (default: all; a decoder's run leaves out those 0 for every head, attnkit.features.shown_features).
    `distances`: the JS divergences per token between heads (an M × M array, infinite between heads never compared;
    or a HeadDistances), which `js_source` names."""
    L, H, F = features.mean.shape
    M = L * H
    cols = [features.names.index(n) for n in (features.names if shown is None else shown)]
    gone = np.zeros(M, dtype=bool) if removed is None else np.asarray(removed, dtype=bool).ravel()
    type_names = [c["type"] for c in clusters["clusters"]]
    # clusters.json lists the removed heads of a pruned model apart (`removed_heads`), not in `heads`
    label = {(h["layer"], h["head"]): h["label"] for h in clusters["heads"]}
    by_head = {(h["layer"], h["head"]): h.get("agreement") for h in clusters["heads"]}
    agreement = [by_head.get((m // H, m % H)) for m in range(M)]
    X = head_matrix(features, clusters["settings"]["features"])
    feat_d = np.sqrt(np.square(X[:, None, :] - X[None, :, :]).sum(-1))
    data = {
        "L": L, "H": H, "heads": [f"L{m // H}H{m % H}" for m in range(M)],
        "removed": [bool(x) for x in gone],
        "features": {"names": [features.names[j] for j in cols],
                     "mean": _rounded(features.mean.reshape(M, F)[:, cols]),
                     "std": _rounded(features.std.reshape(M, F)[:, cols]),
                     "scale": [feature_scales(features)[j] for j in cols],
                     "docs": docs["links"], "defs": docs["defs"]},
        "types": {"names": type_names, "colors": [colors[t] for t in type_names],
                  "short": short_names(type_names),
                  "label": [int(label.get((m // H, m % H), -1)) for m in range(M)],
                  "agreement": None if all(a is None for a in agreement) else agreement},
        "near": {"js": nearest(getattr(distances, "per_token", distances), removed=gone)
                 if distances is not None else None, "feat": nearest(feat_d, removed=gone), "js_source": js_source},
        "examples": None, "maps": None, "probe": None, "patterns": None, "ablation": [], "detected": None,
        "notes": notes,
    }
    if extremes is not None:
        ext = extremes
        data["examples"] = {
            "features": list(ext),
            "top": {f: [_ranked(e["top"][m], e["top_values"][m]) for m in range(M)] for f, e in ext.items()},
            "bottom": {f: [_ranked(e["bottom"][m], e["bottom_values"][m]) for m in range(M)] for f, e in ext.items()},
            "texts": {str(k): v for k, v in (row_texts or {}).items()}}
    if maps:
        from ..tokens import shown_token  # torch loads only with maps, which a model drew

        encoded = [encode_maps(m.weights) for m in maps]
        data["maps"] = {"texts": [{"tokens": [shown_token(str(t)) for t in m.tokens]} for m in maps],
                        "data": [e[0] for e in encoded], "max": [e[1] for e in encoded]}
    if attached is not None:
        if attached.probe is not None:
            p = attached.probe
            data["probe"] = {"relations": p["relations"], "baseline": _rounded(p["baseline"]),
                             "acc": _rounded(p["acc"].reshape(M, -1)),
                             "source": f"{p['path'].name}/probe.json"}
        if attached.patterns is not None:
            from .patterns import PATTERN_COLORS

            sh = attached.patterns["shares"]
            data["patterns"] = {"classes": attached.patterns["classes"],
                                "colors": [PATTERN_COLORS.get(c, "#999") for c in attached.patterns["classes"]],
                                "shares": _rounded(sh.reshape(len(sh), M).T)}
        if attached.detected is not None:
            d = attached.detected
            scores = np.stack([np.where(gone.reshape(L, H), np.nan, d["scores"][k]) for k in d["kinds"]], -1)
            data["detected"] = {"kinds": d["kinds"], "scores": _rounded(scores.reshape(M, -1), 4),
                                "source": d["source"]}
        for a in attached.ablations:
            src = a["path"].name
            if "delta" in a:  # per head (heads: M values) or per layer (layers: L values)
                data["ablation"].append({"experiment": a["experiment"], "source": src,
                                         "metric": a["metric"] + (" (higher is worse)" if a["metric"] in LOWER_IS_BETTER
                                                                  else ""),
                                         "per": "layer" if a["delta"].ndim == 1 else "head",
                                         "delta": _rounded(a["delta"].ravel()), "lo": _rounded(a["lo"].ravel()),
                                         "hi": _rounded(a["hi"].ravel())})
            elif "importance" in a:
                imp = a["importance"].ravel()
                rank = np.empty(M, dtype=int)
                rank[np.argsort(-imp, kind="stable")] = np.arange(1, M + 1)
                data["ablation"].append({"experiment": "importance", "source": src, "score": _rounded(imp),
                                         "rank": rank.tolist()})
    return data


__all__ = ["EXAMPLE_FEATURES", "encode_maps", "extremes", "feature_scales", "nearest", "panel_data", "texts_of_rows",
           "unverifiable_corpus"]
