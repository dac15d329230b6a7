"""Names for head clusters, derived from their mean features (docs/analysis.md, "Naming the types").

A cluster's profile is the mean over its heads of the distance buckets (cls, sep, comma, period, self,
win_0 … win_{N-1}; docs/features.md), renormalised to sum 1, grouped into shares (`profile_groups`):
cls, sep, punct = comma + period, self, near = the first max(1, N // 8) windows, mid = the windows up to N // 4,
far = the rest; `special` = cls + sep + punct, `near_r`, `far_r` = (self + near), far as shares of the
non-special weight. The row features `prev` and `next` are divided by the same sum.

From those shares, each kind of model has its **classes**, shares of the weight that together make 1:

* an encoder (Guan et al. 2020): ``vertical`` = special (stripes down [CLS], [SEP] and punctuation),
  ``diagonal`` = self + near (the band along the diagonal), ``dense`` = mid + far (spread over the sequence);
* a decoder (meta.json `model_type` is a decoder's; `cls` is then the sample's first position and `sep` its EOS):
  ``first-token`` = cls (the attention sink), ``previous-token`` = prev (at most near), ``local`` = self + near −
  previous-token, ``broad`` = mid + far, ``eos`` = sep, ``punctuation`` = punct;

and **details**, finer shares that may tell two types apart: the classes themselves and, for an encoder, cls, sep,
punct, self, prev, next; for a decoder, self.

Rule. A type's name starts with its largest class X (ties: the class listed first). Among the types whose largest
class is X, the one with the most X is called ``X``. Every other one is called ``X+Y``, where Y is the detail on which
it exceeds every other type of its group, by the widest margin (so the type named ``X+Y`` has the most Y of the
types named X…); when it exceeds them on no single detail, ``X+Y+Z`` with the pair of details whose sum it holds the
most of, by the widest margin; when on none, it lies between the others everywhere and is called by its share of X,
``X 0.68``. So no name contradicts the numbers: a name's first word is the type's largest share, a plain ``X`` is the
most-X type of those, a ``+Y`` is the most-Y of them; and two types never share a name.

Profiles without distance buckets use the same rule with each feature as a class (``<feature>-heavy``); an empty
cluster is ``empty``.
"""
from __future__ import annotations

import itertools

import numpy as np

from ..errors import AttnkitError
from ..features import resolve_subset

ENCODER_CLASSES = ("vertical", "diagonal", "dense")
DECODER_CLASSES = ("first-token", "previous-token", "local", "broad", "eos", "punctuation")
ENCODER_DETAILS = ("cls", "sep", "punct", "self", "prev", "next")
DECODER_DETAILS = ("self",)


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
    out = dict(parts, special=V, near_total=near, near_r=near / rest, far_r=parts["far"] / rest)
    for row in ("prev", "next"):
        if row in idx:
            out[row] = float(max(p[idx[row]], 0.0) / total)
    return out


def class_shares(g: dict, decoder: bool = False) -> dict:
    """The classes of a model's kind (module docstring) from the group shares `g` of `profile_groups`, in order."""
    if decoder:
        prev = min(g.get("prev", 0.0), g["near"])
        return {"first-token": g["cls"], "previous-token": prev, "local": g["self"] + g["near"] - prev,
                "broad": g["mid"] + g["far"], "eos": g["sep"], "punctuation": g["punct"]}
    return {"vertical": g["special"], "diagonal": g["self"] + g["near"], "dense": g["mid"] + g["far"]}


def class_names(decoder: bool = False) -> list[str]:
    """The classes of a model's kind, in order: the default features `attnkit cluster` clusters on."""
    return list(DECODER_CLASSES if decoder else ENCODER_CLASSES)


def cluster_features(names, features_subset=None, decoder: bool = False) -> list[str]:
    """The features a clustering works on: None or "classes" → the class shares of the run's kind
    (`class_names`, computed from the distance buckets by `class_matrix`); "distance" → the distance buckets
    themselves (Guan et al.'s 21-dim feature); anything else as `attnkit.features.resolve_subset` reads it."""
    buckets = resolve_subset(names, "distance" if features_subset in (None, "classes") else features_subset,
                             decoder=decoder)
    if features_subset in (None, "classes"):
        if profile_groups(np.ones(len(names)), names) is None:
            raise AttnkitError("the features hold no distance buckets (cls, sep, ..., win_*) to compute the class "
                               "shares from")
        return class_names(decoder)
    return buckets


def class_matrix(mean, names, decoder: bool = False) -> dict[str, np.ndarray]:
    """{class: its share for every row of `mean` (rows × features over `names`)}: the classes of a model's kind
    (`class_shares`) of each row taken as a profile; NaN for a row with NaN (a removed head)."""
    mean = np.asarray(mean, dtype=np.float64)
    out = {c: np.full(len(mean), np.nan) for c in class_names(decoder)}
    for i, row in enumerate(mean):
        g = profile_groups(row, names) if np.all(np.isfinite(row)) else None
        if g is not None:
            for c, v in class_shares(g, decoder).items():
                out[c][i] = v
    return out


