"""Ablation experiments: lists of interventions ("settings"), their evaluation, tables and figures.

* `types`  — Guan et al. 2020 Table 2 (prune = zero / substitute = uniform 1/n each head type and each
  pair of types) and Table 3 (remove the intra- or inter-sentence attention of one type; keep one type's
  intra/inter attention only, i.e. remove it from every other type).
* `heads`  — Kovaleva et al. Fig. 8 / Michel et al. Table 3: one head at a time (zero or uniform).
* `layers` — Kovaleva et al. Fig. 9: one whole layer at a time.
* `importance` — Michel et al.: gradient importance + iterative pruning (see `importance.py`); with mode zero every
  step also gets the parameters, FLOPs per token and tokens/s of the model with its heads removed (`sizes.py`).

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

from ..errors import AttnkitError, arg
from ..interventions import HeadTypes, Intervention, format_heads, intervene
from ..run.outputs import atomic_write, ensure_writable_dir
from .importance import iterative_pruning
from .names import EXPERIMENTS
from .sizes import pruned_sizes, pruning_supported

log = logging.getLogger("attnkit")

MODE_LABEL = {"zero": "prune (0)", "uniform": "substitute (1/n)"}


@dataclass
class Setting:
    name: str
    intervention: Intervention
    info: dict = field(default_factory=dict)  # extra table columns (layer, head, type, ...)


class TaskEvaluator:
    """Callable(intervention) → metrics of `task` on `model` under that intervention."""

    def __init__(self, task, model, tokenizer, limit=None, batch_size=32):
        self.task, self.model, self.tokenizer = task, model, tokenizer
        self.limit, self.batch_size = limit, batch_size
        self.main_metric = task.main_metric

    def __call__(self, iv: Intervention) -> dict:
        self.task.last_examples = None
        with intervene(self.model, iv):
            return self.task.evaluate(self.model, self.tokenizer, limit=self.limit, batch_size=self.batch_size)

    @property
    def last_examples(self):
        """Per-example outputs of the last evaluation (`ExampleScores`), when the task leaves them."""
        return getattr(self.task, "last_examples", None)


@dataclass
class ResultTable:
    experiment: str
    main_metric: str
    rows: list  # dicts; rows[0] is the baseline
    extra: dict = field(default_factory=dict)  # e.g. importance matrices

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
        for r in self.rows:
            lines.append("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
        return "\n".join(lines)

    def save(self, out_dir: str, stem: str | None = None) -> dict:
        """Write <stem>.csv, .json and .md into `out_dir` (each atomically; an OS error is one line)."""
        ensure_writable_dir(out_dir)
        stem = stem or self.experiment
        paths = {k: os.path.join(out_dir, f"{stem}.{k}") for k in ("csv", "json", "md")}
        payload = {"experiment": self.experiment, "main_metric": self.main_metric, "rows": self.rows}
        payload.update({k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in self.extra.items()})
        texts = {"csv": self.to_pandas().to_csv(index=False),
                 "json": json.dumps(payload, indent=1, default=_json_default),
                 "md": self.to_markdown() + "\n"}
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


N_BOOT = 1000
LEVEL = 0.95


class DeltaIntervals:
    """Paired bootstrap intervals of main-metric changes against the first (baseline) evaluation."""

    def __init__(self, n_boot: int = N_BOOT, seed: int = 0, level: float = LEVEL):
        self.n_boot, self.seed, self.level = n_boot, seed, level
        self.draws = self.base = None

    def add(self, row: dict, key: str, examples) -> None:
        """Put the interval of row[key] into row[key + "_lo"], row[key + "_hi"] (nan without examples)."""
        from .metrics import bootstrap_values, percentile_interval, resample_indices

        if examples is None or self.n_boot == 0:
            return
        if self.draws is None:
            self.draws = resample_indices(examples.n, self.n_boot, self.seed)
            self.base = bootstrap_values(examples, self.draws)
        lo, hi = percentile_interval(bootstrap_values(examples, self.draws) - self.base, self.level)
        row[f"{key}_lo"], row[f"{key}_hi"] = lo, hi


def run_settings(experiment: str, settings: list[Setting], evaluate: Callable[[Intervention], dict], main_metric: str,
                 progress: bool = True, n_boot: int = N_BOOT, seed: int = 0) -> ResultTable:
    """Evaluate every setting (the first must be the baseline) → table with Δ of the main metric (and its
    paired bootstrap 95% interval from `n_boot` resamples when `evaluate.last_examples` is available)."""
    if not settings:
        raise AttnkitError("no settings to evaluate")
    rows = []
    it = settings
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(settings, desc=experiment, unit="setting", dynamic_ncols=True)
    base = None
    intervals = DeltaIntervals(n_boot, seed)
    for s in it:
        m = evaluate(s.intervention)
        if main_metric not in m:
            raise AttnkitError(f"the evaluation returned no {main_metric!r} (got {sorted(m)})")
        if base is None:
            base = m[main_metric]
        if isinstance(base, float) and math.isnan(base):
            raise AttnkitError(f"the baseline {main_metric} is NaN (undefined on this data): the table would "
                               f"hold only NaN; check the data file's gold labels or scores")
        row = {"setting": s.name, **s.info, **{k: v for k, v in m.items()}}
        row[f"delta_{main_metric}"] = m[main_metric] - base
        intervals.add(row, f"delta_{main_metric}", getattr(evaluate, "last_examples", None))
        rows.append(row)
    undefined = [r["setting"] for r in rows if isinstance(r[main_metric], float) and math.isnan(r[main_metric])]
    if undefined:
        log.warning("warning: %s is NaN (undefined: the model's outputs were constant) for %d setting(s): %s",
                    main_metric, len(undefined), ", ".join(undefined[:5]) + (" ..." if len(undefined) > 5 else ""))
    return ResultTable(experiment, main_metric, rows)


# --- settings -----------------------------------------------------------------------------------------
def heads_settings(shape, mode: str = "zero") -> list[Setting]:
    L, H = shape
    out = [Setting("baseline", Intervention.identity(L, H), {"layer": None, "head": None})]
    for layer in range(L):
        for head in range(H):
            out.append(Setting(f"L{layer}H{head} {mode}", Intervention.from_heads(shape, [(layer, head)], mode=mode),
                               {"layer": layer, "head": head}))
    return out


def layers_settings(shape, mode: str = "uniform") -> list[Setting]:
    L, H = shape
    out = [Setting("baseline", Intervention.identity(L, H), {"layer": None})]
    for layer in range(L):
        out.append(Setting(f"L{layer} {mode}", Intervention.from_layers(shape, [layer], mode=mode), {"layer": layer}))
    return out


def types_settings(shape, head_types: HeadTypes, renormalize: bool = False) -> list[Setting]:
    """Guan et al. Tables 2 and 3 for whatever types the clustering found. `renormalize` rescales what is
    left of a row after removing intra/inter attention (Guan et al. do not; default off).

    Columns per type say what happens to it: keep, 0 (pruned), 1/n (substituted), -intra, -inter.
    """
    types = head_types.types
    if not types:
        raise AttnkitError("the clusters name no head types")

    def row(table, name, iv, what):
        info = {"table": table, **{t: what.get(t, "keep") for t in types}, "heads": len(iv.changed_heads())}
        return Setting(name, iv, info)

    out = [row("-", "baseline", Intervention.identity(*shape), {})]
    for mode, sym in (("zero", "0"), ("uniform", "1/n")):
        verb = "prune" if mode == "zero" else "substitute"
        groups = [(t,) for t in types] + list(itertools.combinations(types, 2))
        for g in groups:
            iv = Intervention.from_types(shape, head_types, list(g), mode=mode)
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
                   progress: bool = True, n_boot: int = N_BOOT) -> ResultTable:
    shape = Intervention.for_model(model).shape
    if experiment == "heads":
        return run_settings("heads", heads_settings(shape, mode), evaluate, main_metric, progress, n_boot)
    if experiment == "layers":
        return run_settings("layers", layers_settings(shape, mode), evaluate, main_metric, progress, n_boot)
    if experiment == "types":
        if head_types is None:
            raise AttnkitError(f"the types experiment needs {arg('head_types')}: the head types of a clustered run "
                               "(attnkit.interventions.load_clusters)")
        return run_settings("types", types_settings(shape, head_types, renormalize), evaluate, main_metric, progress,
                            n_boot)
    if experiment == "importance":
        if losses is None:
            raise AttnkitError(f"the importance experiment needs {arg('losses')}: the task's differentiable loss")
        examples = []

        def evaluate_and_keep(iv):
            m = evaluate(iv)
            examples.append(getattr(evaluate, "last_examples", None))
            return m

        res = iterative_pruning(model, evaluate_and_keep, losses, mode=mode, step=step, max_share=max_share,
                                normalize_layers=normalize_layers, progress=progress)
        intervals = DeltaIntervals(n_boot)
        base = res["steps"][0]["metrics"][main_metric]
        rows = []
        prev: list = []
        for i, s in enumerate(res["steps"]):
            new = [h for h in s["heads"] if h not in prev]
            prev = s["heads"]
            row = {"setting": "baseline" if s["pruned"] == 0 else f"prune {s['pruned']} heads",
                   "pruned": s["pruned"], "share": s["share"], **s["metrics"],
                   f"delta_{main_metric}": s["metrics"][main_metric] - base,
                   "newly_pruned": format_heads(new)}
            intervals.add(row, f"delta_{main_metric}", examples[i] if i < len(examples) else None)
            rows.append(row)
        if mode == "zero" and pruning_supported(model):  # Michel et al.'s curve with the real sizes of each step
            for row, size in zip(rows, pruned_sizes(model, [s["heads"] for s in res["steps"]], progress=progress)):
                row.update(size)
        imp = res["importance"]
        extra = {"importance": imp["importance"], "importance_raw": imp["raw"], "importance_n": imp["n"],
                 "normalize_layers": normalize_layers, "mode": mode,
                 "ranking": format_heads(tuple(int(x) for x in np.unravel_index(f, shape))
                                         for f in np.argsort(-imp["importance"], axis=None, kind="stable"))}
        return ResultTable("importance", main_metric, rows, extra)
    raise AttnkitError(f"unknown {arg('experiment')} {experiment!r}; use one of {', '.join(EXPERIMENTS)}")
