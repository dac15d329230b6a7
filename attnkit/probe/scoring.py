"""Per-head dependency accuracies (Clark et al. Sec. 4.2), the fixed-offset baseline and the attention-only
probe (Sec. 5), accumulated sentence by sentence from word-level attention (definitions: docs/probes.md).

For a sentence with word-level attention M (heads × W × W, M[i, j] = attention from word i to word j) and
the aligned words as candidates, every scored dependency (dependent d, gold head g, relation r) gets one
predicted head per direction, lowest index on ties:
  * dep->head: the word d attends to most, argmax_{j != d} M[d, j] (Clark's `mode="normal"`);
  * dep<-head: the word that attends most to d, argmax_{j != d} M[j, d] (Clark's `mode="transpose"`,
    called "head<-dep" in his notebook). Several dependents of one head can all be right.
The prediction is right when it is g. Root words are not scored, or (`count_root`, as Clark's code does)
scored as dependencies of ROOT that no head predicts, so always wrong.
Baseline, per relation: the fixed offset o whose prediction d + o is most often the gold head; `"any"`
tries every offset that occurs, `"clark"` only −3…2 with Clark's clamping (before the first word: ROOT,
after the last: the last word).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..errors import AttnkitError, arg
from .sentences import ROOT

ALL = "(all)"  # the pseudo-relation of every scored dependency
DIRECTIONS = ("dep->head", "dep<-head")
DIRECTION_QUESTIONS = {
    "dep->head": "is the word the dependent attends to most its head?",
    "dep<-head": "is the word that attends most to the dependent its head? (Clark's transposed mode)",
}
BASELINES = ("any", "clark")
CLARK_OFFSETS = tuple(range(-3, 3))  # the offsets of Clark et al.'s offset_predictor (range(-3, 3))


@dataclass
class RelationCounts:
    n: int = 0
    correct: dict = field(default_factory=dict)  # direction → correct per head (flattened layers × heads)
    offset_hits: Counter = field(default_factory=Counter)  # baseline offset → dependencies it gets right


def check_baseline(baseline: str) -> None:
    if baseline not in BASELINES:
        raise AttnkitError(f"unknown {arg('baseline')} {baseline!r}; use {' or '.join(BASELINES)}")


def offset_prediction(d: int, offset: int, n_words: int) -> int:
    """Clark's offset baseline: the word `offset` after word `d`, clamped to the sentence as his code does
    (before the first word: ROOT; after the last word: the last word)."""
    p = d + offset
    return ROOT if p < 0 else min(p, n_words - 1)


class ProbeScores:
    """Accumulates correct counts per (relation, head, direction), the baseline's hits per offset, and the
    attention-only probe's pairs. `count_root`: score root words (always wrong, as in Clark's code);
    `baseline`: "any" (every offset) or "clark" (−3…2, clamped). `removed`: layers × heads booleans, heads a
    pruning removed (docs/pruning.md): they have no attention, so they are left out (NaN accuracy, no rows in
    probe.csv, never a best head, not among the attention-only probe's features)."""

    def __init__(self, n_layers: int, n_heads: int, keep_pairs: bool = True, *, count_root: bool = False,
                 baseline: str = "any", removed: np.ndarray | None = None):
        check_baseline(baseline)
        self.n_layers, self.n_heads = n_layers, n_heads
        self.removed = (np.zeros((n_layers, n_heads), dtype=bool) if removed is None
                        else np.asarray(removed, dtype=bool).reshape(n_layers, n_heads))
        self.count_root, self.baseline_kind = bool(count_root), baseline
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
        cand = ok[None, :] & ~np.eye(W, dtype=bool)  # W×W: for word i, column j may be predicted
        none = ~cand.any(1)[None]  # a word with no candidate gets no prediction (-1)
        pred = {direction: np.where(none, -1, np.where(cand[None], A, -np.inf).argmax(-1))  # LH × W, lowest j on ties
                for direction, A in zip(DIRECTIONS, (M, M.transpose(0, 2, 1)))}
        self.n_sentences += 1
        self.n_words += W
        deps, govs = [], []
        for d, (g, r) in enumerate(zip(heads, relations)):
            if g == ROOT:
                self.n_root += 1
                if not self.count_root:
                    continue
            if not ok[d] or (g != ROOT and not ok[g]):
                self.n_skipped += 1
                continue
            if g != ROOT:
                deps.append(d)
                govs.append(g)
            for name in (r, ALL):
                c = self.rel[name]
                if not c.correct:
                    c.correct = {direction: np.zeros(LH, np.int64) for direction in DIRECTIONS}
                c.n += 1
                if g != ROOT:  # no head predicts ROOT
                    for direction in DIRECTIONS:
                        c.correct[direction] += pred[direction][:, d] == g
                self._add_baseline(c, d, g, W)
        if self.keep_pairs and deps:
            self._add_pairs(M[~self.removed.reshape(-1)], ok, deps, govs)

    def _add_baseline(self, c: RelationCounts, d: int, g: int, n_words: int) -> None:
        if self.baseline_kind == "any":
            if g != ROOT:
                c.offset_hits[g - d] += 1
        else:
            for off in CLARK_OFFSETS:
                c.offset_hits[off] += offset_prediction(d, off, n_words) == g

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

    def baseline(self, relation: str) -> tuple[int | None, float]:
        """(best fixed offset, its accuracy) for a relation; ties: the smaller |offset|, then the smaller
        offset. (None, 0.0) when no offset is ever right (e.g. only root words with baseline "any")."""
        c = self.rel[relation]
        hits = {off: k for off, k in c.offset_hits.items() if k > 0}
        if not hits:
            return None, 0.0
        off, k = min(hits.items(), key=lambda kv: (-kv[1], abs(kv[0]), kv[0]))
        return off, k / c.n

    def _check_direction(self, direction: str) -> None:
        if direction not in DIRECTIONS:
            raise AttnkitError(f"unknown {arg('direction')} {direction!r}; use {' or '.join(DIRECTIONS)}")

    def accuracy(self, relation: str, direction: str) -> np.ndarray:
        """Accuracy per head, shape (layers, heads)."""
        self._check_direction(direction)
        c = self.rel[relation]
        return np.where(self.removed, np.nan, (c.correct[direction] / c.n).reshape(self.n_layers, self.n_heads))

    def best_accuracy(self, relation: str) -> np.ndarray:
        """Per head, the better of the two directions' accuracies (layers, heads)."""
        return np.maximum(*(self.accuracy(relation, d) for d in DIRECTIONS))

    def rows(self) -> list[dict]:
        """One row per (relation, layer, head, direction): the probe.csv table."""
        out = []
        for r in self.relations():
            c = self.rel[r]
            off, base = self.baseline(r)
            for direction in DIRECTIONS:
                correct = c.correct[direction].reshape(self.n_layers, self.n_heads)
                for layer in range(self.n_layers):
                    for head in range(self.n_heads):
                        if self.removed[layer, head]:
                            continue
                        k = int(correct[layer, head])
                        out.append({"relation": r, "layer": layer, "head": head, "direction": direction,
                                    "correct": k, "count": c.n, "accuracy": k / c.n,
                                    "baseline_offset": "" if off is None else off, "baseline_accuracy": base})
        return out

    def best(self, relation: str) -> dict:
        """The best head of a relation in each direction and overall (the better direction)."""
        c = self.rel[relation]
        off, base = self.baseline(relation)
        res = {"relation": relation, "count": c.n, "baseline_offset": off, "baseline_accuracy": base}
        best_any = None
        for direction in DIRECTIONS:
            acc = self.accuracy(relation, direction)
            layer, head = np.unravel_index(int(np.nanargmax(acc)), acc.shape)
            entry = {"layer": int(layer), "head": int(head), "accuracy": float(acc[layer, head])}
            res[direction] = entry
            if best_any is None or entry["accuracy"] > best_any["accuracy"]:
                best_any = dict(entry, direction=direction)
        res["best"] = best_any
        return res


def attention_only_probe(scores: ProbeScores, train_fraction: float = 0.5, seed: int = 0) -> dict:
    """Clark's attention-only probe: a logistic model over every head's word-level attention in both
    directions (w·α(d→j) + u·α(j→d)), trained on `train_fraction` of the sentences, scored on the rest:
    UAS = share of test dependents (non-root, aligned) whose highest-scoring candidate word is the gold head
    (root words are never in it, whatever `count_root`: ROOT is no candidate here).
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
