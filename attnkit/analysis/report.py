"""RUN/report.html: one self-contained page that opens with what the run found and lets the reader explore every
head (docs/analysis.md, "The report"; the file: docs/files.md).

In page order: the findings (head types and their stability, the attention sink, what differs from the papers,
heads above the papers' thresholds, and the headline of any attached pattern, probe or ablation results; on a
decoder run: the sink heads by first-token mass and how much of it survives norm weighting, the previous-token,
duplicate, induction and retrieval heads of `attnkit detect-heads`, thresholds that apply to causal rows, and the
language-model loss ablations, where a rise of the loss is the harm); the head
explorer (a layer × head grid; a click opens the head's panel below it: features with their spread, type, nearest
heads, top and bottom examples from per_sample.npy, example maps, probe accuracy per relation, pattern shares, the
effect of ablating the head and its layer; attnkit/analysis/head_panel.py, attnkit/data/report.js); the example
inputs (a head view: hover or click a token to see where a head or a layer's heads attend); the figures; the results
of `patterns`, `probe` and `ablate` (attnkit/analysis/attached.py); sortable per-head tables; a glossary of every
feature; settings and versions, folded away. Figures are embedded as base64 PNG and also written as PNG (and SVG)
under RUN/figures/; the data and the small script are embedded too: the page loads nothing and links nothing
outside itself. The HTML comes from Jinja2 templates that escape every value (attnkit/analysis/report_html.py).

Heads removed from a pruned model (meta.json `removed_heads`, NaN features; docs/pruning.md) are greyed out as
"removed" in the grid and left out of every average, map and finding; the page says how many.

Other analyses add sections through `SECTIONS` (see `Section`).
"""
from __future__ import annotations

import datetime as _dt
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from markupsafe import Markup

from ..errors import AttnkitError
from ..features import describe_feature, shown_features, weighting_of
from ..plotting import save_figure
from ..run.clusters import label_grid, load_clusters, run_stability
from ..run.distances import HeadDistances, distances_file
from ..run.files import CLUSTERS_FILE, DISTANCES_FILE, FIGURES_DIR, PER_SAMPLE_FILE, REPORT_FILE
from ..run.head_features import HeadFeatures
from ..run.identity import IDENTITY_FIELD
from ..run.model_dir import is_decoder_meta
from ..run.opened import Run
from ..run.outputs import atomic_write
from ..run.schemas import LOWER_IS_BETTER
from . import figures as figs
from .attached import Attached, find_attached
from .clustering import STABILITY_WARN, distance_feature_names, fit_types, head_matrix
from .head_panel import extremes, panel_data, texts_of_rows
from .naming import (
    DECODER_CLASSES,
    DECODER_DETAILS,
    ENCODER_CLASSES,
    ENCODER_DETAILS,
    class_shares,
)
from .preflight import check_heads, load_run
from .report_html import anchor, figure, fmt, glossary_rows, macros, page, part, value_html
from .results import save_clusters

# The figures the report writes into RUN/figures (a replaced report replaces them).
REPORT_FIGURES = ("type_share_per_layer", "distance_boxplots", "stability_sweep", "tsne_types", "mds_js",
                  "feature_heatmaps", "layer_summaries", "attention_examples", "detected_heads",
                  "attention_distance_by_layer", "cls_attention_maps")
DEFAULT_EXAMPLES = 4  # example inputs whose maps the page embeds (`attnkit report --examples`)
EXAMPLE_MAX_LENGTH = 64  # tokens of an example input at most (fewer when the run was extracted with fewer)
EXAMPLE_MIN_TOKENS = 6  # shorter inputs (a title, an empty line) make poor examples
# The maps of the example inputs take at most this many bytes (uint8, one per weight, all inputs and heads; base64
# in the page adds a third): the shortest inputs first, an input that would exceed it is left out.
MAPS_BUDGET_BYTES = 1_500_000
SINK_MIN = 0.9  # a decoder head with at least this first-token mass is a sink head
DETECTED_MIN = 0.5  # a detect-heads score from which the findings count a head of that kind
TOP_HEADS = 5  # heads named per finding
THRESHOLD_NAMES = 12  # heads named per threshold of the papers (the largest first)


def is_decoder_run(features: HeadFeatures) -> bool:
    """Whether the run measured a decoder (meta.json `model_type`; causal rows: `cls` is the first position's mass,
    no row sees a next token)."""
    return is_decoder_meta(features.meta)


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
    from ..jobs.maps import attention_maps

    maps = {ti: attention_maps(texts[ti], (model, tokenizer), max_length=max_length) for ti in {p[3] for p in picks}}
    return _picked_maps(maps, picks)


def _picked_maps(maps: dict, picks) -> list[dict]:
    return [{"type": t, "layer": layer, "head": head, "tokens": maps[ti].tokens, "weights": maps[ti].head(layer, head)}
            for t, layer, head, ti in picks]


