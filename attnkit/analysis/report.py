"""RUN/report.html: one self-contained page (figures embedded as base64 PNG, no external resources)
with the run's settings, the tables (features per head, clusters, stability) and the figures.
The figures are also written as PNG and SVG under RUN/figures/.
"""
from __future__ import annotations

import base64
import datetime as _dt
import html
from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from ..features import weighting_of
from ..plotting import save_figure
from ..run.clusters import label_grid, load_clusters, run_stability
from ..run.distances import HeadDistances
from ..run.files import CLUSTERS_FILE, DISTANCES_FILE, FIGURES_DIR, REPORT_FILE
from ..run.head_features import HeadFeatures
from ..run.outputs import atomic_write
from . import figures as figs
from .clustering import STABILITY_WARN, cluster, distance_feature_names, head_matrix, stability_over_seeds, sweep
from .results import save_clusters

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1200px;
color:#222;line-height:1.45;padding:0 16px}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:12px;margin:.6em 0}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f3f3f3}
td.l,th.l{text-align:left}figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:13px;color:#555}.note{color:#666;font-size:13px}.swatch{display:inline-block;
width:.9em;height:.9em;border-radius:2px;vertical-align:middle;margin-right:4px}
details{margin:.6em 0}summary{cursor:pointer;font-weight:600}
.scroll{max-height:520px;overflow:auto;display:inline-block;border:1px solid #eee}
.warn{color:#a40000}
table.nested{margin:0;font-size:11px}table.nested td{border-color:#e3e3e3;padding:1px 5px;vertical-align:top}
td{vertical-align:top}
"""


NORM_NOTE = ("Norm-weighted run (attnkit extract --weighting norm; Kobayashi et al. 2020): every feature describes "
             "the attention weights scaled per key by the norm of the transformed key vector ‖f_h(x_t)‖ and "
             "renormalised per row (docs/features.md), not the attention weights themselves. Jensen-Shannon "
             "distances and example maps show attention weights.")


def _e(x) -> str:
    return html.escape(str(x))


def _fmt(v, digits=3) -> str:
    if v is None:
        return "–"
    if isinstance(v, (float, np.floating)):
        return "–" if np.isnan(v) else f"{v:.{digits}f}"
    return _e(v)


def _table(header, rows, left=(0,), cls: str = "") -> str:
    """An HTML table; the cells of `rows` are HTML already. `header` None: no header row."""
    head = ""
    if header is not None:
        th = "".join(f'<th class="{"l" if i in left else ""}">{_e(h)}</th>' for i, h in enumerate(header))
        head = f"<thead><tr>{th}</tr></thead>"
    body = []
    for r in rows:
        body.append("<tr>" + "".join(f'<td class="{"l" if i in left else ""}">{c}</td>' for i, c in enumerate(r))
                    + "</tr>")
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}>{head}<tbody>{''.join(body)}</tbody></table>"


def _value_html(v) -> str:
    """A setting's value as HTML: dicts as nested two-column tables, lists of plain values joined by
    commas, lists with dicts or lists as one nested table row per item; None as a dash."""
    if isinstance(v, dict):
        if not v:
            return "–"
        return _table(None, [(_e(k), _value_html(x)) for k, x in v.items()], left=(0, 1), cls="nested")
    if isinstance(v, (list, tuple)):
        if not v:
            return "–"
        if any(isinstance(x, (dict, list, tuple)) for x in v):
            return _table(None, [(i, _value_html(x)) for i, x in enumerate(v)], left=(1,), cls="nested")
        return _e(", ".join("–" if x is None else str(x) for x in v))
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return _e(v)


def _img(saved: dict, caption: str) -> str:
    b64 = base64.b64encode(saved["png_bytes"]).decode("ascii")
    return (f'<figure><img alt="{_e(caption)}" src="data:image/png;base64,{b64}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def example_maps(model, tokenizer, texts, picks, *, max_length: int = 64) -> list[dict]:
    """Attention maps of chosen heads for a few texts, recomputed with the reference weights.

    `picks`: list of (type name, layer, head, text index). One forward per distinct text; the weights
    come from `attnkit.reference.attention_weights` on the layer's q and k (via the Runtime observers).
    """
    import torch

    from ..models import instrument, observing
    from ..reference import attention_weights
    from ..tokens import Encoder

    instrument(model)
    enc = Encoder(tokenizer, max_length=max_length)
    out = []
    by_text: dict[int, list] = {}
    for p in picks:
        by_text.setdefault(p[3], []).append(p)
    device = next(model.parameters()).device
    for ti, ps in by_text.items():
        batch = enc([texts[ti]]).to(device)
        captured: dict[int, torch.Tensor] = {}

        def obs(layer, q, k, lengths, scaling, _captured=captured):
            scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
            _captured[int(layer)] = attention_weights(q.detach(), k.detach(), lengths.long(), float(scaling))[0].cpu()

        with observing(model, [obs]), torch.inference_mode():
            model(**batch.inputs)
        n = int(batch.lengths[0])
        tokens = tokenizer.convert_ids_to_tokens(batch.inputs["input_ids"][0, :n].tolist())
        for t, layer, head, _ in ps:
            out.append({"type": t, "layer": layer, "head": head, "tokens": tokens,
                        "weights": captured[layer][head, :n, :n].numpy()})
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


def _clark_section(features, save) -> str:
    """Clark et al. Fig. 2-style per-layer summaries, heads above the papers' thresholds, departures."""
    from . import summaries as sm

    summ = sm.layer_summaries(features)
    saved = save(sm.layer_summary_figure(summ), "layer_summaries")
    labels = list(summ["per_layer"])
    rows = [[l] + [_fmt(summ["per_layer"][k][l]) for k in labels] for l in range(features.n_layers)]
    html_ = ("<h2>Per-layer summaries (Clark et al.)</h2>" + _img(
        saved, f"Mean attention to [CLS], [SEP] and punctuation per layer (dots: heads), and entropy with the "
               f"uniform baseline ln n = {summ['uniform_entropy']:.2f} (n = {summ['n_mean_tokens']:.1f} mean "
               "tokens per sample).") + _table(["layer"] + labels, rows, left=()))
    th = sm.threshold_heads(features)
    cuts = {"previous token": f"> {sm.PREV_NEXT_MIN}", "next token": f"> {sm.PREV_NEXT_MIN}",
            "[CLS]": f"> {sm.SPECIAL_MIN}", "[SEP]": f"> {sm.SPECIAL_MIN}", "punctuation": f"> {sm.SPECIAL_MIN}",
            "broad": f"entropy > {sm.BROAD_FRACTION} · ln n = {sm.BROAD_FRACTION * summ['uniform_entropy']:.2f}"}
    trows = [(_e(k), _e(cuts[k]), len(v), _e(", ".join(f"L{r['layer']}H{r['head']} ({r['value']:.2f})" for r in v)
                                           or "none"))
             for k, v in th.items()]
    html_ += "<h3>Heads above the papers' thresholds</h3>" + _table(["attention to", "threshold", "heads", "which"],
                                                                      trows, left=(0, 1, 3))
    notes = sm.paper_differences(features)
    html_ += "<h3>Differs from the paper</h3>" + (
        "<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>" if notes else
        '<p class="note">No departure from Clark et al.\'s main findings was detected by the checks in '
        "attnkit.analysis.summaries.</p>")
    return html_


class _FigureSaver:
    """Saves the report's figures into RUN/figures (PNG, and SVG unless told not to), one progress step each."""

    def __init__(self, directory, svg: bool, progress: bool):
        from tqdm.auto import tqdm

        self.directory, self.svg = directory, svg
        self.bar = tqdm(desc="report", unit="figure", disable=not progress, dynamic_ncols=True)

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


class _Report:
    """What every section of the report reads: the features, the clusters, their colours and labels."""

    def __init__(self, run_dir: Path, features: HeadFeatures, data: dict, save: _FigureSaver):
        self.run_dir, self.features, self.data, self.save = run_dir, features, data, save
        self.type_names = [c["type"] for c in data["clusters"]]
        self.colors = figs.type_colors(self.type_names)
        self.grid = label_grid(data)
        self.labels = self.grid.ravel()
        L, H = features.n_layers, features.n_heads
        self.head_ids = [f"L{m // H}H{m % H}" for m in range(L * H)]

    def swatch(self, type_name: str) -> str:
        return f'<span class="swatch" style="background:{self.colors[type_name]}"></span>'

    def settings(self) -> str:
        rows = [(_e(key), _value_html(v)) for key, v in self.features.meta.items()]
        rows.append(("clustering", _value_html(self.data["settings"])))
        return "<h2>Run and settings</h2>" + _table(["setting", "value"], rows, left=(0, 1))

    def types(self) -> str:
        st = self.data["stability"]
        crow = []
        for c in self.data["clusters"]:
            p = c["profile"] or {}
            crow.append((self.swatch(c["type"]) + _e(c["type"]), c["n_heads"], _fmt(c["share"]),
                         _fmt(p.get("special")), _fmt(p.get("cls")), _fmt(p.get("sep")), _fmt(p.get("punct")),
                         _fmt(p.get("near_r")), _fmt(p.get("far_r"))))
        text = (f"<p>k = {st['k']}: stability <b>{_fmt(st['stability'])}</b> (share of heads given the same "
                f"label by all {st['n_stability']} fits on random halves of the heads, labels matched by the "
                f"Hungarian method), silhouette {_fmt(st['silhouette'])}.</p>")
        over = st.get("over_seeds")
        if over:
            text += (f"<p>Over {over['n_seeds']} seeds ({over['seeds'][0]}–{over['seeds'][-1]}): stability mean "
                     f"<b>{_fmt(over['mean'])}</b>, range {_fmt(over['min'])}–{_fmt(over['max'])}.</p>")
        judged = run_stability(self.data)
        if judged is not None and judged < STABILITY_WARN:
            text += (f'<p class="warn"><b>Warning:</b> stability {_fmt(judged)} is below {STABILITY_WARN}: the '
                     "head types below are not reliable (another k or other features may group the heads "
                     "differently).</p>")
        html_ = "<h2>Head types</h2>" + text + _table(
            ["type", "heads", "share", "special", "cls", "sep", "punct", "near_r", "far_r"], crow) + (
            '<p class="note">special = weight on [CLS]+[SEP]+comma+period; near_r, far_r = shares of the '
            "remaining weight on self + keys closer than n/8, and on keys at least n/4 away (naming rules in "
            "attnkit.analysis.naming).</p>")
        saved = self.save(figs.type_share_per_layer(self.grid, self.type_names), "type_share_per_layer")
        html_ += _img(saved, "Head types per layer (cf. Guan et al. Fig. 3).")
        saved = self.save(figs.distance_boxplots(self.features, self.labels, self.type_names), "distance_boxplots")
        return html_ + _img(saved, "Distance features of the heads of each type (cf. Guan et al. Fig. 1, bottom).")

    def stability(self) -> str:
        rows = self.data["stability"].get("sweep")
        if not rows:
            return ""
        seeded = all("stability_mean" in r for r in rows)
        srows = [(r["k"], _fmt(r["stability"])
                  + (f" (mean {_fmt(r['stability_mean'])}, {_fmt(r['stability_min'])}–{_fmt(r['stability_max'])} "
                     f"over {r.get('n_seeds', '?')} seeds)" if seeded else ""),
                  _fmt(r["silhouette"]), _e(", ".join(r["type_names"])))
                 for r in rows]
        saved = self.save(figs.stability_sweep(rows), "stability_sweep")
        return ("<h2>Stability over k</h2>" + _table(["k", "stability", "silhouette", "types"], srows, left=(3,))
                + _img(saved, "Stability and silhouette against k."))

    def maps(self, seed: int) -> str:
        from .embedding import mds, tsne

        features, L, H = self.features, self.features.n_layers, self.features.n_heads
        X = head_matrix(features, self.data["settings"]["features"])
        saved = self.save(figs.tsne_scatter(tsne(X, seed=seed), self.labels, self.type_names, self.head_ids),
                          "tsne_types")
        html_ = "<h2>Maps of heads</h2>" + _img(
            saved, "t-SNE of the clustered features, coloured by type (cf. Guan et al. Fig. 2).")
        if not (self.run_dir / DISTANCES_FILE).is_file():
            return html_ + (f'<p class="note">No {DISTANCES_FILE} in this run: the MDS map of Jensen-Shannon '
                            f"distances needs `attnkit distances {_e(self.run_dir)} --corpus ...`.</p>")
        dist = HeadDistances.load(self.run_dir)
        if dist.total.shape[0] != L * H:
            raise AttnkitError(f"{self.run_dir / DISTANCES_FILE} has {dist.total.shape[0]} heads, the run {L * H}")
        layers = np.repeat(np.arange(L), H)
        saved = self.save(figs.mds_maps(mds(dist.per_token, seed=seed), self.labels, self.type_names, layers,
                                        self.head_ids), "mds_js")
        smoothed = f", rows smoothed with ε = {dist.meta['smoothing']:g}" if dist.meta.get("smoothing") else ""
        html_ += _img(saved, f"Metric MDS of the Jensen-Shannon divergences between heads (mean per token over "
                             f"{dist.n_rows} query tokens{smoothed}), coloured by type and by layer "
                             f"(cf. Clark et al. Fig. 6).")
        pt = dist.per_token
        within = pt[(layers[:, None] == layers[None, :]) & ~np.eye(L * H, dtype=bool)].mean()
        across = pt[layers[:, None] != layers[None, :]].mean()
        return html_ + (f'<p class="note">Mean JS divergence per token: between heads of the same layer '
                        f"{within:.4f}, between heads of different layers {across:.4f}.</p>")

    def heatmaps(self) -> str:
        saved = self.save(figs.feature_heatmaps(self.features), "feature_heatmaps")
        return "<h2>Features per layer and head</h2>" + _img(
            saved, "Per layer × head means over the corpus (cf. Clark et al. Figs. 2 and 6).")

    def examples(self, examples: int, texts, model) -> str:
        if texts is None or model is None:
            raise AttnkitError("example attention maps need the corpus texts and the model")
        mdl, tok = model
        idx = _example_texts(texts, examples, tok)
        picks = pick_example_heads(self.features, self.data, per_type=examples, n_texts=len(idx))
        picks = [(t, l, h, idx[j]) for t, l, h, j in picks]
        saved = self.save(figs.attention_examples(example_maps(mdl, tok, texts, picks)), "attention_examples")
        return "<h2>Example attention maps</h2>" + _img(
            saved, "The heads nearest to each type's centroid on corpus samples (rows: types; rows of a map: "
                   "queries, columns: keys).")

    def tables(self) -> str:
        features, names = self.features, self.features.names
        L, H = features.n_layers, features.n_heads
        show = [n for n in ("cls", "sep", "comma", "period", "self", "prev", "next", "entropy", "max", "intra",
                            "inter", "cls_entropy") if n in names]
        trows = []
        for l in range(L):
            for h in range(H):
                t = self.type_names[self.grid[l, h]]
                trows.append([l, h, self.swatch(t) + _e(t)]
                             + [_fmt(float(features.mean[l, h, names.index(n)])) for n in show])
        wins = distance_feature_names(names)
        drows = [[l, h] + [_fmt(float(features.mean[l, h, names.index(n)])) for n in wins]
                 for l in range(L) for h in range(H)]
        return ("<h2>Features per head</h2><details><summary>Table of the corpus means per head "
                f"({L * H} rows)</summary><div class=\"scroll\">"
                + _table(["layer", "head", "type"] + show, trows, left=(2,)) + "</div></details>"
                + "<details><summary>Distance buckets per head</summary><div class=\"scroll\">"
                + _table(["layer", "head"] + wins, drows, left=()) + "</div></details>")


def _page(title: str, subtitle: str, notes: list[str], sections: list[str]) -> str:
    note_html = "".join(f'<p class="note">{_e(n)}</p>' for n in notes)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{_e(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1><p class=\"note\">{subtitle}</p>{note_html}"
            + "\n".join(s for s in sections if s) + "</body></html>\n")


def build_report(run_dir, *, k: int = 4, method: str = "kmeans", seed: int = 0, examples: int = 0,
                 texts=None, model=None, do_sweep: bool = True, title: str | None = None, svg: bool = True,
                 progress: bool = False) -> Path:
    """Write RUN/report.html (and RUN/figures/*.png|svg). Clusters come from RUN/clusters.json when it
    exists (otherwise they are computed with k/method/seed and saved, with a k = 2..8 sweep);
    the MDS map needs RUN/distances.npz. `examples` > 0 draws that many example maps per type from
    `texts` with `model` (a (model, tokenizer) pair). `svg=False` skips the SVG copies of the figures.
    `progress` shows a bar on stderr, one step per figure written."""
    run_dir = Path(run_dir)
    features = HeadFeatures.load(run_dir)
    save = _FigureSaver(run_dir / FIGURES_DIR, svg, progress)
    try:
        data, notes = _clusters(run_dir, features, k, method, seed, do_sweep, progress)
        report = _Report(run_dir, features, data, save)
        sections = [report.settings(), report.types(), report.stability(), report.maps(seed), report.heatmaps(),
                    _clark_section(features, save)]
        if examples > 0:
            sections.append(report.examples(examples, texts, model))
        sections.append(report.tables())
    finally:
        save.close()
    if weighting_of(features.meta) == "norm":
        notes.insert(0, NORM_NOTE)
    title = title or f"attnkit report: {run_dir.name}" + (" (norm-weighted)" if weighting_of(features.meta) == "norm"
                                                          else "")
    subtitle = (f"{_e(features.meta.get('model', ''))} — {features.n_samples} samples, {features.n_tokens} tokens, "
                f"{features.n_layers} layers × {features.n_heads} heads; generated "
                f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}")
    out = run_dir / REPORT_FILE
    page = _page(title, subtitle, notes, sections)
    atomic_write(out, lambda f: f.write(page.encode("utf-8")))
    return out


__all__ = ["FIGURES_DIR", "REPORT_FILE", "build_report", "example_maps", "pick_example_heads"]
