"""Ablation experiments: lists of interventions ("settings"), their evaluation, tables and figures.

* `types`  — Guan et al. 2020 Table 2 (prune = zero / substitute = uniform 1/n each head type and each
  pair of types) and Table 3 (remove the intra- or inter-sentence attention of one type; keep one type's
  intra/inter attention only, i.e. remove it from every other type).
* `heads`  — Kovaleva et al. Fig. 8 / Michel et al. Table 3: one head at a time (zero or uniform).
* `layers` — Kovaleva et al. Fig. 9: one whole layer at a time.
* `best_head` — Michel et al. Table 4: in each layer all heads but one, for every choice of the head kept.
* `importance` — Michel et al.: gradient importance + iterative pruning (see `importance.py`); with mode zero every
  step also gets the parameters, FLOPs per token and tokens/s of the model with its heads removed (`sizes.py`).
* `patching` — activation patching: the share of the clean-vs-corrupted gap each head restores (`patching.py`).

Each experiment returns a `ResultTable` (baseline row first) that saves CSV, JSON and Markdown; its figure
is drawn by attnkit/ablation/figures.py. When the evaluation leaves per-example outputs (`evaluate.last_examples`,
an `attnkit.ablation.metrics.ExampleScores`), every row's change of the main metric gets a paired bootstrap
95% interval (columns delta_<metric>_lo / _hi; the same resamples of the examples for every setting), shown
in the tables and as error bars in the figures.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..arch.pruning import pruned_head_grid
from ..errors import AttnkitError, arg
from ..interventions import HeadTypes, Intervention, format_heads, only
from ..run.outputs import atomic_write, ensure_writable_dir
from .importance import iterative_pruning
from .metrics import MC_Z, N_BOOT, bootstrap_values, excludes_zero, percentile_interval
from .names import EXPERIMENTS
from .sizes import pruned_sizes, pruning_supported
from .sweep import Sweep

log = logging.getLogger("attnkit")


def one_by_one(evaluate: Callable[[Intervention], dict], interventions: list, progress: bool, desc: str) -> list[tuple]:
    """(metrics, per-example outputs or None) of `evaluate` under each intervention, one evaluation after the
    other (a bar of settings named `desc` with `progress`)."""
    it = interventions
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(interventions, desc=desc, unit="setting", dynamic_ncols=True)
    out = []
    for iv in it:
        metrics = evaluate(iv)
        out.append((metrics, getattr(evaluate, "last_examples", None)))
    return out


@dataclass
class Setting:
    name: str
    intervention: Intervention
    info: dict = field(default_factory=dict)  # extra table columns (layer, head, type, ...)


class TaskEvaluator:
    """Callable(intervention) → metrics of `task` on `model` under that intervention; `evaluate_many` evaluates a
    list of them together (attnkit/ablation/sweep.py: once per batch for the layers they leave unchanged, several
    settings per forward), or one after the other with `sweep=False`. `stack`: settings per forward (None: as
    memory allows; 1: one)."""

    def __init__(self, task, model, tokenizer, limit=None, batch_size=32, *, sweep: bool = True, stack=None):
        task.fit_to(model)  # no input runs past the model's positions
        self.task, self.model, self.tokenizer = task, model, tokenizer
        self.limit, self.batch_size = limit, batch_size
        self.main_metric = task.main_metric
        self.sweep, self.stack = sweep and getattr(task, "sweeps", True), stack

    def __call__(self, iv: Intervention) -> dict:
        self.task.last_examples = None
        with only(self.model, iv):  # exactly this setting, as a sweep evaluates it
            return self.task.evaluate(self.model, self.tokenizer, limit=self.limit, batch_size=self.batch_size)

    def evaluate_many(self, interventions: list, progress: bool = False, desc: str = "settings") -> list[tuple]:
        """(metrics, per-example outputs) under each intervention, in order."""
        if self.sweep:
            sweep = Sweep(self.task, self.model, self.tokenizer, limit=self.limit, batch_size=self.batch_size,
                          stack=self.stack)
            return sweep.run(interventions, progress=progress, desc=desc)
        return one_by_one(self, interventions, progress, desc)

    @property
    def last_examples(self):
        """Per-example outputs of the last evaluation (`ExampleScores`), when the task leaves them."""
        return getattr(self.task, "last_examples", None)


@dataclass
class ResultTable:
    experiment: str
    main_metric: str
    rows: list  # dicts; rows[0] is the baseline
    extra: dict = field(default_factory=dict)  # e.g. importance matrices, the bootstrap settings
    examples: list = field(default_factory=list)  # per row: its per-example outputs (ExampleScores) or None
    shown: list | None = None  # the indices of the rows the Markdown shows (None: all; CSV and JSON hold all)

    @property
    def columns(self) -> list[str]:
        cols: list[str] = []
        for r in self.rows:
            for k in r:
                if k not in cols:
                    cols.append(k)
        return cols

    def to_pandas(self):
        """The rows as a DataFrame; columns of whole numbers stay integers where a row has none (the baseline's
        layer and head), so the CSV says 3, not 3.0."""
        import pandas as pd

        df = pd.DataFrame(self.rows, columns=self.columns)
        for col in df.columns:
            values = [r.get(col) for r in self.rows if r.get(col) is not None]
            if values and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
                df[col] = df[col].astype("Int64")
        return df

    def to_markdown(self, digits: int = 2) -> str:
        cols = self.columns

        def fmt(v):
            if isinstance(v, float):
                return "nan" if math.isnan(v) else f"{v:.{digits}f}"
            return "" if v is None else str(v)

        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        for r in (self.rows if self.shown is None else [self.rows[i] for i in self.shown]):
            lines.append("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
        return "\n".join(lines)

    def examples_frame(self):
        """Every setting's per-example outputs, one row per (setting, example): `setting`, `example` (the
        example's position in the task's data) and the task's per-example columns; None without any."""
        import pandas as pd

        frames = []
        for row, ex in zip(self.rows, self.examples):
            if ex is None:
                continue
            cols = {"setting": row["setting"], "example": ex.index if ex.index is not None else np.arange(ex.n)}
            frames.append(pd.DataFrame({**cols, **{k: np.asarray(v) for k, v in ex.arrays.items()}}))
        return pd.concat(frames, ignore_index=True) if frames else None

    def save(self, out_dir: str, stem: str | None = None) -> dict:
        """Write <stem>.csv, .json and .md into `out_dir`, and <stem>.examples.csv when the rows have per-example
        outputs (each atomically; an OS error is one line)."""
        ensure_writable_dir(out_dir)
        stem = stem or self.experiment
        paths = {k: os.path.join(out_dir, f"{stem}.{k}") for k in ("csv", "json", "md")}
        payload = {"experiment": self.experiment, "main_metric": self.main_metric, "rows": self.rows}
        payload.update({k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in self.extra.items()})
        texts = {"csv": self.to_pandas().to_csv(index=False),
                 "json": json.dumps(payload, indent=1, default=_json_default),
                 "md": self.to_markdown() + "\n"}
        frame = self.examples_frame()
        if frame is not None:
            paths["examples"] = os.path.join(out_dir, f"{stem}.examples.csv")
            texts["examples"] = frame.to_csv(index=False)
        for k, text in texts.items():
            atomic_write(paths[k], lambda f, text=text: f.write(text.encode("utf-8")))
        return paths


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)


