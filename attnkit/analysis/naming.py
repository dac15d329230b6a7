"""Names for head clusters, derived from their mean distance features (Guan et al. 2020, Sec. 4).

A cluster's profile is the mean over its heads of the distance buckets (cls, sep, comma, period,
self, win_0 … win_{N-1}; docs/analysis.md), renormalised to sum 1. From it:

* ``special`` (V)  = cls + sep + comma + period: weight on special tokens and punctuation, which draws
  vertical stripes in an attention map;
* ``near``         = self + win_0 … win_{N/8-1}: weight on the token itself and keys closer than n/8;
* ``far``          = win_{N/4} … win_{N-1}: weight on keys at least n/4 away;
* ``near_r``, ``far_r`` = near / (1 − V), far / (1 − V): the same, as shares of the non-special weight.
  (Uniform attention over a sequence gives near_r ≈ 0.23 and far_r ≈ 0.56.)

Rules. Each of the four names goes to at most one cluster; they are handed out in this order,
each to the best of the clusters not yet named that pass its test:

1. ``vertical``        test V ≥ 0.5 (most weight on [CLS]/[SEP]/punctuation); best: highest V.
2. ``diagonal``        test near_r ≥ 0.5 (the non-special weight sits on the diagonal band: self,
   prev, next, short range; any V, Guan: "medium values in the special tokens"); best: highest near_r.
3. ``dense``           test far_r ≥ 0.35 and V < 0.5 (weight spread out to the far windows, special
   tokens not dominant); best: lowest V (Guan: "relatively small attention to the special tokens").
4. ``dense+vertical``  test far_r ≥ 0.35, V ≥ 0.25 and far ≥ 0.15 (broad weight that really reaches
   the far windows, plus stripes); best: highest V.

So the names are relative, as in Guan et al.'s descriptions ("much higher than other types"), but a
cluster only gets a name whose absolute test it passes. Clusters left without a name get a
descriptive one: the cluster's components among cls, sep, punct (comma + period), self, near, mid, far
that hold at least a quarter of the weight, largest first, as ``"<a>+<b>-heavy"`` (e.g. "cls+near-heavy"
for a diagonal band plus a [CLS] stripe when "diagonal" went to another cluster; ``"mixed"`` when no
component has a quarter), with " #2", " #3" … appended to keep names unique.
Profiles without distance buckets get descriptive names from their largest feature.
"""
from __future__ import annotations

import numpy as np

RULE_NAMES = ("vertical", "diagonal", "dense", "dense+vertical")
V_VERTICAL = 0.5
NEAR_DIAGONAL = 0.5
FAR_BROAD = 0.35
V_DENSE_VERTICAL = 0.25
FAR_DENSE_VERTICAL = 0.15

# (name, test, score: higher is a better fit), in the order the names are handed out
RULES = (
    ("vertical", lambda g: g["special"] >= V_VERTICAL, lambda g: g["special"]),
    ("diagonal", lambda g: g["near_r"] >= NEAR_DIAGONAL, lambda g: g["near_r"]),
    ("dense", lambda g: g["far_r"] >= FAR_BROAD and g["special"] < V_VERTICAL, lambda g: -g["special"]),
    ("dense+vertical", lambda g: g["far_r"] >= FAR_BROAD and g["special"] >= V_DENSE_VERTICAL
     and g["far"] >= FAR_DENSE_VERTICAL, lambda g: g["special"]),
)


def profile_groups(profile, names) -> dict | None:
    """The group shares of one profile (see module docstring); None without distance buckets."""
    idx = {n: i for i, n in enumerate(names)}
    wins = sorted((int(n[4:]), idx[n]) for n in names if n.startswith("win_") and n[4:].isdigit())
    if not wins or not all(n in idx for n in ("cls", "sep", "comma", "period", "self")):
        return None
    p = np.asarray(profile, dtype=np.float64)
    N = len(wins)
    win = np.array([p[i] for _, i in wins])
    parts = {"cls": p[idx["cls"]], "sep": p[idx["sep"]], "punct": p[idx["comma"]] + p[idx["period"]],
             "self": p[idx["self"]]}
    n_near = max(1, N // 8)
    n_far_start = max(n_near, N // 4)
    parts["near"] = win[:n_near].sum()
    parts["mid"] = win[n_near:n_far_start].sum()
    parts["far"] = win[n_far_start:].sum()
    total = sum(parts.values())
    if total <= 0:
        return None
    parts = {k: float(v / total) for k, v in parts.items()}
    V = parts["cls"] + parts["sep"] + parts["punct"]
    rest = max(1.0 - V, 1e-12)
    near = parts["self"] + parts["near"]
    return dict(parts, special=V, near_total=near, near_r=near / rest, far_r=parts["far"] / rest)


def rule_names(g: dict) -> list[str]:
    """The rule names whose tests the group shares `g` pass."""
    return [name for name, test, _ in RULES if test(g)]


def descriptive_name(g: dict | None, profile=None, names=None) -> str:
    if g is None:
        p = np.asarray(profile, dtype=np.float64)
        return f"{names[int(np.nanargmax(p))]}-heavy" if len(p) else "cluster"
    comps = {k: g[k] for k in ("cls", "sep", "punct", "self", "near", "mid", "far")}
    big = sorted((c for c in comps if comps[c] >= 0.25), key=lambda c: -comps[c])
    return "+".join(big) + "-heavy" if big else "mixed"


def name_clusters(profiles, names) -> list[str]:
    """Unique type names for k cluster profiles (k × F member means over the features `names`)."""
    profiles = np.asarray(profiles, dtype=np.float64)
    names = list(names)
    groups = [profile_groups(p, names) if np.all(np.isfinite(p)) else None for p in profiles]
    out: list[str | None] = [None] * len(profiles)
    for name, test, score in RULES:
        cands = [(score(g), -c) for c, g in enumerate(groups) if g is not None and out[c] is None and test(g)]
        if cands:
            out[-max(cands)[1]] = name
    used = {n for n in out if n}
    for c, g in enumerate(groups):
        if out[c] is None:
            base = descriptive_name(g, profiles[c], names) if np.all(np.isfinite(profiles[c])) else "empty"
            name, i = base, 2
            while name in used:
                name, i = f"{base} #{i}", i + 1
            out[c] = name
            used.add(name)
    return [str(n) for n in out]


__all__ = ["name_clusters", "profile_groups", "rule_names", "RULE_NAMES", "RULES"]
