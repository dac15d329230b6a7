"""RUN/report.html: one self-contained page that opens with what the run found and lets the reader explore every
head (docs/analysis.md, "The report"; the file: docs/files.md).

In page order: the findings (head types and their stability, the attention sink, what differs from the papers,
heads above the papers' thresholds, and the headline of any attached pattern, probe or ablation results); the head
explorer (a layer × head grid; a click opens the head's panel: features with their spread, type, nearest heads,
top and bottom examples from per_sample.npy, example maps, probe accuracy per relation, pattern shares, ablation
effect; attnkit/analysis/head_panel.py, attnkit/data/report.js); the figures; the results of `patterns`, `probe`
and `ablate` (attnkit/analysis/attached.py); sortable per-head tables; a glossary linking every feature name to
docs/features.md; settings and versions, folded away. Figures are embedded as base64 PNG and also written as PNG
(and SVG) under RUN/figures/; the data and the small script are embedded too: the page loads nothing.

Other analyses add sections through `SECTIONS` (see `Section`).
"""
from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from ..features import describe_feature, weighting_of
from ..plotting import save_figure
from ..run.clusters import label_grid, load_clusters, run_stability
from ..run.distances import HeadDistances
from ..run.files import CLUSTERS_FILE, DISTANCES_FILE, FIGURES_DIR, REPORT_FILE
from ..run.head_features import HeadFeatures
from ..run.outputs import atomic_write
from . import figures as figs
from .attached import Attached, find_attached
from .clustering import STABILITY_WARN, cluster, distance_feature_names, head_matrix, stability_over_seeds, sweep
from .head_panel import extremes, panel_data, texts_of_rows
from .report_html import docs_base, esc, feature_doc, feature_link, fmt, glossary, img, page, table, value_html
from .results import save_clusters

# The figures the report writes into RUN/figures (a replaced report replaces them).
REPORT_FIGURES = ("type_share_per_layer", "distance_boxplots", "stability_sweep", "tsne_types", "mds_js",
                  "feature_heatmaps", "layer_summaries", "attention_examples")
MAX_EMBEDDED_MAP_TEXTS = 3  # example texts whose maps the head panel holds for every head


def report_figures(run_dir) -> list[Path]:
    """The report's figure files that exist in RUN/figures."""
    d = Path(run_dir) / FIGURES_DIR
    return [d / f"{stem}.{ext}" for stem in REPORT_FIGURES for ext in ("png", "svg") if (d / f"{stem}.{ext}").exists()]


NORM_NOTE = ("Norm-weighted run (attnkit extract --weighting norm; Kobayashi et al. 2020): every feature describes "
             "the attention weights scaled per key by the norm of the transformed key vector ‖f_h(x_t)‖ and "
             "renormalised per row (docs/features.md), not the attention weights themselves. Jensen-Shannon "
             "distances and example maps show attention weights.")


def example_maps(model, tokenizer, texts, picks, *, max_length: int = 64) -> list[dict]:
    """Attention maps of chosen heads for a few texts (`attnkit.attention_maps`: the maps the model uses).

    `picks`: list of (type name, layer, head, text index). One forward per distinct text."""
    from ..engine.maps import attention_maps

    out = []
    by_text: dict[int, list] = {}
    for p in picks:
        by_text.setdefault(p[3], []).append(p)
    for ti, ps in by_text.items():
        maps = attention_maps(texts[ti], (model, tokenizer), max_length=max_length)
        for t, layer, head, _ in ps:
            out.append({"type": t, "layer": layer, "head": head, "tokens": maps.tokens,
                        "weights": maps.head(layer, head)})
    order = {p[:3]: i for i, p in enumerate(picks)}
    out.sort(key=lambda e: order[(e["type"], e["layer"], e["head"])])
    return out