LEVEL = 0.95


def bootstrap_settings(n_boot: int = N_BOOT, seed: int = 0, level: float = LEVEL) -> dict:
    """How the intervals of a table were resampled (written into its JSON and meta.json; docs/files.md)."""
    return {"method": "paired percentile bootstrap", "resamples": int(n_boot), "seed": int(seed), "level": level,
            "monte_carlo_z": MC_Z}


class DeltaIntervals:
    """Paired bootstrap intervals of metric changes against the first (baseline) evaluation: of the main metric,
    and of every further metric the per-example outputs score (`ExampleScores.others`), all on the same
    resamples."""

    def __init__(self, n_boot: int = N_BOOT, seed: int = 0, level: float = LEVEL):
        self.n_boot, self.seed, self.level = n_boot, seed, level
        self.base = {}  # metric → the baseline's value on every resample
        self.n = None

    def add(self, row: dict, main_metric: str, examples) -> None:
        """For each metric m (the main one, then `examples.others`), put the interval of row["delta_m"] into
        row["delta_m_lo"], row["delta_m_hi"], and whether it excludes 0 beyond Monte-Carlo noise into
        row["delta_m_excludes_0"] (nothing without per-example outputs)."""
        if examples is None or self.n_boot == 0:
            return
        if self.n is not None and examples.n != self.n:
            raise AttnkitError(f"paired resampling needs the same examples in every setting: {examples.n} vs {self.n}")
        self.n = examples.n
        for name in (main_metric, *examples.others):
            values = bootstrap_values(examples if name == main_metric else examples.of(name), self.n_boot, self.seed)
            diff = values - self.base.setdefault(name, values)
            key = f"delta_{name}"
            row[f"{key}_lo"], row[f"{key}_hi"] = percentile_interval(diff, self.level)
            row[f"{key}_excludes_0"] = excludes_zero(diff, self.level)