def type_values(profile, names, decoder: bool = False) -> dict | None:
    """Every share a type name may claim (classes, then details) of one profile; None without distance buckets."""
    g = profile_groups(profile, names)
    if g is None:
        return None
    out = class_shares(g, decoder)
    for d in DECODER_DETAILS if decoder else ENCODER_DETAILS:
        if d in g:
            out[d] = g[d]
    return out


def _margin(vals: list[dict], i: int, others: list[int], keys) -> float:
    return sum(vals[i][k] for k in keys) - max(sum(vals[j][k] for k in keys) for j in others)


def _name_group(vals: list[dict], members: list[int], head: str, details: list[str], fmt) -> dict[int, str]:
    """Names of the types `members` whose largest class is `head` (module docstring, "Rule")."""
    order = sorted(members, key=lambda i: (-vals[i][head], i))
    out = {order[0]: fmt(head)}
    cand = [d for d in details if d != head]
    for i in order[1:]:
        others = [j for j in members if j != i]
        name = None
        for size in (1, 2):
            best = max(((_margin(vals, i, others, keys), -n) for n, keys in
                        enumerate(itertools.combinations(cand, size))), default=(0.0, 0))
            if best[0] > 0:
                keys = list(itertools.combinations(cand, size))[-best[1]]
                name = "+".join([fmt(head), *keys])
                break
        if name is None:  # between the others on every detail: its share of the head class tells it apart
            digits = 2
            taken = set(out.values())
            while (name := f"{fmt(head)} {vals[i][head]:.{digits}f}") in taken and digits < 8:
                digits += 1
        out[i] = name
    return out


# the short forms of the words names are made of (classes and details of both kinds), for the layer × head grid
SHORT = {"vertical": "vert", "diagonal": "diag", "dense": "dens", "first-token": "1st", "previous-token": "prev",
         "local": "loc", "broad": "brd", "eos": "eos", "punctuation": "pct", "cls": "cls", "sep": "sep",
         "punct": "pct", "self": "self", "prev": "prev", "next": "next", "empty": "emp"}


def short_names(type_names) -> list[str]:
    """Short labels of type names for a layer × head grid's cells, one per name and all different: every word of a
    name in its short form (`SHORT`; another word by its first 4 letters, `-heavy` left out), joined as the name
    joins them (`first-token+previous-token` → `1st+prev`, `dense 0.68` → `dens .68`). So names that share a first
    word keep what tells them apart (three first-token types are `1st`, `1st+prev`, `1st+brd`, not `fir` three
    times); two labels that would still read the same get the type's number after them."""
    def word(w: str) -> str:
        w = w.removesuffix("-heavy")
        return SHORT.get(w, w[:4])

    out = []
    for name in type_names:
        head, _, share = str(name).partition(" ")
        label = "+".join(word(w) for w in head.split("+"))
        if share:
            label += " " + (share[1:] if share.startswith("0.") else share)
        out.append(label)
    repeated = {x for x in out if out.count(x) > 1}
    return [f"{x}{i}" if x in repeated else x for i, x in enumerate(out)]


def name_clusters(profiles, names, decoder: bool = False) -> list[str]:
    """Unique type names for k cluster profiles (k × F member means over the features `names`); `decoder`: the
    profiles are a decoder's (its classes name the types)."""
    profiles = np.asarray(profiles, dtype=np.float64)
    names = list(names)
    k = len(profiles)
    finite = [bool(np.all(np.isfinite(p))) for p in profiles]
    vals = [type_values(p, names, decoder) if ok else None for p, ok in zip(profiles, finite)]
    if any(ok and v is None for ok, v in zip(finite, vals)):  # no distance buckets: each feature is a class
        classes = details = names
        vals = [{n: float(x) for n, x in zip(names, p)} if ok else None for p, ok in zip(profiles, finite)]

        def fmt(c):
            return f"{c}-heavy"
    else:
        classes = list(DECODER_CLASSES if decoder else ENCODER_CLASSES)
        details = [d for d in classes + list(DECODER_DETAILS if decoder else ENCODER_DETAILS)
                   if all(v is None or d in v for v in vals)]

        def fmt(c):
            return c
    out: list[str] = [""] * k
    heads = {}
    for c, v in enumerate(vals):
        if v is not None:
            heads.setdefault(max(classes, key=lambda x: (v[x], -classes.index(x))), []).append(c)
    for head, members in heads.items():
        for c, name in _name_group(vals, members, head, list(details), fmt).items():
            out[c] = name
    empty = [c for c in range(k) if vals[c] is None]
    for c in empty:  # clusters without members: nothing tells them apart but their label
        out[c] = "empty" if len(empty) == 1 else f"empty {c}"
    return out


__all__ = ["class_matrix", "class_names", "cluster_features", "name_clusters", "profile_groups", "short_names",
           "class_shares", "type_values", "ENCODER_CLASSES", "DECODER_CLASSES", "ENCODER_DETAILS", "DECODER_DETAILS"]