def pick_example_heads(features: HeadFeatures, data: dict, per_type: int = 3, n_texts: int = 1) -> list:
    """For each type, the `per_type` heads closest to their cluster's centroid (most typical)."""
    feats = data["settings"]["features"]
    X = head_matrix(features, feats)
    H = data["run"]["n_heads"]
    picks = []
    for c in data["clusters"]:
        cen = np.array([c["centroid"][f] for f in feats])
        members = [m for m, h in enumerate(data["heads"]) if h["label"] == c["label"]]
        members.sort(key=lambda m: float(np.sum((X[m] - cen) ** 2)))
        for j, m in enumerate(members[:per_type]):
            picks.append((c["type"], m // H, m % H, j % max(n_texts, 1)))
    return picks


def _example_texts(texts, n: int, tokenizer, lo: int = 14, hi: int = 40) -> list[int]:
    """Indices of up to n texts of moderate token length (readable maps)."""
    good, rest = [], []
    for i, t in enumerate(texts[:500]):
        ids = tokenizer(*(t if isinstance(t, (tuple, list)) else (t,)))["input_ids"]
        (good if lo <= len(ids) <= hi else rest).append((abs(len(ids) - (lo + hi) // 2), i))
        if len(good) >= n:
            break
    chosen = [i for _, i in sorted(good)[:n]] or [i for _, i in sorted(rest)[:n]]
    return chosen


class _FigureSaver:
    """Saves the report's figures into RUN/figures (PNG, and SVG unless told not to), one progress step each."""

    def __init__(self, directory, svg: bool, progress: bool):
        from tqdm.auto import tqdm

        self.directory, self.svg = directory, svg
        self.bar = tqdm(desc="report", unit=" figures", disable=not progress, dynamic_ncols=True)

    def expect(self, n: int) -> None:
        """The number of figures the report will draw (the bar's total)."""
        self.bar.total = n
        self.bar.refresh()

    def __call__(self, fig, stem: str) -> dict:
        saved = save_figure(fig, self.directory, stem, svg=self.svg)
        self.bar.set_postfix_str(stem, refresh=False)
        self.bar.update(1)
        return saved

    def close(self) -> None:
        self.bar.close()


def _clusters(run_dir: Path, features: HeadFeatures, k: int, method: str, seed: int, do_sweep: bool,
              progress: bool) -> tuple[dict, list[str]]:
    """RUN/clusters.json's content, clustering now (and saving it) when the run has none; and notes on it."""
    if (run_dir / CLUSTERS_FILE).is_file():
        data = load_clusters(run_dir, (features.n_layers, features.n_heads), complete=True,
                             feature_names=features.names)
        return data, []
    c = cluster(features, k=k, method=method, seed=seed)
    rows = sweep(features, method=method, seed=seed, progress=progress) if do_sweep else None
    over = stability_over_seeds(features, seed=seed, first=c, k=k, method=method)
    save_clusters(run_dir, c, features, rows, over)
    return load_clusters(run_dir), [f"{CLUSTERS_FILE} was missing; clustered now with k = {k}, method {method}, "
                                    f"seed {seed}."]


@dataclass
class Section:
    """One section of the page: `id` (its anchor), `title` (in the table of contents and its heading) and `body`
    (HTML). A function `(report) -> Section | None` in `SECTIONS` adds one; None leaves it out."""

    id: str
    title: str
    body: str

    def html(self) -> str:
        return f'<section id="{esc(self.id)}"><h2>{esc(self.title)}</h2>{self.body}</section>'


class Report:
    """What every section reads: the run, its features, clusters, distances, attached results, figures saver."""

    def __init__(self, run_dir: Path, features: HeadFeatures, data: dict, save: _FigureSaver, *, seed: int,
                 attached: Attached, examples: int = 0, texts=None, model=None):
        self.run_dir, self.features, self.data, self.save, self.seed = run_dir, features, data, save, seed
        self.attached, self.n_examples, self.texts, self.model = attached, examples, texts, model
        self.type_names = [c["type"] for c in data["clusters"]]
        self.colors = figs.type_colors(self.type_names)
        self.grid = label_grid(data)
        self.labels = self.grid.ravel()
        L, H = features.n_layers, features.n_heads
        self.head_ids = [f"L{m // H}H{m % H}" for m in range(L * H)]
        self.docs = docs_base()
        self.distances = HeadDistances.load(run_dir) if (run_dir / DISTANCES_FILE).is_file() else None
        if self.distances is not None and self.distances.total.shape[0] != L * H:
            raise AttnkitError(f"{run_dir / DISTANCES_FILE} has {self.distances.total.shape[0]} heads, the run {L * H}")
        self.maps = []  # AttentionMaps of the example texts (examples > 0)
        self.notes: list[str] = []

    def swatch(self, type_name: str) -> str:
        return f'<span class="swatch" style="background:{self.colors[type_name]}"></span>'

    def feat(self, name: str) -> str:
        return feature_link(name, self.docs)

    def doc_mark(self, name: str) -> str:
        """A small link to the definition of feature `name` (beside a name that does something else on click)."""
        return (f'<a class="doc" href="{esc(feature_doc(name, self.docs))}" title="{esc(describe_feature(name))}">'
                "?</a>")

    def rel(self, path) -> str:
        """`path` relative to the report (for links)."""
        return os.path.relpath(Path(path).resolve(), self.run_dir.resolve())


# --- the findings ------------------------------------------------------------------------------------------------
def _types_finding(r: Report) -> str:
    st = r.data["stability"]
    rows = []
    for c in r.data["clusters"]:
        p = c["profile"] or {}
        rows.append((r.swatch(c["type"]) + esc(c["type"]), c["n_heads"], fmt(c["share"]), fmt(p.get("special")),
                     fmt(p.get("near_r")), fmt(p.get("far_r"))))
    text = (f"<p>{len(r.type_names)} head types (k = {st['k']}): stability <b>{fmt(st['stability'])}</b> (share of "
            f"heads labelled the same by all {st['n_stability']} fits on random halves of the heads), silhouette "
            f"{fmt(st['silhouette'])}.")
    over = st.get("over_seeds")
    if over:
        text += (f" Over {over['n_seeds']} seeds ({over['seeds'][0]}–{over['seeds'][-1]}): mean "
                 f"<b>{fmt(over['mean'])}</b>, range {fmt(over['min'])}–{fmt(over['max'])}.")
    text += "</p>"
    judged = run_stability(r.data)
    if judged is not None and judged < STABILITY_WARN:
        text += (f'<p class="warn"><b>Warning:</b> stability {fmt(judged)} is below {STABILITY_WARN}: these head '
                 "types are not reliable (another k or other features may group the heads differently).</p>")
    return "<h3>Head types</h3>" + text + table(
        ["type", "heads", "share", "special", "near_r", "far_r"], rows) + (
        '<p class="note">special = weight on [CLS] + [SEP] + comma + period; near_r, far_r = shares of the remaining '
        "weight on the token itself and keys closer than n/8, and on keys at least n/4 away (docs/analysis.md, "
        "\"Naming the types\").</p>")


def _sink_finding(r: Report) -> str:
    from . import summaries as sm

    f, L, H = r.features, r.features.n_layers, r.features.n_heads
    items = []
    for label, names in sm.SPECIAL_GROUPS:
        if not all(n in f.names for n in names):
            continue
        v = sum(f.feature(n) for n in names)
        per_layer = v.mean(1)
        l_top, (hl, hh) = int(per_layer.argmax()), np.unravel_index(int(v.argmax()), v.shape)
        above = int((v > sm.SPECIAL_MIN).sum())
        items.append(f"<li><b>{esc(label)}</b>: {v.mean():.2f} of the weight on average over the {L * H} heads, most "
                     f"in layer {l_top} ({per_layer[l_top]:.2f}); {above} head(s) above {sm.SPECIAL_MIN}, the "
                     f"strongest L{hl}H{hh} ({v[hl, hh]:.2f}).</li>")
    if not items:
        return ""
    special = [n for n in ("cls", "sep", "comma", "period") if n in f.names]
    total = sum(f.feature(n) for n in special)
    majority = int((total > 0.5).sum())
    return ("<h3>The attention sink</h3><p>" + f"{majority} of {L * H} heads put more than half their weight on "
            f"{', '.join(special)} (the tokens that draw vertical stripes in a map).</p><ul>" + "".join(items)
            + "</ul>")


def _papers_finding(r: Report) -> str:
    from . import summaries as sm

    try:
        notes = sm.paper_differences(r.features)
        th = sm.threshold_heads(r.features)
        summ = sm.layer_summaries(r.features)
    except AttnkitError as exc:
        return f'<p class="note">Comparison with the papers skipped: {esc(exc)}</p>'
    html_ = "<h3>What differs from the papers</h3>" + (
        "<ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>" if notes else
        '<p class="note">No departure from Clark et al.\'s main findings was detected by the checks in '
        "attnkit.analysis.summaries.</p>")
    cuts = {"previous token": f"prev > {sm.PREV_NEXT_MIN}", "next token": f"next > {sm.PREV_NEXT_MIN}",
            "[CLS]": f"cls > {sm.SPECIAL_MIN}", "[SEP]": f"sep > {sm.SPECIAL_MIN}",
            "punctuation": f"comma + period > {sm.SPECIAL_MIN}",
            "broad": f"entropy > {sm.BROAD_FRACTION} · ln n = {sm.BROAD_FRACTION * summ['uniform_entropy']:.2f}"}
    rows = [(esc(k), esc(cuts[k]), len(v), esc(", ".join(f"L{x['layer']}H{x['head']} ({x['value']:.2f})" for x in v)
                                              or "none")) for k, v in th.items()]
    return html_ + "<h3>Heads above the papers' thresholds</h3>" + table(
        ["attention to", "threshold", "heads", "which (largest first)"], rows, left=(0, 1, 3))


def _attached_findings(r: Report) -> str:
    a, out = r.attached, []
    if a.patterns is not None:
        ov = a.patterns["data"].get("overall", {})
        out.append("<li>Pattern classes over all (example, head): " + ", ".join(
            f"{esc(c)} {100 * ov.get(c, 0):.1f}%" for c in a.patterns["classes"]) + ' (<a href="#patterns">more</a>).'
            "</li>")
    if a.probe is not None:
        p = a.probe
        gain = p["acc"].reshape(-1, len(p["relations"])).max(0) - p["baseline"]
        best = [(p["relations"][j], gain[j]) for j in np.argsort(-gain)[:3] if p["relations"][j] != "(all)"]
        out.append("<li>Syntax: the relations some head tracks best over the offset baseline: " + ", ".join(
            f"{esc(rel)} (+{g:.2f})" for rel, g in best) + ' (<a href="#probe">more</a>).</li>')
    for ab in a.ablations:
        if "delta" in ab and np.isfinite(ab["delta"]).any():
            m = int(np.nanargmin(ab["delta"]))
            out.append(f"<li>Ablation ({esc(ab['path'].name)}): disabling L{m // r.features.n_heads}H"
                       f"{m % r.features.n_heads} alone changes {esc(ab['metric'])} the most "
                       f"({np.nanmin(ab['delta']):+.2f}) (<a href=\"#ablation\">more</a>).</li>")
    return ("<h3>Other results of this run</h3><ul>" + "".join(out) + "</ul>") if out else ""


def findings(r: Report) -> Section:
    return Section("findings", "Findings", _types_finding(r) + _sink_finding(r) + _papers_finding(r)
                   + _attached_findings(r))


# --- the head explorer --------------------------------------------------------------------------------------------
def explorer(r: Report) -> Section:
    L, H = r.features.n_layers, r.features.n_heads
    options = '<option value="type">type</option>' + "".join(
        f'<option value="{esc(n)}">{esc(n)}</option>' for n in r.features.names)
    head = "<tr><th></th>" + "".join(f"<th>H{h}</th>" for h in range(H)) + "</tr>"
    body = "".join(f"<tr><th>L{l}</th>" + "".join(f'<td data-m="{l * H + h}" data-head="L{l}H{h}"></td>'
                                                   for h in range(H)) + "</tr>" for l in range(L))
    legend = " ".join(f"{r.swatch(t)}{esc(t)}" for t in r.type_names)
    grid = (f'<div><label>colour by <select id="grid-colour">{options}</select></label>'
            f'<table id="grid"><thead>{head}</thead><tbody>{body}</tbody></table>'
            f'<p class="note">{legend}</p><p class="note" id="grid-legend"></p></div>')
    return Section("explorer", "Head explorer",
                   '<p class="note">Click a head (rows: layers, columns: heads) to see its panel; the address '
                   "(#L2H5) keeps the choice.</p>" + f'<div class="explorer">{grid}<div id="panel"></div></div>')


# --- figures ------------------------------------------------------------------------------------------------------
def types_figures(r: Report) -> Section:
    saved = r.save(figs.type_share_per_layer(r.grid, r.type_names), "type_share_per_layer")
    html_ = img(saved, "Head types per layer (cf. Guan et al. Fig. 3).")
    saved = r.save(figs.distance_boxplots(r.features, r.labels, r.type_names), "distance_boxplots")
    html_ += img(saved, "Distance features of the heads of each type (cf. Guan et al. Fig. 1, bottom).")
    rows = r.data["stability"].get("sweep")
    if rows:
        seeded = all("stability_mean" in x for x in rows)
        srows = [(x["k"], fmt(x["stability"])
                  + (f" (mean {fmt(x['stability_mean'])}, {fmt(x['stability_min'])}–{fmt(x['stability_max'])} "
                     f"over {x.get('n_seeds', '?')} seeds)" if seeded else ""),
                  fmt(x["silhouette"]), esc(", ".join(x["type_names"]))) for x in rows]
        saved = r.save(figs.stability_sweep(rows), "stability_sweep")
        html_ += ("<h3>Stability over k</h3>"
                  + table(["k", "stability", "silhouette", "types"], srows, left=(3,), sortable=True)
                  + img(saved, "Stability and silhouette against k."))
    return Section("types", "Head types per layer", html_)


def head_maps(r: Report) -> Section:
    from .embedding import mds, tsne

    L, H = r.features.n_layers, r.features.n_heads
    X = head_matrix(r.features, r.data["settings"]["features"])
    saved = r.save(figs.tsne_scatter(tsne(X, seed=r.seed), r.labels, r.type_names, r.head_ids), "tsne_types")
    html_ = img(saved, "t-SNE of the clustered features, coloured by type (cf. Guan et al. Fig. 2).")
    dist = r.distances
    if dist is None:
        return Section("maps", "Maps of heads", html_ + (
            f'<p class="note">No {DISTANCES_FILE} in this run: the MDS map of Jensen-Shannon distances (and the '
            f"nearest heads by divergence in the head panel) needs `attnkit distances {esc(r.run_dir)}`.</p>"))
    layers = np.repeat(np.arange(L), H)
    saved = r.save(figs.mds_maps(mds(dist.per_token, seed=r.seed), r.labels, r.type_names, layers, r.head_ids),
                   "mds_js")
    smoothed = f", rows smoothed with ε = {dist.meta['smoothing']:g}" if dist.meta.get("smoothing") else ""
    html_ += img(saved, f"Metric MDS of the Jensen-Shannon divergences between heads (mean per token over "
                        f"{dist.n_rows} query tokens{smoothed}), coloured by type and by layer (cf. Clark et al. "
                        "Fig. 6).")
    pt = dist.per_token
    within = pt[(layers[:, None] == layers[None, :]) & ~np.eye(L * H, dtype=bool)].mean()
    across = pt[layers[:, None] != layers[None, :]].mean()
    return Section("maps", "Maps of heads", html_ + (
        f'<p class="note">Mean JS divergence per token: between heads of the same layer {within:.4f}, between '
        f"heads of different layers {across:.4f}.</p>"))


def heatmaps(r: Report) -> Section:
    from . import summaries as sm

    saved = r.save(figs.feature_heatmaps(r.features), "feature_heatmaps")
    html_ = img(saved, "Per layer × head means over the corpus (cf. Clark et al. Figs. 2 and 6).")
    try:
        summ = sm.layer_summaries(r.features)
    except AttnkitError:
        return Section("heatmaps", "Features per layer and head", html_)
    saved = r.save(sm.layer_summary_figure(summ), "layer_summaries")
    labels = list(summ["per_layer"])
    rows = [[l] + [fmt(summ["per_layer"][k][l]) for k in labels] for l in range(r.features.n_layers)]
    html_ += "<h3>Per-layer summaries (Clark et al.)</h3>" + img(
        saved, f"Mean attention to [CLS], [SEP] and punctuation per layer (dots: heads), and entropy with the uniform "
               f"baseline ln n = {summ['uniform_entropy']:.2f} (n = {summ['n_mean_tokens']:.1f} mean tokens per "
               "sample).") + table(["layer"] + labels, rows, left=(), sortable=True)
    return Section("heatmaps", "Features per layer and head", html_)


def example_section(r: Report) -> Section | None:
    if not r.n_examples:
        return None
    if r.texts is None or r.model is None:
        raise AttnkitError("example attention maps need the corpus texts and the model")
    mdl, tok = r.model
    idx = _example_texts(r.texts, r.n_examples, tok)
    picks = pick_example_heads(r.features, r.data, per_type=r.n_examples, n_texts=len(idx))
    picks = [(t, l, h, idx[j]) for t, l, h, j in picks]
    saved = r.save(figs.attention_examples(example_maps(mdl, tok, r.texts, picks)), "attention_examples")
    return Section("examples", "Example attention maps", img(
        saved, "The heads nearest to each type's centroid on corpus samples (rows: types; rows of a map: queries, "
               "columns: keys). Every head's maps of these texts are in its panel of the head explorer."))


# --- results of other commands ----------------------------------------------------------------------------------
def _embed_png(path: Path, caption: str) -> str:
    if not path.is_file():
        return ""
    return img({"png_bytes": path.read_bytes()}, caption)


def patterns_section(r: Report) -> Section | None:
    p = r.attached.patterns
    if p is None:
        return None
    d = p["data"]
    rows = [[f"L{l}"] + [f"{100 * d['per_layer'][c][l]:.1f}%" for c in p["classes"]] for l in range(d["n_layers"])]
    rows.append(["all"] + [f"{100 * d['overall'][c]:.1f}%" for c in p["classes"]])
    rules = ", ".join(f"{k} {v}" for k, v in (d.get("rules") or {}).items())
    return Section("patterns", "Pattern classes (Kovaleva et al.)", table(["layer"] + p["classes"], rows, sortable=True)
                   + _embed_png(r.run_dir / FIGURES_DIR / "pattern_types.png", "Pattern classes per layer.")
                   + f'<p class="note">{d["n_examples"]} examples; rules: {esc(rules)} (docs/patterns.md). Each '
                     "head's shares are in its panel.</p>")


def probe_section(r: Report) -> Section | None:
    p = r.attached.probe
    if p is None:
        return None
    rels = p["summary"].get("relations") or {}
    rows = []
    for j, rel in enumerate(p["relations"]):
        grid = p["acc"][..., j]
        l, h = np.unravel_index(int(grid.argmax()), grid.shape)
        info = rels.get(rel, {})
        rows.append((esc(rel), p["counts"][j], f"L{l}H{h}", fmt(float(grid[l, h])), fmt(float(p["baseline"][j])),
                     f"{float(grid[l, h] - p['baseline'][j]):+.3f}", esc(info.get("baseline_offset", "–"))))
    src = r.rel(p["path"])
    return Section("probe", "Syntax probes (Clark et al.)", table(
        ["relation", "dependencies", "best head", "accuracy", "baseline", "over baseline", "baseline offset"], rows,
        sortable=True) + _embed_png(p["heatmap"], "Accuracy over the baseline per head (probe_heatmap.png).")
        + f'<p class="note">From <a href="{esc(src)}">{esc(src)}</a> ({esc(p["summary"].get("model", ""))}); '
          "accuracy in the better direction (docs/probes.md). Each head's accuracy per relation is in its panel.</p>")


def ablation_section(r: Report) -> Section | None:
    if not r.attached.ablations:
        return None
    html_ = ""
    for a in r.attached.ablations:
        key = f"delta_{a['metric']}"
        rows = [(esc(x.get("setting", "")), fmt(x.get(a["metric"]), 2), fmt(x.get(key), 2),
                 fmt(x.get(f"{key}_lo"), 2), fmt(x.get(f"{key}_hi"), 2)) for x in a["rows"]]
        src = r.rel(a["path"])
        html_ += (f"<h3>{esc(a['experiment'])}: {esc(a['meta'].get('task', ''))} ({esc(a['meta'].get('model', ''))})"
                  "</h3>" + table(["setting", a["metric"], f"Δ {a['metric']}", "interval low", "interval high"], rows,
                                  sortable=True)
                  + _embed_png(a["figure"], f"{a['experiment']} ({a['figure'].name}).")
                  + f'<p class="note">From <a href="{esc(src)}">{esc(src)}</a>.</p>')
    return Section("ablation", "Ablations", html_)


def links_section(r: Report) -> Section | None:
    if not r.attached.links:
        return None
    rows = [(esc(what), f'<a href="{esc(r.rel(path))}">{esc(r.rel(path))}</a>', esc(why))
            for what, path, why in r.attached.links]
    return Section("elsewhere", "Results not shown here", table(["result", "file", "why not shown"], rows,
                                                                left=(0, 1, 2)))


# --- tables, glossary, settings -----------------------------------------------------------------------------------
def tables(r: Report) -> Section:
    features, names = r.features, r.features.names
    L, H = features.n_layers, features.n_heads
    show = [n for n in ("cls", "sep", "comma", "period", "self", "prev", "next", "entropy", "max", "intra",
                        "inter", "cls_entropy") if n in names]
    trows = []
    for l in range(L):
        for h in range(H):
            t = r.type_names[r.grid[l, h]]
            trows.append([l, h, r.swatch(t) + esc(t)] + [fmt(float(features.mean[l, h, names.index(n)])) for n in show])
    wins = distance_feature_names(names)
    drows = [[l, h] + [fmt(float(features.mean[l, h, names.index(n)])) for n in wins] for l in range(L)
             for h in range(H)]
    return Section("tables", "Features per head", (
        f"<details><summary>Corpus means per head ({L * H} rows; click a column to sort)</summary>"
        '<div class="scroll">' + _linked_table(r, ["layer", "head", "type"], show, trows, left=(2,))
        + "</div></details>"
        "<details><summary>Distance buckets per head</summary><div class=\"scroll\">"
        + _linked_table(r, ["layer", "head"], wins, drows, left=()) + "</div></details>"))


def _linked_table(r: Report, first: list[str], features: list[str], rows, left) -> str:
    """A sortable table whose feature columns link their names to the definitions."""
    html_ = table(first + features, rows, left=left, sortable=True)
    for n in features:  # the name sorts, the mark after it opens the definition
        html_ = html_.replace(f"<th class=\"\">{esc(n)}</th>", f"<th class=\"\">{esc(n)}{r.doc_mark(n)}</th>", 1)
    return html_


def glossary_section(r: Report) -> Section:
    return Section("glossary", "Glossary of features", glossary(r.features.names, r.docs))


def settings(r: Report) -> Section:
    rows = [(esc(key), value_html(v)) for key, v in r.features.meta.items()]
    rows.append(("clustering", value_html(r.data["settings"])))
    return Section("settings", "Settings and versions",
                   "<details><summary>How this run was made (meta.json) and clustered (clusters.json)</summary>"
                   + table(["setting", "value"], rows, left=(0, 1)) + "</details>")


# The sections in page order. Other analyses add theirs here (a function (report) -> Section | None), e.g.
# SECTIONS.insert(SECTIONS.index(heatmaps) + 1, my_section).
SECTIONS: list[Callable[[Report], Section | None]] = [
    findings, explorer, types_figures, head_maps, heatmaps, example_section, patterns_section, probe_section,
    ablation_section, links_section, tables, glossary_section, settings]


def _panel(r: Report) -> dict:
    """The head panel's data (attnkit/analysis/head_panel.py)."""
    per_sample = r.features.per_sample
    row_texts, notes, ext = {}, {}, None
    if per_sample is not None:
        ext = extremes(per_sample, r.features.names)
        rows = {int(x) for e in ext.values() for side in ("top", "bottom") for x in e[side].ravel()}
        row_texts, why = texts_of_rows(r.run_dir, r.features.meta, rows)
        if why:
            r.notes.append(why)
    notes["examples"] = ("No per_sample.npy in this run: `attnkit extract --per-sample` keeps every sample's "
                         "features, from which the panel shows each head's top and bottom examples.")
    notes["maps"] = ("No example maps: `attnkit report RUN --examples N` draws every head's maps of N corpus texts "
                     "(it needs the run's model and corpus).")
    if r.n_examples and r.texts is not None and r.model is not None:
        from ..engine.maps import attention_maps

        idx = _example_texts(r.texts, min(r.n_examples, MAX_EMBEDDED_MAP_TEXTS), r.model[1])
        r.maps = [attention_maps(r.texts[i], r.model, max_length=64) for i in idx]
    docs = {"links": {n: feature_doc(n, r.docs) for n in r.features.names},
            "defs": {n: describe_feature(n) for n in r.features.names}}
    return panel_data(r.features, r.data, r.colors, distances=r.distances, extremes=ext,
                      row_texts=row_texts, maps=r.maps, attached=r.attached, docs=docs, notes=notes)


def build_report(run_dir, *, k: int = 4, method: str = "kmeans", seed: int = 0, examples: int = 0,
                 texts=None, model=None, do_sweep: bool = True, title: str | None = None, svg: bool = True,
                 progress: bool = False, include=()) -> Path:
    """Write RUN/report.html (and RUN/figures/*.png|svg). Clusters come from RUN/clusters.json when it
    exists (otherwise they are computed with k/method/seed and saved, with a k = 2..8 sweep);
    the MDS map needs RUN/distances.npz. `examples` > 0 draws that many example maps per type from
    `texts` with `model` (a (model, tokenizer) pair), and puts every head's maps of those texts in its panel.
    `include`: directories of `attnkit probe` / `attnkit ablate` results to show beside the run's own.
    `svg=False` skips the SVG copies of the figures. `progress` shows a bar on stderr, one step per figure."""
    run_dir = Path(run_dir)
    features = HeadFeatures.load(run_dir)
    save = _FigureSaver(run_dir / FIGURES_DIR, svg, progress)
    try:
        data, notes = _clusters(run_dir, features, k, method, seed, do_sweep, progress)
        attached = find_attached(run_dir, (features.n_layers, features.n_heads), include)
        report = Report(run_dir, features, data, save, seed=seed, attached=attached, examples=examples, texts=texts,
                        model=model)
        # types, box plots, t-SNE, heatmaps, per-layer summaries; the sweep, MDS and examples when they are drawn
        save.expect(5 + bool(data["stability"].get("sweep")) + (report.distances is not None) + (examples > 0))
        sections = [s for s in (build(report) for build in SECTIONS) if s is not None]
        panel = _panel(report)
    finally:
        save.close()
    if weighting_of(features.meta) == "norm":
        notes.insert(0, NORM_NOTE)
    title = title or f"attnkit report: {run_dir.name}" + (" (norm-weighted)" if weighting_of(features.meta) == "norm"
                                                          else "")
    subtitle = (f"{esc(features.meta.get('model', ''))} — {features.n_samples} samples, {features.n_tokens} tokens, "
                f"{features.n_layers} layers × {features.n_heads} heads; generated "
                f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}")
    out = run_dir / REPORT_FILE
    html_ = page(title, subtitle, notes + report.notes, [(s.id, s.title) for s in sections],
                 [s.html() for s in sections], panel)
    atomic_write(out, lambda f: f.write(html_.encode("utf-8")))
    return out


__all__ = ["FIGURES_DIR", "REPORT_FIGURES", "REPORT_FILE", "SECTIONS", "Report", "Section", "build_report",
           "example_maps", "pick_example_heads", "report_figures"]