def add_deltas(row: dict, metrics: dict, base: dict, main_metric: str, examples) -> None:
    """row["delta_m"] = metrics[m] − base[m] for the main metric and every further metric of the per-example
    outputs (`ExampleScores.others`)."""
    for name in (main_metric, *(examples.others if examples is not None else ())):
        row[f"delta_{name}"] = metrics[name] - base[name]


def evaluate_settings(experiment: str, settings: list[Setting], evaluate, progress: bool = True) -> list[tuple]:
    """(metrics, per-example outputs or None) of every setting: in one sweep when the evaluator can run several
    settings together (`evaluate.evaluate_many`, e.g. `TaskEvaluator`), else one evaluation after the other."""
    ivs = [s.intervention for s in settings]
    if hasattr(evaluate, "evaluate_many"):
        return evaluate.evaluate_many(ivs, progress=progress, desc=experiment)
    return one_by_one(evaluate, ivs, progress, experiment)


def run_settings(experiment: str, settings: list[Setting], evaluate: Callable[[Intervention], dict], main_metric: str,
                 progress: bool = True, n_boot: int = N_BOOT, seed: int = 0) -> ResultTable:
    """Evaluate every setting (the first must be the baseline) → table with Δ of the main metric (and its
    paired bootstrap 95% interval from `n_boot` resamples when the evaluation leaves per-example outputs)."""
    if not settings:
        raise AttnkitError("no settings to evaluate")
    results = evaluate_settings(experiment, settings, evaluate, progress)
    rows, examples = [], []
    base = None
    intervals = DeltaIntervals(n_boot, seed)
    for s, (m, ex) in zip(settings, results):
        if main_metric not in m:
            raise AttnkitError(f"the evaluation returned no {main_metric!r} (got {sorted(m)})")
        if base is None:
            base = m
        if isinstance(base[main_metric], float) and math.isnan(base[main_metric]):
            raise AttnkitError(f"the baseline {main_metric} is NaN (undefined on this data): the table would "
                               f"hold only NaN; check the data file's gold labels or scores")
        row = {"setting": s.name, **s.info, **{k: v for k, v in m.items()}}
        add_deltas(row, m, base, main_metric, ex)
        intervals.add(row, main_metric, ex)
        rows.append(row)
        examples.append(ex)
    undefined = [r["setting"] for r in rows if isinstance(r[main_metric], float) and math.isnan(r[main_metric])]
    if undefined:
        log.warning("warning: %s is NaN (undefined: the model's outputs were constant) for %d setting(s): %s",
                    main_metric, len(undefined), ", ".join(undefined[:5]) + (" ..." if len(undefined) > 5 else ""))
    return ResultTable(experiment, main_metric, rows, {"bootstrap": bootstrap_settings(n_boot, seed)}, examples)


# --- settings -----------------------------------------------------------------------------------------
def _kept(shape, kept) -> np.ndarray:
    """The layers × heads grid of the heads a model has (`pruned_head_grid`; None: all): the heads of a pruned
    model that were removed are not settings of any experiment (docs/pruning.md)."""
    return np.ones(shape, dtype=bool) if kept is None else np.asarray(kept, dtype=bool)


