"""The results of other commands that a run's report shows: `attnkit patterns` (RUN/patterns.json), `attnkit probe`
and `attnkit ablate` written into the run directory (`-o RUN`) or into a directory given to `attnkit report
--include`. What cannot be shown beside the run's heads (another model's shape, an unreadable file) is listed with
the reason, and the report links it.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from ..run.files import PATTERNS_FILE, PROBE_CSV, PROBE_HEATMAP, PROBE_JSON

ALL_RELATIONS = "(all)"


@dataclass
class Attached:
    """What was found: `patterns` (patterns.json's content and its path), `probe` (accuracy per head and relation,
    the baselines, probe.json and the directory), `ablations` (one entry per experiment table), and `links`
    ((label, path, why) of results that are not shown)."""

    patterns: dict | None = None
    probe: dict | None = None
    ablations: list = field(default_factory=list)
    links: list = field(default_factory=list)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AttnkitError(f"{path} is unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise AttnkitError(f"{path} is not a JSON object")
    return data


def read_patterns(path: Path, shape: tuple[int, int]) -> dict:
    data = _read_json(path)
    classes = data.get("classes")
    per_head = data.get("per_head")
    if not isinstance(classes, list) or not isinstance(per_head, dict):
        raise AttnkitError(f"{path} lacks classes or per_head")
    shares = np.array([per_head[c] for c in classes], dtype=np.float64)  # classes × L × H
    if shares.shape[1:] != shape:
        raise AttnkitError(f"{path} covers {shares.shape[1]} layers × {shares.shape[2]} heads, the run "
                           f"{shape[0]} × {shape[1]}")
    return {"path": path, "data": data, "classes": classes, "shares": shares}


def read_probe(directory: Path, shape: tuple[int, int]) -> dict:
    """Accuracy (the better direction) per head and relation from probe.csv, the baselines and probe.json."""
    summary = _read_json(directory / PROBE_JSON)
    if (summary.get("layers"), summary.get("heads")) != shape:
        raise AttnkitError(f"the probe ran on a model of {summary.get('layers')} layers × {summary.get('heads')} "
                           f"heads, the run has {shape[0]} × {shape[1]}")
    min_count = int((summary.get("settings") or {}).get("min_count") or 1)
    acc: dict[str, np.ndarray] = {}
    base, counts = {}, {}
    try:
        with open(directory / PROBE_CSV, newline="", encoding="utf-8") as f:
            for r in csv.DictReader(f):
                rel, l, h = r["relation"], int(r["layer"]), int(r["head"])
                grid = acc.setdefault(rel, np.zeros(shape))
                grid[l, h] = max(grid[l, h], float(r["accuracy"]))  # the better direction, whatever they are
                base[rel], counts[rel] = float(r["baseline_accuracy"]), int(r["count"])
    except (OSError, KeyError, ValueError, IndexError) as exc:
        raise AttnkitError(f"{directory / PROBE_CSV} is unreadable: {type(exc).__name__}: {exc}") from None
    relations = sorted((r for r in acc if counts[r] >= min_count), key=lambda r: (r != ALL_RELATIONS, -counts[r]))
    if not relations:
        raise AttnkitError(f"{directory / PROBE_CSV} has no relation with at least {min_count} dependencies")
    return {"path": directory, "summary": summary, "relations": relations,
            "acc": np.stack([acc[r] for r in relations], axis=-1),  # L × H × relations
            "baseline": np.array([base[r] for r in relations]), "counts": [counts[r] for r in relations],
            "heatmap": directory / f"{PROBE_HEATMAP}.png"}


def read_ablation(meta_path: Path, shape: tuple[int, int]) -> dict:
    """One `attnkit ablate` table (E.json beside E.meta.json) with its per-head effects where it has them."""
    meta = _read_json(meta_path)
    experiment = meta.get("experiment")
    table_path = meta_path.with_name(f"{experiment}.json")
    data = _read_json(table_path)
    rows, metric = data.get("rows"), data.get("main_metric")
    if not isinstance(rows, list) or not rows or not metric:
        raise AttnkitError(f"{table_path} holds no rows")
    out = {"experiment": experiment, "metric": metric, "path": table_path, "meta": meta, "rows": rows,
           "figure": meta_path.with_name(f"{experiment}.png")}
    key = f"delta_{metric}"
    if experiment == "heads":
        delta, lo, hi = (np.full(shape, np.nan) for _ in range(3))
        for r in rows[1:]:
            l, h = r.get("layer"), r.get("head")
            if not (isinstance(l, int) and isinstance(h, int) and l < shape[0] and h < shape[1]):
                raise AttnkitError(f"{table_path} names head L{l}H{h}, outside the run's {shape[0]} × {shape[1]}")
            delta[l, h] = np.nan if r.get(key) is None else r[key]
            lo[l, h] = np.nan if r.get(f"{key}_lo") is None else r[f"{key}_lo"]
            hi[l, h] = np.nan if r.get(f"{key}_hi") is None else r[f"{key}_hi"]
        out.update(delta=delta, lo=lo, hi=hi)
    elif experiment == "importance":
        imp = np.asarray(data.get("importance"), dtype=np.float64)
        if imp.shape != shape:
            raise AttnkitError(f"{table_path} holds importance scores of shape {imp.shape}, the run {shape}")
        out["importance"] = imp
    return out


def find_attached(run_dir, shape: tuple[int, int], include=()) -> Attached:
    """Patterns, probe and ablation results of a run: in `run_dir` and in the directories `include` names."""
    run_dir = Path(run_dir)
    found = Attached()
    places = [run_dir] + [Path(p) if Path(p).is_dir() else Path(p).parent for p in include]
    if (run_dir / PATTERNS_FILE).is_file():
        try:
            found.patterns = read_patterns(run_dir / PATTERNS_FILE, shape)
        except AttnkitError as exc:
            found.links.append(("pattern classes", run_dir / PATTERNS_FILE, str(exc)))
    for place in dict.fromkeys(places):
        if (place / PROBE_JSON).is_file():
            try:
                probe = read_probe(place, shape)
                if found.probe is None:
                    found.probe = probe
                else:
                    found.links.append(("syntax probe", place / PROBE_JSON, "a second probe result (the report "
                                                                            f"shows {found.probe['path']})"))
            except AttnkitError as exc:
                found.links.append(("syntax probe", place / PROBE_JSON, str(exc)))
        for meta_path in sorted(place.glob("*.meta.json")):
            try:
                found.ablations.append(read_ablation(meta_path, shape))
            except AttnkitError as exc:
                found.links.append(("ablation", meta_path, str(exc)))
    return found


__all__ = ["Attached", "find_attached", "read_ablation", "read_patterns", "read_probe"]