def pick_example_heads(features: HeadFeatures, data: dict, per_type: int = 3, n_texts: int = 1,
                       removed=None) -> list:
    """For each type, the `per_type` heads closest to their cluster's centroid (most typical), removed heads left
    out."""
    feats = data["settings"]["features"]
    X = head_matrix(features, feats)
    H = data["run"]["n_heads"]
    gone = np.zeros(X.shape[0], dtype=bool) if removed is None else np.asarray(removed).ravel()
    picks = []
    for c in data["clusters"]:
        cen = np.array([c["centroid"][f] for f in feats])
        members = [m for m in (h["layer"] * H + h["head"] for h in data["heads"] if h["label"] == c["label"])
                   if not gone[m]]  # by (layer, head): removed heads are not in `heads`
        members.sort(key=lambda m: float(np.sum((X[m] - cen) ** 2)))
        for j, m in enumerate(members[:per_type]):
            picks.append((c["type"], m // H, m % H, j % max(n_texts, 1)))
    return picks


def example_inputs(texts, n: int, tokenizer, *, max_length: int = EXAMPLE_MAX_LENGTH,
                   min_tokens: int = EXAMPLE_MIN_TOKENS) -> list[int]:
    """Indices of up to `n` inputs of `texts`, the shortest first (in tokens, counted as `attention_maps` counts
    them: special tokens added, cut to `max_length`), leaving out inputs under `min_tokens` tokens unless nothing
    else is there. Ties keep corpus order."""
    sized = []
    for i, t in enumerate(texts):
        parts = t if isinstance(t, (tuple, list)) else (t,)
        ids = tokenizer(*parts, truncation=True, max_length=max_length)["input_ids"]
        sized.append((len(ids), i))
    good = sorted(x for x in sized if x[0] >= min_tokens) or sorted(sized)
    return [i for _, i in good[:n]]


def within_budget(maps, budget: int = MAPS_BUDGET_BYTES) -> list:
    """The leading maps (AttentionMaps, shortest first) whose uint8 bytes (layers · heads · n² each) fit `budget`."""
    out, used = [], 0
    for m in maps:
        size = int(np.prod(np.asarray(m.weights).shape))
        if used + size > budget:
            break
        out.append(m)
        used += size
    return out


class _FigureSaver:
    """Saves the report's figures into RUN/figures (PNG, and SVG unless told not to), one progress step each. The bar
    starts when the report knows how many figures it draws (`expect`): a bar made before, with no total, would print
    an empty "0 figures" line, and a report that draws none shows no bar."""

    def __init__(self, directory, svg: bool, progress: bool):
        self.directory, self.svg, self.progress = directory, svg, progress
        self.bar = None

    def expect(self, n: int) -> None:
        """The number of figures the report will draw (the bar's total)."""
        from tqdm.auto import tqdm

        if self.progress and n > 0 and self.bar is None:
            self.bar = tqdm(total=n, desc="report", unit=" figures", dynamic_ncols=True)

    def __call__(self, fig, stem: str) -> dict:
        saved = save_figure(fig, self.directory, stem, svg=self.svg)
        if self.bar is not None:
            self.bar.set_postfix_str(stem, refresh=False)
            self.bar.update(1)
        return saved

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _clusters(run_dir: Path, features: HeadFeatures, data: dict | None, k: int | None, method: str, seed: int,
              do_sweep: bool, progress: bool) -> tuple[dict, list[str]]:
    """The run's clusters.json content as it was read (`data`, attnkit.analysis.preflight.load_run), clustering now
    (and saving it) when the run has none; and notes on it."""
    if data is not None:
        return data, []
    c, over, rows = fit_types(features, k=k, do_sweep=do_sweep, progress=progress, method=method, seed=seed)
    save_clusters(run_dir, c, features, rows, over)
    data = load_clusters(run_dir)  # as the file holds it (JSON's types), as a later report reads it
    chosen = f"k = {c.k}" + (" (the most stable from 2 to 8)" if k is None else "")
    return data, [f"{CLUSTERS_FILE} was missing; clustered now with {chosen}, method {method}, seed {seed}."]


@dataclass
class Section:
    """One section of the page: `id` (its anchor), `title` (in the table of contents and its heading) and `body`
    (HTML). A function `(report) -> Section | None` in `SECTIONS` adds one; None leaves it out. A `body` that is a
    plain str is trusted markup written by code (never put a value read from a file into it: render it with
    `attnkit.analysis.report_html.part` or `table`, which escape)."""

    id: str
    title: str
    body: str

    def html(self) -> Markup:
        return macros().section(self.id, self.title, Markup(self.body))


def _heads_of_kind(features: HeadFeatures, kind: str) -> np.ndarray:
    """The indices (layer-major, among all of the run's heads) of the heads of an encoder–decoder's layers of `kind`."""
    H = features.n_heads
    return np.array([l * H + h for l, (k, _) in enumerate(features.layer_kinds) if k == kind for h in range(H)])


def _within_and_across_layers(pt: np.ndarray, layers: np.ndarray) -> tuple[float, float]:
    """The mean divergence `pt` (heads × heads) between two heads of one layer and between heads of two layers (NaN
    where there is no such pair)."""
    same = layers[:, None] == layers[None, :]
    within, across = pt[same & ~np.eye(len(layers), dtype=bool)], pt[~same]
    return (within.mean() if within.size else np.nan), (across.mean() if across.size else np.nan)


class Report:
    """What every section reads: the run, its features, clusters, distances, attached results, figures saver, the
    example inputs' maps, and which heads were removed."""

    def __init__(self, run_dir: Path, features: HeadFeatures, data: dict, save: _FigureSaver, *, seed: int,
                 attached: Attached, examples: int = 0, texts=None, model=None):
        self.run_dir, self.features, self.data, self.save, self.seed = run_dir, features, data, save, seed
        self.attached, self.n_examples, self.texts, self.model = attached, examples, texts, model
        self.decoder = is_decoder_run(features)
        self.shown = shown_features(features.names, self.decoder)  # the features the page shows (glossary, tables)
        self.type_names = [c["type"] for c in data["clusters"]]
        self.colors = figs.type_colors(self.type_names)
        L, H = features.n_layers, features.n_heads
        self.removed = features.removed
        self.kept = ~self.removed.ravel()
        self.n_removed = int(self.removed.sum())
        self.grid = np.where(self.removed, -1, label_grid(data))  # -1: removed (in no type)
        self.labels = self.grid.ravel()
        self.head_ids = [f"L{m // H}H{m % H}" for m in range(L * H)]
        # distances.npz when it is this run's (another model's or corpus's is listed as not shown: attached.py)
        self.distances: HeadDistances | None = attached.distances
        # an encoder–decoder's: the kinds whose distances_KIND.npz is the run's and keeps two heads or more to map,
        # with their heads' indices among the run's (layer-major)
        heads = {kind: _heads_of_kind(features, kind) for kind in attached.distances_by_kind}
        self.kind_maps = [(kind, idx) for kind, idx in heads.items() if self.kept[idx].sum() >= 2]
        self.image = "mean_attention_distance" in features.names  # a vision transformer's run
        self.cls_maps = None  # an image run: (layers × heads × rows × cols [CLS] attention, the image, its name)
        self.maps = []  # AttentionMaps of the example inputs, shortest first
        self.example_idx: list[int] = []  # their indices in texts
        self.notes: list[str] = []

    def img(self, fig, stem: str, caption: str) -> dict:
        """Save a figure into RUN/figures and return what the `img` macro shows."""
        return figure(self.save(fig, stem), caption)

    def kept_mean(self, values: np.ndarray) -> float:
        """The mean of L × H `values` over the heads that were not removed."""
        v = np.asarray(values, dtype=np.float64).ravel()[self.kept]
        return float(v.mean()) if v.size else float("nan")

    def kept_values(self, values) -> np.ndarray:
        """L × H `values` with the removed heads' set to NaN (whatever the file that gave them held there)."""
        return np.where(self.removed, np.nan, np.asarray(values, dtype=np.float64))

    def top_heads(self, values, n: int = TOP_HEADS) -> list[tuple[str, float]]:
        """The `n` heads with the largest of L × H `values` (removed heads and NaN left out; ties: lower head
        first) as [("L3H1", value), ...]."""
        v = self.kept_values(values).ravel()
        order = [m for m in np.argsort(-np.nan_to_num(v, nan=-np.inf), kind="stable") if np.isfinite(v[m])]
        return [(self.head_ids[m], float(v[m])) for m in order[:n]]


# --- the findings ------------------------------------------------------------------------------------------------
def _types_finding(r: Report) -> Markup:
    st = r.data["stability"]
    rows = []
    n_kept = int(r.kept.sum())
    # the shares the names are made of (attnkit/analysis/naming.py): the classes of the run's kind, and the details
    # that a name of this run claims
    classes = list(DECODER_CLASSES if r.decoder else ENCODER_CLASSES)
    claimed = {word for t in r.type_names for word in t.split("+")[1:]}
    details = [d for d in (DECODER_DETAILS if r.decoder else ENCODER_DETAILS) if d in claimed]
    for c in r.data["clusters"]:
        p = c["profile"] or {}
        if p and all(key in p for key in ("cls", "sep", "punct", "self", "near", "mid", "far", "special")):
            p = {**p, **class_shares(p, r.decoder)}  # clusters.json of any version: from the group shares
        n, share = c["n_heads"], c["share"]
        if r.n_removed:  # counted over the heads that remain, whatever clusters.json counted
            n = int((r.labels == c["label"]).sum())
            share = n / n_kept if n_kept else float("nan")
        rows.append((macros().typed(r.colors[c["type"]], c["type"]), n, fmt(share),
                     *[fmt(p.get(x)) for x in classes + details]))
    return part("types_finding", n_types=len(r.type_names), st=st, over=st.get("over_seeds"),
                judged=run_stability(r.data), warn_below=STABILITY_WARN, rows=rows, removed=r.n_removed,
                decoder=r.decoder, header=["type", "heads", "share", *classes, *details])


def _sink_finding(r: Report) -> Markup:
    from . import summaries as sm

    f = r.features
    n_kept = int(r.kept.sum())
    items = []
    for label, names in sm.SPECIAL_GROUPS:
        if not all(n in f.names for n in names) or not n_kept:
            continue
        v = r.kept_values(sum(f.feature(n) for n in names))
        per_layer = np.array([np.nanmean(row) if np.isfinite(row).any() else -np.inf for row in v])
        l_top = int(per_layer.argmax())
        hl, hh = np.unravel_index(int(np.nanargmax(v)), v.shape)
        items.append({"label": label, "mean": float(np.nanmean(v)), "layer": l_top, "layer_mean": per_layer[l_top],
                      "above": int((np.nan_to_num(v, nan=-1.0) > sm.SPECIAL_MIN).sum()), "cut": sm.SPECIAL_MIN,
                      "best": f"L{hl}H{hh}", "best_value": float(v[hl, hh])})
    if not items:
        return Markup("")
    special = [n for n in ("cls", "sep", "comma", "period") if n in f.names]
    total = np.where(r.removed, 0.0, sum(f.feature(n) for n in special))
    return part("sink_finding", majority=int((total > 0.5).sum()), n_heads=n_kept, special=special, items=items,
                removed=r.n_removed, survival=_survival(r, "all special", "[CLS] + [SEP] + punctuation"))


def _survival(r: Report, group: str, label: str | None = None) -> dict | None:
    """How much of a token class's mass survives norm weighting (a run of the other weighting given to `--include`;
    attnkit/analysis/weighting.py): the means over heads under both weightings, their ratio, and the heads with the
    most mass by attention, attention → norm. None without such a run."""
    w = r.attached.weighting
    if w is None:
        return None
    g = w["groups"][group]
    attention, norm = (np.array(g[k], dtype=np.float64) for k in ("attention", "norm"))
    heads = [(name, value, float(norm.ravel()[r.head_ids.index(name)])) for name, value in r.top_heads(attention)]
    return {"group": label or group, "other": w["other"].name, "other_weighting": w["other_weighting"],
            "mean_attention": g["mean_attention"], "mean_norm": g["mean_norm"], "share": g["survival_of_means"],
            "heads": heads, "n_removed": w["n_removed"]}


def _first_token_finding(r: Report) -> Markup:
    """A decoder's sink heads: first-token mass (`cls`: the first position, whatever token it holds), the mass on a
    learned sink logit (`sink`, gpt-oss) when the model has one, and how much survives norm weighting."""
    from . import summaries as sm

    f = r.features
    if "cls" not in f.names or not r.kept.any():
        return Markup("")
    first = r.kept_values(f.feature("cls"))
    per_layer = sm.kept_mean(first, 1)  # NaN for a layer whose heads were all removed
    l_top = int(np.nanargmax(per_layer))
    sink = None
    if "sink" in f.names:
        mass = r.kept_values(f.feature("sink"))
        if np.nanmax(mass) > 0:
            sink = {"mean": float(np.nanmean(mass)), "heads": r.top_heads(mass)}
    return part("first_token_finding", n_heads=int(r.kept.sum()), mean=float(np.nanmean(first)),
                above=int((np.nan_to_num(first) >= SINK_MIN).sum()), cut=SINK_MIN,
                majority=int((np.nan_to_num(first) > 0.5).sum()), layer=l_top, layer_mean=float(per_layer[l_top]),
                heads=r.top_heads(first), sink=sink, survival=_survival(r, "[CLS]", "first-token"),
                removed=r.n_removed,
                weighting=weighting_of(f.meta))


def _detected_finding(r: Report) -> Markup:
    """The heads `attnkit detect-heads` scores highest per kind, with its settings (docs/analysis.md, section 10)."""
    d = r.attached.detected
    if d is None:
        return part("detected_finding", rows=None, settings=[])
    meta = d["meta"]
    rows = []
    for kind in d["kinds"]:
        scores = r.kept_values(d["scores"][kind])
        rows.append((kind, int((np.nan_to_num(scores) >= DETECTED_MIN).sum()),
                     ", ".join(f"{h} ({v:.2f})" for h, v in r.top_heads(scores)) or "none"))
    settings = []
    if any(k != "retrieval" for k in d["kinds"]):
        bos = meta.get("bos")
        settings.append(f"{meta.get('n_sequences', '?')} sequences of {meta.get('length', '?')} random tokens, each "
                        f"repeated once (seed {meta.get('seed', '?')}; "
                        + (f"the model's BOS, id {bos}, before each)" if bos is not None else
                           "no BOS: the tokenizer adds none)"))
    if "retrieval" in d["kinds"]:
        settings.append(f"{meta.get('n_sequences', '?')} needle-in-a-haystack inputs from "
                        f"{Path(str(meta.get('corpus') or 'the default corpus')).name}, the answer teacher-forced")
    return part("detected_finding", rows=rows, settings=settings, cut=DETECTED_MIN, source=d["source"])


def _kept_features(r: Report) -> HeadFeatures:
    """The run's features for the summaries of the papers' findings: a layer whose heads were all removed is left
    out, and a removed head of a partly removed layer takes its layer's mean over the remaining heads (so it moves
    no layer mean and crosses no threshold of its own: thresholds are checked on the real heads only)."""
    mean = np.array(r.features.mean, dtype=np.float64)
    layers = [l for l in range(r.features.n_layers) if not r.removed[l].all()]
    for l in layers:
        if r.removed[l].any():
            mean[l, r.removed[l]] = mean[l, ~r.removed[l]].mean(0)
    f = r.features
    return HeadFeatures(mean[layers], np.asarray(f.std)[layers], f.names, f.n_samples, f.n_tokens, f.meta)


def _papers_finding(r: Report) -> Markup:
    from . import summaries as sm

    f = _kept_features(r) if r.n_removed else r.features
    layers = [l for l in range(r.features.n_layers) if not r.removed[l].all()]
    try:
        if not layers:
            raise AttnkitError("every head was removed")
        # Clark et al.'s comparisons describe BERT encoders; a decoder's rows see no next token and its [SEP] is EOS
        notes = [] if r.decoder else sm.paper_differences(f)
        th = sm.threshold_heads(f)
        summ = sm.layer_summaries(f)
    except AttnkitError as exc:
        return part("papers_finding", skipped=str(exc), notes=[], rows=[], decoder=r.decoder)
    cuts = {"previous token": f"prev > {sm.PREV_NEXT_MIN}", "next token": f"next > {sm.PREV_NEXT_MIN}",
            "[CLS]": f"cls > {sm.SPECIAL_MIN}", "[SEP]": f"sep > {sm.SPECIAL_MIN}",
            "punctuation": f"comma + period > {sm.SPECIAL_MIN}",
            "broad": f"entropy > {sm.BROAD_FRACTION} · ln n = {sm.BROAD_FRACTION * summ['uniform_entropy']:.2f}"}
    if r.decoder:
        th = {("first token" if k == "[CLS]" else k): v for k, v in th.items() if k not in ("next token", "[SEP]")}
        cuts["first token"] = cuts["[CLS]"]
    rows = []
    for k, v in th.items():
        real = [x for x in v if not r.removed[layers[x["layer"]], x["head"]]]  # filled-in heads are not heads
        named = ", ".join(f"L{layers[x['layer']]}H{x['head']} ({x['value']:.2f})" for x in real[:THRESHOLD_NAMES])
        more = f", and {len(real) - THRESHOLD_NAMES} more (the tables below list every head)" \
            if len(real) > THRESHOLD_NAMES else ""
        rows.append((k, cuts[k], len(real), named + more or "none"))
    if len(layers) < r.features.n_layers:  # the notes number layers among the remaining ones
        gone = [l for l in range(r.features.n_layers) if l not in layers]
        if gone[-1] == r.features.n_layers - 1:  # the model's last layer is gone: nothing to say about it
            notes = [n for n in notes if "last layer" not in n]
        notes = [f"(Every head of layer(s) {', '.join(map(str, gone))} was removed; the notes below number the "
                 f"remaining {len(layers)} layers 0–{len(layers) - 1}.)"] + notes
    return part("papers_finding", skipped=None, notes=notes, rows=rows, decoder=r.decoder)


def _attached_findings(r: Report) -> Markup:
    a = r.attached
    patterns = probe = None
    if a.patterns is not None:
        ov = a.patterns["data"]["overall"]
        patterns = [(c, ov.get(c, 0.0)) for c in a.patterns["classes"]]
    if a.probe is not None:
        p = a.probe
        acc = p["acc"].reshape(-1, len(p["relations"]))[r.kept]
        gain = np.where(np.isfinite(acc), acc, -np.inf).max(0) - p["baseline"]
        probe = [(p["relations"][j], float(gain[j])) for j in np.argsort(-gain)[:3] if p["relations"][j] != "(all)"]
    ablations = [x for x in (_worst_ablation(r, ab) for ab in a.ablations) if x]
    return part("attached_findings", patterns=patterns, probe=probe, ablations=ablations)


def _worst_ablation(r: Report, ab: dict) -> dict | None:
    """The head or layer whose ablation harms the most: the largest Δ of a loss (LOWER_IS_BETTER), else the most
    negative Δ; with its bootstrap interval and the baseline. None for a table without per-head or per-layer Δ."""
    H = r.features.n_heads
    delta = r.kept_values(ab["delta"]) if ab["experiment"] == "heads" else ab.get("delta")
    if delta is None or not np.isfinite(delta).any():
        return None
    rises = ab["metric"] in LOWER_IS_BETTER
    m = int(np.nanargmax(delta) if rises else np.nanargmin(delta))
    lo, hi = float(np.ravel(ab["lo"])[m]), float(np.ravel(ab["hi"])[m])
    base = (ab["rows"][0] or {}).get(ab["metric"])
    return {"source": ab["path"].name, "what": f"L{m // H}H{m % H}" if ab["experiment"] == "heads" else f"layer {m}",
            "metric": ab["metric"], "delta": float(np.ravel(delta)[m]), "rises": rises,
            "harms": bool(np.ravel(delta)[m] > 0 if rises else np.ravel(delta)[m] < 0),
            "unit": "head" if ab["experiment"] == "heads" else "layer",
            "interval": (lo, hi) if np.isfinite([lo, hi]).all() else None,
            "baseline": float(base) if isinstance(base, (int, float)) else None,
            "task": ab["meta"].get("task") or ""}


def findings(r: Report) -> Section:
    sink = (_first_token_finding(r) + _detected_finding(r)) if r.decoder else _sink_finding(r)
    return Section("findings", "Findings", _types_finding(r) + sink + _papers_finding(r) + _attached_findings(r))


# --- the head explorer and the example inputs --------------------------------------------------------------------
def explorer(r: Report) -> Section:
    removed = ", ".join(r.head_ids[m] for m in np.flatnonzero(~r.kept)) if r.n_removed else ""
    return Section("explorer", "Head explorer", part(
        "explorer", L=r.features.n_layers, H=r.features.n_heads, names=r.shown,
        types=[(r.colors[t], t) for t in r.type_names], removed=removed,
        detected=r.attached.detected["kinds"] if r.attached.detected else ()))


def inputs_section(r: Report) -> Section | None:
    if not r.maps:
        return None
    size = sum(int(np.prod(m.weights.shape)) for m in r.maps)
    budget = (f"{size / 1e3:.0f} kB of maps, budget {MAPS_BUDGET_BYTES / 1e6:g} MB; docs/files.md")
    return Section("inputs", "Attention on example inputs", part("examples_view", n_texts=len(r.maps), budget=budget))


# --- figures ------------------------------------------------------------------------------------------------------
def types_figures(r: Report) -> Section:
    figures = [r.img(figs.type_share_per_layer(r.grid, r.type_names), "type_share_per_layer",
                     "Head types per layer (cf. Guan et al. Fig. 3)."),
               r.img(figs.distance_boxplots(r.features, r.labels, r.type_names), "distance_boxplots",
                     "Distance features of the heads of each type (cf. Guan et al. Fig. 1, bottom).")]
    rows = r.data["stability"].get("sweep")
    sweep_part = None
    if rows:
        seeded = all("stability_mean" in x for x in rows)
        srows = [(x["k"], fmt(x["stability"])
                  + (f" (mean {fmt(x['stability_mean'])}, {fmt(x['stability_min'])}–{fmt(x['stability_max'])} "
                     f"over {x.get('n_seeds', '?')} seeds)" if seeded else ""),
                  fmt(x["silhouette"]), ", ".join(x.get("type_names", []))) for x in rows]
        sweep_part = {"rows": srows, "fig": r.img(figs.stability_sweep(rows), "stability_sweep",
                                                  "Stability and silhouette against k.")}
    return Section("types", "Head types per layer", part("types_figures", figs=figures, sweep=sweep_part))


def head_maps(r: Report) -> Section:
    from .embedding import mds, tsne

    L, H = r.features.n_layers, r.features.n_heads
    kept = r.kept
    ids = [h for h, k in zip(r.head_ids, kept) if k]
    X = head_matrix(r.features, r.data["settings"]["features"])[kept]
    removed = (f" {r.n_removed} removed head(s) are left out." if r.n_removed else "")
    figures = [r.img(figs.tsne_scatter(tsne(X, seed=r.seed), r.labels[kept], r.type_names, ids), "tsne_types",
                     "t-SNE of the clustered features, coloured by type (cf. Guan et al. Fig. 2)." + removed)]
    dist = r.distances
    if dist is None and (r.run_dir / DISTANCES_FILE).is_file():  # another model's: listed as not shown, with why
        return Section("maps", "Maps of heads", part("figures_and_notes", figs=figures, notes=[
            f"{DISTANCES_FILE} is not this run's (see \"Results not shown here\"): the MDS map of Jensen-Shannon "
            f"distances needs `attnkit distances RUN --overwrite`."]))
    if dist is None and r.features.layer_kinds is not None:  # never a map pairing heads of different kinds
        return _kind_maps(r, figures, removed)
    if dist is None:
        return Section("maps", "Maps of heads", part("figures_and_notes", figs=figures, notes=[
            f"No {DISTANCES_FILE} in this run: the MDS map of Jensen-Shannon distances (and the nearest heads by "
            f"divergence in the head panel) needs `attnkit distances RUN`."]))
    layers = np.repeat(np.arange(L), H)
    pt = np.asarray(dist.per_token)[np.ix_(kept, kept)]
    smoothed = f", rows smoothed with ε = {dist.meta['smoothing']:g}" if dist.meta.get("smoothing") else ""
    figures.append(r.img(figs.mds_maps(mds(pt, seed=r.seed), r.labels[kept], r.type_names, layers[kept], ids),
                         "mds_js", f"Metric MDS of the Jensen-Shannon divergences between heads (mean per token over "
                                   f"{dist.n_rows} query tokens{smoothed}), coloured by type and by layer (cf. Clark "
                                   "et al. Fig. 6)." + removed))
    within, across = _within_and_across_layers(pt, layers[kept])
    return Section("maps", "Maps of heads", part("figures_and_notes", figs=figures, notes=[
        f"Mean JS divergence per token: between heads of the same layer {within:.4f}, between heads of different "
        f"layers {across:.4f}."]))


def _kind_maps(r: Report, figures: list, removed: str) -> Section:
    """An encoder–decoder's maps of heads: one MDS map of Jensen-Shannon divergences per kind whose
    distances_KIND.npz is the run's, each kind's heads compared among themselves only (docs/seq2seq.md §9)."""
    from .embedding import mds

    H = r.features.n_heads
    kinds = r.features.kinds
    notes = ["An encoder–decoder's heads are compared within each kind only (docs/seq2seq.md §9): `attnkit distances "
             "RUN` writes one file per kind (distances_encoder.npz, distances_decoder.npz, distances_cross.npz; "
             "attnkit.run.HeadDistances.load_by_kind reads them). No map or nearest head pairs heads of two kinds."]
    for kind, idx in r.kind_maps:
        dist = r.attached.distances_by_kind[kind]
        keep = r.kept[idx]
        pt = np.asarray(dist.per_token)[np.ix_(keep, keep)]
        layers = idx[keep] // H
        smoothed = f", rows smoothed with ε = {dist.meta['smoothing']:g}" if dist.meta.get("smoothing") else ""
        figures.append(r.img(figs.mds_maps(mds(pt, seed=r.seed), r.labels[idx][keep], r.type_names, layers,
                                           [r.head_ids[m] for m in idx[keep]]),
                             f"mds_js_{kind}", f"Metric MDS of the Jensen-Shannon divergences between the {kind} heads "
                                               f"(mean per token over {dist.n_rows} query tokens{smoothed}), coloured "
                                               "by type and by layer (cf. Clark et al. Fig. 6)." + removed))
        means = zip(("within a layer", "across layers"), _within_and_across_layers(pt, layers))
        parts = [f"{what} {x:.4f}" for what, x in means if not np.isnan(x)]
        notes.append(f"{kind} heads, mean JS divergence per token: {', '.join(parts)}.")
    drawn = {kind for kind, _ in r.kind_maps}
    # a kind's file that find_attached read and set aside (another model's or corpus's) is in its links
    set_aside = {Path(path) for _, path, _ in r.attached.links}
    absent = [k for k in kinds if k not in r.attached.distances_by_kind]
    others = [k for k in absent if r.run_dir / distances_file(k) in set_aside]
    missing = [k for k in absent if k not in others]
    if missing:
        notes.append(f"No map of the {', '.join(missing)} heads: run `attnkit distances RUN` for "
                     + ", ".join(distances_file(k) for k in missing) + ".")
    if others:
        notes.append(f"No map of the {', '.join(others)} heads: " + ", ".join(distances_file(k) for k in others)
                     + (" is" if len(others) == 1 else " are") + " not this run's (see \"Results not shown here\"): "
                     "`attnkit distances RUN --overwrite` measures them again.")
    few = [k for k in r.attached.distances_by_kind if k not in drawn]
    if few:
        notes.append(f"No map of the {', '.join(few)} heads: fewer than two of them are left.")
    notes.append("The head panel lists each head's nearest heads by divergence among its own kind's heads (none for "
                 "a kind without its map).")
    return Section("maps", "Maps of heads", part("figures_and_notes", figs=figures, notes=notes))


def heatmaps(r: Report) -> Section:
    from . import summaries as sm

    panels = figs.DECODER_HEATMAP_FEATURES if r.decoder else figs.HEATMAP_FEATURES
    figures = [r.img(figs.feature_heatmaps(r.features, panels), "feature_heatmaps",
                     "Per layer × head means over the corpus (cf. Clark et al. Figs. 2 and 6)"
                     + ("; the first token is the sample's first position, whatever it holds" if r.decoder else "")
                     + ("; removed heads are blank." if r.n_removed else "."))]
    f = _kept_features(r) if r.n_removed else r.features
    layers = [l for l in range(r.features.n_layers) if not r.removed[l].all()]
    try:
        summ = sm.layer_summaries(f)
    except AttnkitError:
        return Section("heatmaps", "Features per layer and head", part("layer_table", figs=figures, title="",
                                                                       header=[], rows=[]))
    figures.append(r.img(sm.layer_summary_figure(summ, decoder=r.decoder), "layer_summaries",
                         ("Mean attention to the first token, EOS" if r.decoder else "Mean attention to [CLS], [SEP]")
                         + " and punctuation per layer (dots: heads), and entropy with the "
                         f"uniform baseline ln n = {summ['uniform_entropy']:.2f} (n = {summ['n_mean_tokens']:.1f} mean "
                         "tokens per sample)." + (f" Only the {len(layers)} layers with heads left are drawn, "
                                                 "numbered among themselves." if len(layers) < r.features.n_layers
                                                 else "")))
    labels = [k for k in summ["per_layer"] if not (r.decoder and k == "[CLS] entropy")]  # row 0 sees itself only
    names = r.features.layer_labels()
    rows = [[names[layers[i]]] + [fmt(summ["per_layer"][k][i]) for k in labels] for i in range(len(layers))]
    shown = sm.DECODER_LABELS if r.decoder else {}
    return Section("heatmaps", "Features per layer and head", part(
        "layer_table", figs=figures, title="Per-layer summaries (Clark et al.)",
        header=["layer"] + [shown.get(k, k) for k in labels], rows=rows))


def image_heads(r: Report) -> Section | None:
    """A vision transformer's run: each head's mean attention distance against depth (Dosovitskiy et al. Fig. 7),
    and for one image each head's [CLS] attention over the patches (Caron et al., DINO, Fig. 1)."""
    if not r.image:
        return None
    patch = None
    if r.model is not None:
        from ..models import runtime_of

        patch = runtime_of(r.model[0]).image.patch[0]
    distance = r.kept_values(r.features.mean[..., r.features.names.index("mean_attention_distance")])
    figures = [r.img(figs.attention_distance_by_layer(distance, patch), "attention_distance_by_layer",
                     "Mean attention distance of each head (dots; Σ weight × distance between patches on the grid, "
                     "in patches, averaged over patch queries and images) against its layer (cf. Dosovitskiy et al. "
                     "Fig. 7).")]
    notes = []
    if r.cls_maps is not None:
        maps, image, name = r.cls_maps
        figures.append(r.img(figs.cls_attention_maps(maps, image), "cls_attention_maps",
                             f"[CLS] attention over the patches of one image ({name}), per head: layers down, heads "
                             "across, each map scaled to its own maximum (cf. Caron et al., DINO, Fig. 1)."))
    else:
        notes.append("No [CLS] maps: `attnkit report` draws them from the run's first image with the run's model, "
                     "which were not read (see the notes above), or the report was made with --examples 0.")
    return Section("images", "Image heads", part("figures_and_notes", figs=figures, notes=notes))


def detected_section(r: Report) -> Section | None:
    """`attnkit detect-heads`'s scores: one layer × head grid per kind, and the top heads of each."""
    d = r.attached.detected
    if d is None:
        return None
    grids = [(kind, r.kept_values(d["scores"][kind])) for kind in d["kinds"]]
    fig = r.img(figs.grid_heatmaps(grids, vmin=0.0, vmax=1.0), "detected_heads",
                f"Scores of {_shown_path(r, d['path'])} per layer × head (0–1; the recipes: docs/analysis.md, "
                "section 10)" + ("; removed heads are blank." if r.n_removed else "."))
    rows = [(kind, ", ".join(f"{h} ({v:.3f})" for h, v in r.top_heads(g, 10)) or "none") for kind, g in grids]
    return Section("detected", "Detected heads (attnkit detect-heads)", part("detected", fig=fig, rows=rows))


def example_section(r: Report) -> Section | None:
    if not r.maps:
        return None
    picks = pick_example_heads(r.features, r.data, per_type=min(r.n_examples, 3), n_texts=len(r.maps),
                               removed=r.removed)
    fig = figs.attention_examples(_picked_maps(dict(enumerate(r.maps)), picks))
    return Section("examples", "Example attention maps", part("figures_and_notes", figs=[r.img(
        fig, "attention_examples", "The heads nearest to each type's centroid on the example inputs (rows: types; "
                                   "rows of a map: queries, columns: keys). Every head's maps of these inputs are in "
                                   "its panel of the head explorer.")], notes=[]))


# --- results of other commands ----------------------------------------------------------------------------------
def _embedded_png(path: Path, caption: str) -> dict | None:
    return figure({"png_bytes": path.read_bytes()}, caption) if path.is_file() else None


def patterns_section(r: Report) -> Section | None:
    p = r.attached.patterns
    if p is None:
        return None
    d = p["data"]
    rows = [[f"L{l}"] + ["–" if d["per_layer"][c][l] is None else f"{100 * d['per_layer'][c][l]:.1f}%"
                         for c in p["classes"]] for l in range(len(r.grid))]  # None: every head removed
    rows.append(["all"] + [f"{100 * d['overall'][c]:.1f}%" for c in p["classes"]])
    rules = ", ".join(f"{k} {v}" for k, v in (d.get("rules") or {}).items())
    return Section("patterns", "Pattern classes (Kovaleva et al.)", part(
        "patterns", classes=p["classes"], rows=rows, n_examples=d["n_examples"], rules=rules,
        fig=_embedded_png(r.run_dir / FIGURES_DIR / "pattern_types.png", "Pattern classes per layer.")))


def probe_section(r: Report) -> Section | None:
    p = r.attached.probe
    if p is None:
        return None
    rels = p["summary"].get("relations") or {}
    rows = []
    for j, rel in enumerate(p["relations"]):
        grid = np.where(r.removed | ~np.isfinite(p["acc"][..., j]), -np.inf, p["acc"][..., j])
        l, h = np.unravel_index(int(grid.argmax()), grid.shape)
        info = rels.get(rel) or {}
        offset = info.get("baseline_offset")
        rows.append((rel, p["counts"][j], f"L{l}H{h}", fmt(float(grid[l, h])), fmt(float(p["baseline"][j])),
                     f"{float(grid[l, h] - p['baseline'][j]):+.3f}", "–" if offset is None else offset))
    return Section("probe", "Syntax probes (Clark et al.)", part(
        "probe", rows=rows, source=_shown_path(r, p["path"] / "probe.json"), model=p["summary"].get("model") or "",
        fig=_embedded_png(p["heatmap"], "Accuracy over the baseline per head (probe_heatmap.png).")))


def _shown_path(r: Report, path: Path) -> str:
    """A result file as the page names it: relative to the run when it lies inside it, else its folder and name
    (never a link, and no absolute path of the machine that made the report)."""
    try:
        return str(Path(path).resolve().relative_to(r.run_dir.resolve()))
    except ValueError:
        return f"{Path(path).parent.name}/{Path(path).name}"


def ablation_section(r: Report) -> Section | None:
    if not r.attached.ablations:
        return None
    items = []
    for a in r.attached.ablations:
        key = f"delta_{a['metric']}"
        rows = [(str(x.get("setting", "")), fmt(x.get(a["metric"]), 2), fmt(x.get(key), 2),
                 fmt(x.get(f"{key}_lo"), 2), fmt(x.get(f"{key}_hi"), 2)) for x in a["rows"]]
        items.append({"experiment": a["experiment"], "task": a["meta"].get("task") or "",
                      "model": a["meta"].get("model") or "", "metric": a["metric"], "rows": rows,
                      "fig": _embedded_png(a["figure"], f"{a['experiment']} ({a['figure'].name})."),
                      "source": _shown_path(r, a["path"])})
    return Section("ablation", "Ablations", part("ablations", items=items))


def links_section(r: Report) -> Section | None:
    if not r.attached.links:
        return None
    rows = [(what, _shown_path(r, path), why) for what, path, why in r.attached.links]
    return Section("elsewhere", "Results not shown here", part("elsewhere", rows=rows))


# --- tables, glossary, settings -----------------------------------------------------------------------------------
def tables(r: Report) -> Section:
    features, names = r.features, r.features.names
    L, H = features.n_layers, features.n_heads
    show = [n for n in ("cls", "sep", "comma", "period", "self", "prev", "next", "entropy", "max", "intra",
                        "inter", "cls_entropy") if n in r.shown]
    wins = distance_feature_names(names)
    mark = macros().doc_mark
    trows, drows = [], []
    for l in range(L):
        for h in range(H):
            if r.removed[l, h]:
                t = "removed"
            else:
                t = macros().typed(r.colors[r.type_names[r.grid[l, h]]], r.type_names[r.grid[l, h]])
            trows.append([l, h, t] + [fmt(float(features.mean[l, h, names.index(n)])) for n in show])
            drows.append([l, h] + [fmt(float(features.mean[l, h, names.index(n)])) for n in wins])
    return Section("tables", "Features per head", part(
        "tables", n=L * H, show=[mark(n, describe_feature(n, r.decoder)) for n in show], trows=trows,
        wins=[mark(n, describe_feature(n, r.decoder)) for n in wins], drows=drows))


def glossary_section(r: Report) -> Section:
    return Section("glossary", "Glossary of features", part("glossary", rows=[
        (n, describe_feature(n, r.decoder), where) for n, _, where in glossary_rows(r.shown)]))


def settings(r: Report) -> Section:
    rows = [(key, value_html(v)) for key, v in r.features.meta.items()]
    rows.append(("clustering", value_html(r.data["settings"])))
    return Section("settings", "Settings and versions", part("settings", rows=rows))


# The sections in page order. Other analyses add theirs here (a function (report) -> Section | None), e.g.
# SECTIONS.insert(SECTIONS.index(heatmaps) + 1, my_section).
SECTIONS: list[Callable[[Report], Section | None]] = [
    findings, explorer, inputs_section, types_figures, head_maps, heatmaps, image_heads, detected_section,
    example_section,
    patterns_section,
    probe_section, ablation_section, links_section, tables, glossary_section, settings]


def per_sample_problem(run_dir: Path, features: HeadFeatures) -> str | None:
    """Why RUN/per_sample.npy, which exists, was not attached to the run's features (damaged, cut short, of another
    run); None when it is attached or absent."""
    from ..run.per_sample import check_matches_run, load_per_sample

    path = Path(run_dir) / PER_SAMPLE_FILE
    if features.per_sample is not None or not path.exists():
        return None
    try:
        arr, names = load_per_sample(run_dir)
        check_matches_run(run_dir, arr, names, features)
    except AttnkitError as exc:
        return f"{PER_SAMPLE_FILE} is damaged and was not used: {exc}"
    except (ValueError, OSError) as exc:
        return f"{PER_SAMPLE_FILE} is damaged and was not used: {path} is unreadable ({exc})"
    return f"{PER_SAMPLE_FILE} is damaged and was not used: it does not fit the run's features"


def examples_problem(run_dir: Path, features: HeadFeatures) -> str | None:
    """Why the head panel shows no top and bottom examples although the run has per_sample.npy: the file is
    damaged (`per_sample_problem`), or per_sample_rows.csv, which says which text each row is, is missing or cut
    short (the examples are left out rather than shown without their texts, or with another run's); None when
    they are shown or the run has no per_sample.npy."""
    from ..run.per_sample import rows_table_problem

    damaged = per_sample_problem(run_dir, features)
    if damaged or features.per_sample is None:
        return damaged
    rows = rows_table_problem(run_dir, len(features.per_sample))
    return f"{rows}: the top and bottom examples are left out" if rows else None


def _example_maps(r: Report) -> None:
    """The maps of the example inputs (the shortest of the texts, within MAPS_BUDGET_BYTES): one forward each with
    `attnkit.attention_maps`, as `attnkit report --corpus` reads the texts."""
    if not (r.n_examples and r.texts is not None and r.model is not None):
        return
    if r.image:  # the [CLS] maps of the run's first image (`image_heads`)
        from ..jobs.maps import cls_attention_over_patches

        r.cls_maps = (*cls_attention_over_patches(r.texts[0], *r.model), r.texts[0].name)
        return
    from ..jobs.maps import attention_maps

    max_length = min(EXAMPLE_MAX_LENGTH, int(r.features.meta.get("max_length") or EXAMPLE_MAX_LENGTH))
    idx = example_inputs(r.texts, r.n_examples, r.model[1], max_length=max_length)
    maps = [attention_maps(r.texts[i], r.model, max_length=max_length) for i in idx]
    r.maps = within_budget(maps)
    r.example_idx = idx[:len(r.maps)]
    if len(r.maps) < len(maps):
        r.notes.append(f"{len(maps) - len(r.maps)} of the {len(maps)} example inputs were left out: their maps would "
                       f"exceed the budget of {MAPS_BUDGET_BYTES / 1e6:g} MB (docs/files.md).")


def _panel(r: Report) -> dict:
    """The head panel's data (attnkit/analysis/head_panel.py)."""
    per_sample = r.features.per_sample
    row_texts, notes, ext = {}, {}, None
    damaged = examples_problem(r.run_dir, r.features)
    if per_sample is not None and not damaged:
        ext = extremes(per_sample, r.features.names)
        rows = {int(x) for e in ext.values() for side in ("top", "bottom") for x in e[side].ravel()}
        row_texts, why = texts_of_rows(r.run_dir, r.features.meta, rows)
        if why:
            r.notes.append(why)
    if damaged:
        r.notes.append(damaged)
    notes["examples"] = damaged or ("No per_sample.npy in this run: `attnkit extract --per-sample` keeps every "
                                    "sample's features, from which the panel shows each head's top and bottom "
                                    "examples.")
    notes["maps"] = ("No example maps: `attnkit report RUN --examples N` embeds every head's maps of N short inputs "
                     "of the run's corpus (it needs the run's model and corpus).")
    notes["removed"] = "This head was removed from the model (pruned): it has no attention and no features."
    docs = {"links": {n: f"#glossary-{anchor(n)}" for n in r.shown},
            "defs": {n: describe_feature(n, r.decoder) for n in r.shown}}
    js, source = r.distances, DISTANCES_FILE
    if r.kind_maps:  # an encoder–decoder's: each head's nearest among its own kind's heads
        M = r.features.n_layers * r.features.n_heads
        js, source = np.full((M, M), np.inf), "distances_KIND.npz, among the heads of the head's kind"
        for kind, idx in r.kind_maps:
            js[np.ix_(idx, idx)] = r.attached.distances_by_kind[kind].per_token
    return panel_data(r.features, r.data, r.colors, distances=js, extremes=ext,
                      row_texts=row_texts, maps=r.maps, attached=r.attached, docs=docs, notes=notes,
                      removed=r.removed, shown=r.shown, js_source=source)


def build_report(run_dir, *, k: int | None = None, method: str = "kmeans", seed: int = 0, examples: int = 0,
                 texts=None, model=None, do_sweep: bool = True, title: str | None = None, svg: bool = True,
                 progress: bool = False, include=(), opened: Run | None = None,
                 attached: Attached | None = None) -> Path:
    """Write RUN/report.html (and RUN/figures/*.png|svg). Clusters come from RUN/clusters.json when it
    exists (otherwise they are computed with k/method/seed, k None: the most stable, and saved, with a k = 2..8 sweep);
    the MDS map needs RUN/distances.npz. `examples` > 0 embeds the maps of that many of the shortest `texts` (the
    run's corpus) made with `model` (a (model, tokenizer) pair): the head view of example inputs, every head's maps
    in its panel, and the example maps of each type. `include`: directories of `attnkit probe` / `attnkit ablate`
    results to show beside the run's own. `svg=False` skips the SVG copies of the figures. `progress` shows a bar on
    stderr, one step per figure. `opened` (attnkit.analysis.preflight.load_run) and `attached` (`find_attached`):
    the run and its attached results as the command already read them; None reads them here, once."""
    run_dir = Path(run_dir)
    opened = opened or load_run(run_dir)
    features = opened.features
    if attached is None:
        attached = find_attached(run_dir, opened.shape, include, features)
    save = _FigureSaver(run_dir / FIGURES_DIR, svg, progress)
    try:
        data, notes = _clusters(run_dir, features, opened.clusters, k, method, seed, do_sweep, progress)
        report = Report(run_dir, features, data, save, seed=seed, attached=attached, examples=examples, texts=texts,
                        model=model)
        _example_maps(report)
        # types, box plots, t-SNE, heatmaps, per-layer summaries; the sweep, MDS and examples when they are drawn
        save.expect(5 + bool(data["stability"].get("sweep")) + (report.distances is not None) + len(report.kind_maps)
                    + bool(report.maps)
                    + (attached.detected is not None) + report.image + (report.cls_maps is not None))
        panel = _panel(report)  # first: it reads the examples' texts, which may be damaged, before any figure
        sections = [s for s in (build(report) for build in SECTIONS) if s is not None]
    finally:
        save.close()
    if weighting_of(features.meta) == "norm":
        notes.insert(0, NORM_NOTE)
    if attached.partial:  # older files (or an older run): compared by what they record
        files, one = ", ".join(_shown_path(report, p) for p in attached.partial), len(attached.partial) == 1
        how = "by layers × heads, model type and model name only (docs/files.md, \"Which model a file comes from\")."
        notes.append(f"This run's meta.json records no model identity (made before attnkit recorded it): {files} "
                     f"{'was' if one else 'were'} compared with it {how}" if IDENTITY_FIELD not in features.meta else
                     f"{files} {'records' if one else 'record'} no model identity (made before attnkit recorded it): "
                     f"{'it was' if one else 'they were'} compared with the run {how}")
    if report.n_removed:
        notes.append(f"{report.n_removed} head(s) were removed from this model (pruned; meta.json removed_heads): "
                     "they are greyed out in the grid and left out of every type count, average, map and finding.")
    title = title or f"attnkit report: {run_dir.name}" + (" (norm-weighted)" if weighting_of(features.meta) == "norm"
                                                          else "")
    subtitle = (f"{features.meta.get('model') or ''} — {features.n_samples} samples, {features.n_tokens} tokens, "
                f"{features.n_layers} layers × {features.n_heads} heads; generated "
                f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}")
    html_ = page(title, subtitle, notes + report.notes, [(s.id, s.title) for s in sections],
                 [s.html() for s in sections], panel)
    out = run_dir / REPORT_FILE
    atomic_write(out, lambda f: f.write(html_.encode("utf-8")))
    return out


__all__ = ["DEFAULT_EXAMPLES", "FIGURES_DIR", "MAPS_BUDGET_BYTES", "REPORT_FIGURES", "REPORT_FILE", "SECTIONS",
           "Report", "Section", "build_report", "example_inputs", "example_maps", "is_decoder_run",
           "pick_example_heads", "examples_problem", "per_sample_problem", "report_figures", "check_heads",
           "within_budget"]