def heads_settings(shape, mode: str = "zero", means=None, kept=None) -> list[Setting]:
    """The baseline, then every head alone in `mode` (mean: the head's corpus mean from `means`); `kept`: the
    heads the model has (a pruned model's removed heads are left out)."""
    L, H = shape
    kept = _kept(shape, kept)
    out = [Setting("baseline", Intervention.identity(L, H), {"layer": None, "head": None})]
    for layer in range(L):
        for head in np.flatnonzero(kept[layer]).tolist():
            iv = Intervention.from_heads(shape, [(layer, head)], mode=mode, means=means)
            out.append(Setting(f"L{layer}H{head} {mode}", iv, {"layer": layer, "head": head}))
    return out


def layers_settings(shape, mode: str = "uniform", means=None, kept=None) -> list[Setting]:
    """The baseline, then every layer alone with all its heads in `mode` (`kept`: the heads the model has; a layer
    without any is no setting)."""
    L, H = shape
    kept = _kept(shape, kept)
    out = [Setting("baseline", Intervention.identity(L, H), {"layer": None})]
    for layer in range(L):
        heads = [(layer, h) for h in np.flatnonzero(kept[layer]).tolist()]
        if not heads:
            continue
        iv = Intervention.from_heads(shape, heads, mode=mode, means=means)
        out.append(Setting(f"L{layer} {mode}", iv, {"layer": layer}))
    return out


def best_head_settings(shape, mode: str = "zero", means=None, kept=None) -> list[Setting]:
    """Michel et al. Table 4: the baseline, then in every layer all heads but one in `mode`, for each choice of the
    head kept (`kept`: the heads the model has; a layer with fewer than two is no setting)."""
    L, H = shape
    kept = _kept(shape, kept)
    out = [Setting("baseline", Intervention.identity(L, H), {"layer": None, "head": None})]
    for layer in range(L):
        heads = np.flatnonzero(kept[layer]).tolist()
        if len(heads) < 2:
            continue
        for head in heads:
            iv = Intervention.from_heads(shape, [(layer, h) for h in heads if h != head], mode=mode, means=means)
            out.append(Setting(f"L{layer} only H{head}", iv, {"layer": layer, "head": head}))
    return out


LOWER_IS_BETTER = ("loss",)  # main metrics where less is better (the language-model losses); scores: more


def mark_best_heads(table: ResultTable) -> ResultTable:
    """Each row of a best_head table gets `best`: True for the kept head that scores best in its layer (the
    lowest loss, else the highest score; NaN never), False for the others, None for the baseline; the Markdown then
    shows the baseline and each layer's best row (the CSV and JSON all of them)."""
    metric, sign = table.main_metric, (1.0 if table.main_metric in LOWER_IS_BETTER else -1.0)
    best: dict = {}
    for i, row in enumerate(table.rows[1:], start=1):
        value = row[metric]
        if not (isinstance(value, float) and math.isnan(value)) and (
                row["layer"] not in best or sign * value < sign * table.rows[best[row["layer"]]][metric]):
            best[row["layer"]] = i
    chosen = set(best.values())
    for i, row in enumerate(table.rows):
        row["best"] = None if i == 0 else i in chosen
    table.shown = [0, *sorted(chosen)]
    return table


def types_settings(shape, head_types: HeadTypes, renormalize: bool = False, means=None, kept=None) -> list[Setting]:
    """Guan et al. Tables 2 and 3 for whatever types the clustering found. `renormalize` rescales what is
    left of a row after removing intra/inter attention (Guan et al. do not; default off). With `means` (the
    heads' corpus means), Table 2 mean-ablates where it prunes.

    Columns per type say what happens to it: keep, 0 (pruned), mean (mean-ablated), 1/n (substituted), -intra,
    -inter.
    """
    if kept is not None and not _kept(shape, kept).all():  # a pruned model: its removed heads belong to no type
        head_types = HeadTypes(np.where(_kept(shape, kept), head_types.grid, ""), head_types.source)
    types = head_types.types
    if not types:
        raise AttnkitError("the clusters name no head types")

    def row(table, name, iv, what):
        info = {"table": table, **{t: what.get(t, "keep") for t in types}, "heads": len(iv.changed_heads())}
        return Setting(name, iv, info)

    out = [row("-", "baseline", Intervention.identity(*shape), {})]
    first = ("mean", "mean", "mean-ablate") if means is not None else ("zero", "0", "prune")
    for mode, sym, verb in (first, ("uniform", "1/n", "substitute")):
        groups = [(t,) for t in types] + list(itertools.combinations(types, 2))
        for g in groups:
            iv = Intervention.from_types(shape, head_types, list(g), mode=mode, means=means)
            out.append(row("2", f"{verb} {' & '.join(g)}", iv, {t: sym for t in g}))
    for region, part in (("no_intra", "intra"), ("no_inter", "inter")):
        for t in types:
            iv = Intervention.from_types(shape, head_types, [t], mode="keep", region=region, renormalize=renormalize)
            out.append(row("3", f"remove {part} of {t}", iv, {t: f"-{part}"}))
    for region, part in (("no_intra", "intra"), ("no_inter", "inter")):
        for t in types:
            others = [o for o in types if o != t]
            if not others:
                continue
            iv = Intervention.from_types(shape, head_types, others, mode="keep", region=region,
                                         renormalize=renormalize)
            out.append(row("3", f"only {t} keeps {part}", iv, {o: f"-{part}" for o in others}))
    return out


