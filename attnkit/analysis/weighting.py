"""Two weightings of one corpus side by side: how much of each head's special-token mass survives norm weighting
(Kobayashi et al. 2020; docs/analysis.md, "Attention against norm-weighted attention").

A head's mass on a token class is its corpus-mean feature (`cls`, `sep`, `comma` + `period`; docs/features.md).
Under attention weighting it is the weight the head gives those tokens; under norm weighting, the share of its
norm-weighted rows ‖α_{s,t} f_h(x_t)‖ / Σ_u ‖α_{s,u} f_h(x_u)‖ that they take. The surviving share of a head is
norm mass / attention mass (it can exceed 1: a head whose special tokens carry large vectors). Kobayashi et al.'s
finding is that it is mostly small: [CLS], [SEP] and punctuation get large weights but small transformed vectors.

`attnkit compare RUN_ATTENTION RUN_NORM` prints it when the two runs differ in weighting only.
"""
from __future__ import annotations

import numpy as np

from ..errors import AttnkitError
from ..features import weighting_of
from ..run.head_features import HeadFeatures
from ..run.opened import Run
from ..run.outputs import json_float
from .summaries import SPECIAL_GROUPS, class_mass

GROUPS = SPECIAL_GROUPS + (("all special", ("cls", "sep", "comma", "period")),)
# settings that must agree for the two runs to measure the same heads on the same samples
SAME = ("model", "corpus_sha256", "max_length", "num_windows", "split_sentences", "limit")


def _grid(a: np.ndarray) -> list:
    return [[json_float(x) for x in row] for row in a]


def check_same_measurement(attention: HeadFeatures, norm: HeadFeatures) -> None:
    """Refuse two runs that do not measure the same heads on the same samples (naming what differs)."""
    if attention.mean.shape != norm.mean.shape or attention.names != norm.names:
        raise AttnkitError(f"the two runs have different heads or features: {attention.mean.shape} and "
                           f"{norm.mean.shape} (layers × heads × features)")
    sa, sb = attention.meta.get("settings", {}), norm.meta.get("settings", {})
    differ = [k for k in SAME if k in sa and k in sb and sa[k] != sb[k]]
    if attention.n_samples != norm.n_samples:
        differ.append("n_samples")
    if differ:
        raise AttnkitError("the two runs measure different things, not one corpus under two weightings: "
                           + ", ".join(differ) + " differ")


def compare_weightings(attention: HeadFeatures, norm: HeadFeatures) -> dict:
    """Special-token mass of every head under attention and norm weighting, and the surviving share.

    Returns {"groups": {group: {"attention", "norm", "survival": L × H lists (survival null where the
    attention mass is 0), "mean_attention", "mean_norm", "survival_of_means"}}, "per_layer": {group:
    {"attention": [...], "norm": [...]}}, "heads": the heads with the most special-token mass under attention,
    with both masses, "n_removed": heads removed by pruning in either run, left out}. Means are over the other
    heads (null for a layer with none)."""
    check_same_measurement(attention, norm)
    kept = attention.kept & norm.kept
    groups, per_layer = {}, {}
    for label, names in GROUPS:
        a, n = class_mass(attention, names), class_mass(norm, names)
        with np.errstate(divide="ignore", invalid="ignore"):
            survival = np.where(kept & (a > 0), n / a, np.nan)
        ma, mn = float(a[kept].mean()), float(n[kept].mean())
        groups[label] = {"attention": _grid(a), "norm": _grid(n), "survival": _grid(survival),
                         "mean_attention": ma, "mean_norm": mn,
                         "survival_of_means": json_float(mn / ma) if ma > 0 else None}
        per_layer[label] = {"attention": [json_float(a[l][kept[l]].mean()) if kept[l].any() else None
                                          for l in range(a.shape[0])],
                            "norm": [json_float(n[l][kept[l]].mean()) if kept[l].any() else None
                                     for l in range(n.shape[0])]}
    special, special_norm = class_mass(attention, GROUPS[-1][1]), class_mass(norm, GROUPS[-1][1])
    top = [i for i in np.argsort(-np.where(kept, special, -np.inf), axis=None, kind="stable")
           if kept.reshape(-1)[i]][:10]
    heads = []
    for flat in top:
        l, h = (int(x) for x in np.unravel_index(flat, special.shape))
        heads.append({"layer": l, "head": h, "attention": float(special[l, h]), "norm": float(special_norm[l, h])})
    return {"groups": groups, "per_layer": per_layer, "heads": heads, "n_removed": int((~kept).sum())}


def compare_run_weightings(run_a: Run, run_b: Run) -> dict | None:
    """The comparison of two runs (as a command read them, attnkit.run.opened) that differ in weighting (one
    attention, one norm), with the runs named; None when they have the same weighting."""
    wa, wb = weighting_of(run_a.features.meta), weighting_of(run_b.features.meta)
    if wa == wb:
        return None
    attention, norm = (run_a, run_b) if wa == "attention" else (run_b, run_a)
    return {"attention_run": str(attention.path), "norm_run": str(norm.path),
            **compare_weightings(attention.features, norm.features)}


def weighting_lines(res: dict) -> list[str]:
    """What `attnkit compare` prints of a weighting comparison."""
    lines = [f"weightings: {res['attention_run']} attention, {res['norm_run']} norm (Kobayashi et al. 2020); "
             "special-token mass, mean over heads" + (f" ({res['n_removed']} removed by pruning left out)"
                                                       if res.get("n_removed") else "") + ":",
             f"  {'':<13} {'attention':>9} {'norm':>7} {'surviving':>10}"]
    for label, g in res["groups"].items():
        surv = "–" if g["survival_of_means"] is None else f"{g['survival_of_means']:.0%}"
        lines.append(f"  {label:<13} {g['mean_attention']:>9.3f} {g['mean_norm']:>7.3f} {surv:>10}")
    lines.append("surviving share of each head's [CLS]+[SEP]+punctuation mass (norm / attention; rows: layers, "
                 "columns: heads):")
    for l, row in enumerate(res["groups"]["all special"]["survival"]):
        lines.append(f"  L{l:<3} " + " ".join("   –" if x is None else f"{x:>4.0%}" if x < 10 else ">999"
                                              for x in row))
    lines.append("heads with the most special-token mass by attention (attention → norm): "
                 + ", ".join(f"L{h['layer']}H{h['head']} {h['attention']:.2f}→{h['norm']:.2f}" for h in res["heads"]))
    return lines


__all__ = ["GROUPS", "check_same_measurement", "compare_run_weightings", "compare_weightings", "weighting_lines"]
