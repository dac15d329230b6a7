"""Per-head dependency accuracies (Clark et al. Sec. 4.2), the fixed-offset baseline and the attention-only
probe (Sec. 5), accumulated sentence by sentence from word-level attention.

For a sentence with word-level attention M (heads × W × W, rows attend), a head's prediction for word i is
the other aligned word j with the largest M[i, j] (lowest j on ties). For every scored dependency
(dependent d, gold head g, relation r; both words aligned, g not the root):
  * dependent → head is correct when the prediction for d is g;
  * head → dependent is correct when the prediction for g is d (a head with several dependents of r can be
    right for at most one of them, as in Clark's evaluation).
Baseline: for each relation, the relative offset g − d that is most often right (the accuracy is the same in
both directions).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..errors import AttnkitError, arg
from .sentences import ROOT

ALL = "(all)"  # the pseudo-relation of every scored dependency
DIRECTIONS = ("dep->head", "head->dep")


@dataclass
class RelationCounts:
    n: int = 0
    dep_to_head: np.ndarray | None = None  # correct per head (flattened layers × heads)
    head_to_dep: np.ndarray | None = None
    offsets: Counter = field(default_factory=Counter)


class ProbeScores:
    """Accumulates correct counts per (relation, head, direction), and the attention-only probe's pairs."""

    def __init__(self, n_layers: int, n_heads: int, keep_pairs: bool = True):
        self.n_layers, self.n_heads = n_layers, n_heads
        self.rel: dict[str, RelationCounts] = defaultdict(RelationCounts)
        self.keep_pairs = keep_pairs
        self.pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per sentence: X, is_head, dependent
        self.n_sentences = 0
        self.n_words = 0
        self.n_root = 0
        self.n_skipped = 0  # dependencies with an unaligned dependent or head

    def add(self, attn: np.ndarray, heads: list[int], relations: list[str], aligned: list[bool]) -> None:
        """One sentence: `attn` (layers, heads, W, W) word-level attention over its W words."""
        LH = self.n_layers * self.n_heads
        W = len(heads)
        if attn.shape != (self.n_layers, self.n_heads, W, W):
            raise AttnkitError(f"word attention of shape {attn.shape} does not fit a sentence of {W} words")
        M = attn.reshape(LH, W, W).astype(np.float64)
        ok = np.asarray(aligned, dtype=bool)
        cand = ok[None, :] & ~np.eye(W, dtype=bool)  # W×W: row i may predict column j
        pred = np.where(cand[None], M, -np.inf).argmax(-1)  # LH × W (argmax: lowest index on ties)
        pred = np.where(cand.any(1)[None], pred, -1)
        self.n_sentences += 1
        self.n_words += W
        deps, govs = [], []
        for d, (g, r) in enumerate(zip(heads, relations)):
            if g == ROOT:
                self.n_root += 1
                continue
            if not (ok[d] and ok[g]):
                self.n_skipped += 1
                continue
            deps.append(d)
            govs.append(g)
            for name in (r, ALL):
                c = self.rel[name]
                if c.dep_to_head is None:
                    c.dep_to_head = np.zeros(LH, np.int64)
                    c.head_to_dep = np.zeros(LH, np.int64)
                c.n += 1
                c.dep_to_head += pred[:, d] == g
                c.head_to_dep += pred[:, g] == d
                c.offsets[g - d] += 1
        if self.keep_pairs and deps:
            self._add_pairs(M, ok, deps, govs)

    def _add_pairs(self, M, ok, deps, govs) -> None:
        """Candidate (dependent, word) pairs: features = every head's attention in both directions."""
        rows, labels, group = [], [], []
        for d, g in zip(deps, govs):
            js = [j for j in range(len(ok)) if ok[j] and j != d]
            rows.append(np.concatenate([M[:, d, js], M[:, js, d]], 0).T)  # len(js) × 2·LH
            labels.extend(j == g for j in js)
            group.extend([d] * len(js))
        self.pairs.append((np.concatenate(rows).astype(np.float32), np.asarray(labels), np.asarray(group)))

    # --- results -----------------------------------------------------------------------------------------
    def relations(self, min_count: int = 1) -> list[str]:
        """Relations with at least `min_count` scored dependencies, most frequent first, ALL last."""
        names = [r for r, c in self.rel.items() if r != ALL and c.n >= min_count]
        names.sort(key=lambda r: (-self.rel[r].n, r))
        return names + ([ALL] if ALL in self.rel else [])

    def baseline(self, relation: str) -> tuple[int, float]:
        """(best fixed offset g − d, its accuracy) for a relation; ties: the smaller |offset|, then offset."""
        c = self.rel[relation]
        off, hits = min(c.offsets.items(), key=lambda kv: (-kv[1], abs(kv[0]), kv[0]))
        return off, hits / c.n

    def accuracy(self, relation: str, direction: str) -> np.ndarray:
        """Accuracy per head, shape (layers, heads)."""
        c = self.rel[relation]
        arr = c.dep_to_head if direction == DIRECTIONS[0] else c.head_to_dep
        return (arr / c.n).reshape(self.n_layers, self.n_heads)

    def rows(self) -> list[dict]:
        """One row per (relation, layer, head, direction): the probe.csv table."""
        out = []
        for r in self.relations():
            c = self.rel[r]
            off, base = self.baseline(r)
            for direction in DIRECTIONS:
                correct = (c.dep_to_head if direction == DIRECTIONS[0] else c.head_to_dep).reshape(
                    self.n_layers, self.n_heads)
                for layer in range(self.n_layers):
                    for head in range(self.n_heads):
                        k = int(correct[layer, head])
                        out.append({"relation": r, "layer": layer, "head": head, "direction": direction,
                                    "correct": k, "count": c.n, "accuracy": k / c.n,
                                    "baseline_offset": off, "baseline_accuracy": base})
        return out

    def best(self, relation: str) -> dict:
        """The best head of a relation in each direction and overall (the better direction)."""
        c = self.rel[relation]
        off, base = self.baseline(relation)
        res = {"relation": relation, "count": c.n, "baseline_offset": off, "baseline_accuracy": base}
        best_any = None
        for direction in DIRECTIONS:
            acc = self.accuracy(relation, direction)
            layer, head = np.unravel_index(int(acc.argmax()), acc.shape)
            entry = {"layer": int(layer), "head": int(head), "accuracy": float(acc[layer, head])}
            res[direction] = entry
            if best_any is None or entry["accuracy"] > best_any["accuracy"]:
                best_any = dict(entry, direction=direction)
        res["best"] = best_any
        return res