# --- experiment drivers -------------------------------------------------------------------------------
def run_experiment(experiment: str, model, evaluate: Callable[[Intervention], dict], main_metric: str, *,
                   mode: str = "zero", head_types: HeadTypes | None = None, losses=None, step: float = 0.1,
                   max_share: float = 1.0, normalize_layers: bool = True, renormalize: bool = False,
                   progress: bool = True, n_boot: int = N_BOOT, means=None, patching=None) -> ResultTable:
    """Run `experiment` (types, heads, layers, importance, patching, best_head) and return its table. Mode mean
    (heads, layers, types) replaces each head's output by its corpus mean from `means` (`attnkit.head_means`);
    patching needs the `PatchingTask` that `evaluate` evaluates, as `patching`."""
    shape = Intervention.for_model(model).shape
    kept = pruned_head_grid(model)  # heads a pruning removed are no settings of any table
    table = _run_experiment(experiment, model, evaluate, main_metric, shape, kept, mode=mode, head_types=head_types,
                            losses=losses, step=step, max_share=max_share, normalize_layers=normalize_layers,
                            renormalize=renormalize, progress=progress, n_boot=n_boot, means=means, patching=patching)
    if not kept.all():
        table.extra["removed_heads"] = [[int(l), int(h)] for l, h in np.argwhere(~kept)]
    return table


def _run_experiment(experiment, model, evaluate, main_metric, shape, kept, *, mode, head_types, losses, step,
                    max_share, normalize_layers, renormalize, progress, n_boot, means, patching) -> ResultTable:
    if experiment == "patching":
        if patching is None:
            raise AttnkitError(f"the patching experiment needs {arg('patching')}: the PatchingTask with the clean and "
                               "corrupted inputs (attnkit.ablation.patching)")
        settings = [Setting(name, iv, info) for name, iv, info in patching.settings_for(model)
                    if info.get("layer") is None or kept[info["layer"], info["head"]]]
        return run_settings("patching", settings, evaluate, main_metric, progress, n_boot)
    if mode == "mean" and experiment == "importance":
        raise AttnkitError("the importance experiment prunes with mode zero or uniform, not mean")
    if mode == "mean" and means is None:
        raise AttnkitError(f"mode mean needs {arg('means')}: the heads' mean outputs (attnkit.head_means)")
    if experiment == "heads":
        return run_settings("heads", heads_settings(shape, mode, means, kept), evaluate, main_metric, progress,
                            n_boot)
    if experiment == "best_head":
        return mark_best_heads(run_settings("best_head", best_head_settings(shape, mode, means, kept), evaluate,
                                            main_metric, progress, n_boot))
    if experiment == "layers":
        return run_settings("layers", layers_settings(shape, mode, means, kept), evaluate, main_metric, progress,
                            n_boot)
    if experiment == "types":
        if head_types is None:
            raise AttnkitError(f"the types experiment needs {arg('head_types')}: the head types of a clustered run "
                               "(attnkit.interventions.load_clusters)")
        settings = types_settings(shape, head_types, renormalize, means if mode == "mean" else None, kept)
        return run_settings("types", settings, evaluate, main_metric, progress, n_boot)
    if experiment == "importance":
        if losses is None:
            raise AttnkitError(f"the importance experiment needs {arg('losses')}: the task's differentiable loss")
        return importance_table(model, evaluate, losses, main_metric, shape, kept, mode=mode, step=step,
                                max_share=max_share, normalize_layers=normalize_layers, progress=progress,
                                n_boot=n_boot)
    raise AttnkitError(f"unknown {arg('experiment')} {experiment!r}; use one of {', '.join(EXPERIMENTS)}")


def kind_masks(model, shape) -> dict:
    """An encoder–decoder's heads by kind (encoder, decoder, cross: docs/seq2seq.md §2), each a layers × heads
    boolean array; {} for a model of one kind."""
    from ..models import layer_kinds

    kinds = [k for k, _ in layer_kinds(model)]
    if len(set(kinds)) < 2 or len(kinds) != shape[0]:
        return {}
    return {kind: np.repeat((np.array(kinds) == kind)[:, None], shape[1], axis=1) for kind in dict.fromkeys(kinds)}


def _curve_rows(res: dict, examples: list, main_metric: str, base: dict, intervals: DeltaIntervals,
                kind: str | None) -> list[dict]:
    """The rows of one pruning curve (`iterative_pruning`'s result): `kind` None for the only curve of a model of
    one kind, "all" for the curve over all heads, else the kind pruned alone."""
    rows, prev = [], []
    for i, s in enumerate(res["steps"]):
        new = [h for h in s["heads"] if h not in prev]
        prev = s["heads"]
        ex = examples[i] if i < len(examples) else None
        if kind in (None, "all"):
            name = "baseline" if s["pruned"] == 0 else f"prune {s['pruned']} heads"
        else:
            name = f"prune {s['pruned']} {kind} heads"
        row = {"setting": name, **({} if kind is None else {"kind": kind}), "pruned": s["pruned"],
               "share": s["share"], **s["metrics"]}
        add_deltas(row, s["metrics"], base, main_metric, ex)
        row["newly_pruned"] = format_heads(new)
        intervals.add(row, main_metric, ex)
        rows.append(row)
    return rows


def importance_table(model, evaluate, losses, main_metric: str, shape, kept, *, mode: str, step: float,
                     max_share: float, normalize_layers: bool, progress: bool, n_boot: int) -> ResultTable:
    """Michel et al.'s importance and iterative pruning over all heads; on an encoder–decoder also one curve per
    kind of attention, each pruning that kind's heads alone by importance, the others intact (their Enc-Enc, Dec-Dec
    and Enc-Dec curves; `iterative_pruning(..., among=)`), its rows after the curve over all heads with `kind`
    saying which curve a row belongs to. Every change is against the unpruned model."""
    masks = kind_masks(model, shape)
    curves = [("all" if masks else None, None), *masks.items()]
    intervals = DeltaIntervals(n_boot)
    rows, examples, first, base = [], [], None, None
    for kind, among in curves:
        kept_examples: list = []

        def evaluate_and_keep(iv, kept_examples=kept_examples):
            m = evaluate(iv)
            kept_examples.append(getattr(evaluate, "last_examples", None))
            return m

        res = iterative_pruning(model, evaluate_and_keep, losses, mode=mode, step=step, max_share=max_share,
                                normalize_layers=normalize_layers, progress=progress, among=among)
        if first is None:
            first, base = res, res["steps"][0]["metrics"]
        rows += _curve_rows(res, kept_examples, main_metric, base, intervals, kind)
        examples += kept_examples + [None] * (len(res["steps"]) - len(kept_examples))
    if mode == "zero" and pruning_supported(model):  # Michel et al.'s curve with the real sizes of each step
        for row, size in zip(rows, pruned_sizes(model, [s["heads"] for s in first["steps"]], progress=progress)):
            row.update(size)
    imp = first["importance"]
    extra = {"importance": imp["importance"], "importance_raw": imp["raw"], "importance_n": imp["n"],
             "normalize_layers": normalize_layers, "mode": mode,
             "ranking": format_heads(tuple(int(x) for x in np.unravel_index(f, shape))
                                     for f in np.argsort(-imp["importance"], axis=None, kind="stable")
                                     if kept.flat[f])}  # heads removed before have no rank
    extra["bootstrap"] = bootstrap_settings(n_boot)
    return ResultTable("importance", main_metric, rows, extra, examples)