def attention_only_probe(scores: ProbeScores, train_fraction: float = 0.5, seed: int = 0) -> dict:
    """Clark's attention-only probe: a logistic model over every head's word-level attention in both
    directions (w·α(d→j) + u·α(j→d)), trained on `train_fraction` of the sentences, scored on the rest:
    UAS = share of test dependents (non-root, aligned) whose highest-scoring candidate word is the gold head.
    Trained as a binary classifier of (dependent, candidate) pairs; the prediction takes the arg-max over
    the candidates, which is the same log-linear form as Clark's softmax over candidates."""
    from sklearn.linear_model import LogisticRegression

    if not 0 < train_fraction < 1:
        raise AttnkitError(f"{arg('train_fraction')} must lie strictly between 0 and 1, got {train_fraction}")
    n = len(scores.pairs)
    if n < 2:
        return {"skipped": f"needs at least 2 sentences with scored dependencies, got {n}"}
    order = np.random.default_rng(seed).permutation(n)
    n_train = min(max(1, int(round(train_fraction * n))), n - 1)
    train, test = order[:n_train], order[n_train:]
    X = np.concatenate([scores.pairs[i][0] for i in train])
    y = np.concatenate([scores.pairs[i][1] for i in train])
    if y.all() or not y.any():
        return {"skipped": "the training sentences give only one class of candidate pairs"}
    clf = LogisticRegression(max_iter=2000, C=1.0)
    clf.fit(X, y)

    def uas(idx):
        right = total = 0
        for i in idx:
            Xs, ys, group = scores.pairs[i]
            s = clf.decision_function(Xs)
            for d in np.unique(group):
                m = group == d
                total += 1
                right += bool(ys[m][int(np.argmax(s[m]))])
        return right, total

    right, total = uas(test)
    tr_right, tr_total = uas(train)
    return {"train_sentences": int(len(train)), "test_sentences": int(len(test)), "test_dependents": total,
            "uas": right / total if total else None, "train_uas": tr_right / tr_total if tr_total else None,
            "features": int(X.shape[1]), "seed": seed, "train_fraction": train_fraction}
