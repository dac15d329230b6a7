"""The results of other commands that a run's report shows: `attnkit patterns` (RUN/patterns.json), `attnkit probe`,
`attnkit ablate` and `attnkit detect-heads` written into the run directory (`-o RUN`) or into a directory given to
`attnkit report --include`, and a run of the same corpus under the other weighting given to `--include` (how much
first-token or [CLS] mass survives norm weighting). What cannot be shown beside the run's heads (another model's
shape, an unreadable file) is listed with the reason, and the report names it.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from ..features import weighting_of
from ..jobs.detect_options import KINDS
from ..run.distances import HeadDistances, distances_file
from ..run.files import (
    DETECTED_HEADS_FILE,
    DETECTED_HEADS_META,
    DISTANCES_FILE,
    FEATURES_FILE,
    LEGACY_DETECTED_HEADS,
    META_FILE,
    PATTERNS_FILE,
    PROBE_CSV,
    PROBE_HEATMAP,
    PROBE_JSON,
)
from ..run.head_features import HeadFeatures
from ..run.identity import model_mismatch, partial_identity, recorded_identity
from ..run.schemas import (
    ABLATION_META_SCHEMA,
    ABLATION_TABLE_SCHEMA,
    DETECTED_HEADS_SCHEMA,
    META_SCHEMA,
    PATTERNS_SCHEMA,
    PROBE_SCHEMA,
    load_json,
)
from .weighting import compare_weightings

ALL_RELATIONS = "(all)"
ABLATION_META_SUFFIX = ".meta.json"


@dataclass
class Attached:
    """What was found: `patterns` (patterns.json's content and its path), `probe` (accuracy per head and relation,
    the baselines, probe.json and the directory), `ablations` (one entry per experiment table), `detected` (the
    scores of `attnkit detect-heads`, `read_detected`), `weighting` (the run against a run of the other weighting,
    `attnkit.analysis.weighting.compare_weightings`, with `other`: that run's directory), `links` ((label,
    path, why) of results that are not shown: another model's, or unreadable beside a readable file) and `partial`
    (the files shown whose model could be compared with the run's only in part: made before attnkit recorded the
    model's identity, attnkit/run/identity.py); `distances` (RUN/distances.npz, `read_distances`, when it is the
    run's); `distances_by_kind` (an encoder–decoder's run: {kind: its RUN/distances_KIND.npz} for the kinds whose file
    is the run's, in the run's order of kinds)."""

    patterns: dict | None = None
    probe: dict | None = None
    ablations: list = field(default_factory=list)
    detected: dict | None = None
    weighting: dict | None = None
    links: list = field(default_factory=list)
    partial: list = field(default_factory=list)
    distances: HeadDistances | None = None
    distances_by_kind: dict = field(default_factory=dict)


class _Elsewhere(Exception):
    """A readable result that does not belong beside the run's heads (another model's, a table that is missing):
    the report links it with this reason. Damaged files raise AttnkitError instead."""


def _same_model(run: dict | None, record: dict, path: Path, partial: list | None, n_layers=None,
                n_heads=None) -> None:
    """Raise _Elsewhere when the file `path`, whose JSON object is `record`, was made with another model than the
    run's (`run`: the run's recorded identity; None: not compared); note in `partial` a file compared only in
    part."""
    if run is None:
        return
    theirs = recorded_identity(record, n_layers, n_heads)
    why = model_mismatch(run, theirs)
    if why:
        raise _Elsewhere(why)
    if partial is not None and partial_identity(run, theirs):
        partial.append(path)


def read_distances(path: Path, shape: tuple[int, int], meta: dict, run: dict | None = None,
                   partial: list | None = None, kind: str | None = None) -> HeadDistances:
    """RUN/distances.npz (`HeadDistances.load`), or with `kind` an encoder–decoder's RUN/distances_KIND.npz
    (`shape`: that kind's layers × heads in the run), when it was measured with the run's model (`run`, `partial`: as
    `_same_model`'s; a file without `model_identity` is compared by its layers × heads) over the run's corpus
    (`meta`: the run's meta.json, whose settings.corpus_sha256 is compared when both record one)."""
    dist = HeadDistances.load(path.parent) if kind is None else HeadDistances.load_kind(path.parent, kind)
    # (a kind's file covers the kind's layers alone: its model identity, the whole model's, is compared as recorded)
    _same_model(run, {"model_identity": dist.meta["model_identity"]} if dist.meta.get("model_identity") else {},
                path, partial, *((dist.n_layers, dist.n_heads) if kind is None else (None, None)))
    if (dist.n_layers, dist.n_heads) != tuple(shape):  # (also when the run is not compared: its shape must fit)
        what = "the run" if kind is None else f"the run's {kind} layers"
        raise _Elsewhere(f"it covers {dist.n_layers} layers × {dist.n_heads} heads, {what} {shape[0]} × {shape[1]}")
    theirs, ours = dist.meta.get("corpus_sha256"), (meta.get("settings") or {}).get("corpus_sha256")
    if theirs and ours and theirs != ours:
        raise _Elsewhere("measured over another corpus than the run's (corpus_sha256 differ): run `attnkit "
                         "distances RUN --overwrite`")
    return dist


def read_patterns(path: Path, shape: tuple[int, int], features: HeadFeatures | None = None) -> dict:
    """patterns.json, validated (PATTERNS_SCHEMA, then every class with a layers × heads grid of the run's shape);
    with the run's `features`, also of its weighting and of no more examples than the run measured samples."""
    data = load_json(path, PATTERNS_SCHEMA)
    if features is not None:
        if data.get("weighting") and data["weighting"] != weighting_of(features.meta):
            raise _Elsewhere(f"its classes are of {data['weighting']}-weighted features, the run's are "
                             f"{weighting_of(features.meta)}-weighted: run `attnkit patterns RUN --overwrite`")
        if features.n_samples and data["n_examples"] > features.n_samples:
            raise _Elsewhere(f"it classified {data['n_examples']} examples, the run measured {features.n_samples} "
                             "samples: it is another run's; run `attnkit patterns RUN --overwrite`")
    classes = data["classes"]
    for part in ("per_head", "per_layer", "overall"):
        missing = [c for c in classes if c not in data[part]]
        if missing:
            raise AttnkitError(f"{path} is unreadable: field {part} lacks the class(es) "
                               f"{', '.join(map(repr, missing))}")
    for c in classes:
        rows = data["per_head"][c]
        widths = {len(r) for r in rows}
        if len(widths) != 1:
            raise AttnkitError(f"{path} is unreadable: field per_head.{c} is ragged (rows of {sorted(widths)} heads)")
        if (len(rows), widths.pop()) != tuple(shape):
            raise _Elsewhere(f"{path} covers {len(rows)} layers × {len(rows[0])} heads, the run "
                             f"{shape[0]} × {shape[1]}")
        if len(data["per_layer"][c]) != shape[0]:
            raise AttnkitError(f"{path} is unreadable: field per_layer.{c} has {len(data['per_layer'][c])} layers, "
                               f"the run {shape[0]}")
    shares = np.array([[[np.nan if x is None else x for x in row] for row in data["per_head"][c]] for c in classes],
                      dtype=np.float64)  # classes × L × H; NaN: a removed head
    if ((shares < 0) | (shares > 1)).any():
        c, l, h = (int(x) for x in np.argwhere((shares < 0) | (shares > 1))[0])
        raise AttnkitError(f"{path}: field per_head.{classes[c]}[{l}][{h}]: a share must lie in 0..1, got "
                           f"{shares[c, l, h]:g}")
    return {"path": path, "data": data, "classes": classes, "shares": shares}


def read_probe(directory: Path, shape: tuple[int, int], run: dict | None = None, partial: list | None = None) -> dict:
    """Accuracy (the better direction) per head and relation from probe.csv, the baselines and probe.json (`run`,
    `partial`: as `_same_model`'s)."""
    summary = load_json(directory / PROBE_JSON, PROBE_SCHEMA)
    if (summary["layers"], summary["heads"]) != tuple(shape):
        raise _Elsewhere(f"the probe ran on a model of {summary['layers']} layers × {summary['heads']} heads, the run "
                         f"has {shape[0]} × {shape[1]}")
    _same_model(run, summary, directory / PROBE_JSON, partial, summary["layers"], summary["heads"])
    min_count = int((summary.get("settings") or {}).get("min_count") or 1)
    acc: dict[str, np.ndarray] = {}
    seen: dict[str, np.ndarray] = {}
    base, counts = {}, {}
    path = directory / PROBE_CSV
    if not path.is_file():
        raise _Elsewhere(f"{path.name} is missing beside {PROBE_JSON}")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for i, r in enumerate(csv.DictReader(f), start=2):
                rel, l, h, a = r["relation"], int(r["layer"]), int(r["head"]), float(r["accuracy"])
                b, n = float(r["baseline_accuracy"]), int(r["count"])
                in_range = (math.isnan(a) or 0 <= a <= 1) and 0 <= b <= 1  # NaN: a removed head's accuracy
                if not (0 <= l < shape[0] and 0 <= h < shape[1] and in_range and n >= 0 and rel):
                    raise ValueError(f"line {i} is out of range")
                grid = acc.setdefault(rel, np.full(shape, np.nan))
                grid[l, h] = np.fmax(grid[l, h], a)  # the better direction, whatever they are
                seen.setdefault(rel, np.zeros(shape, dtype=bool))[l, h] = True
                base[rel], counts[rel] = b, n
        for l, h in summary.get("removed_heads") or []:  # a head removed by pruning has no line
            for grid in seen.values():
                if 0 <= l < shape[0] and 0 <= h < shape[1]:
                    grid[l, h] = True
        short = [r for r in seen if not seen[r].all()]  # every other head has its lines in every relation
        if short:
            raise ValueError(f"relation {short[0]!r} lacks {int((~seen[short[0]]).sum())} of the "
                             f"{seen[short[0]].size} heads (the file is cut short)")
    except (OSError, KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise AttnkitError(f"{path} is unreadable: {type(exc).__name__}: {exc}") from None
    relations = sorted((r for r in acc if counts[r] >= min_count), key=lambda r: (r != ALL_RELATIONS, -counts[r]))
    if not relations:
        raise _Elsewhere(f"{path.name} has no relation with at least {min_count} dependencies")
    return {"path": directory, "summary": summary, "relations": relations,
            "acc": np.stack([acc[r] for r in relations], axis=-1),  # L × H × relations
            "baseline": np.array([base[r] for r in relations]), "counts": [counts[r] for r in relations],
            "heatmap": directory / f"{PROBE_HEATMAP}.png"}


def _number(x) -> float:
    return np.nan if x is None else float(x)


def read_ablation(meta_path: Path, shape: tuple[int, int], run: dict | None = None,
                  partial: list | None = None) -> dict:
    """One `attnkit ablate` table (E.json beside E.meta.json) with its per-head (heads, importance) or per-layer
    (layers) effects. The table's file is named by the meta file's own name, never by a value read from it. `run`,
    `partial`: as `_same_model`'s."""
    meta = load_json(meta_path, ABLATION_META_SCHEMA)
    _same_model(run, meta, meta_path, partial)
    stem = meta_path.name[: -len(ABLATION_META_SUFFIX)]
    table_path = meta_path.with_name(f"{stem}.json")
    if not table_path.is_file():
        raise _Elsewhere(f"{table_path.name} is missing beside {meta_path.name}")
    data = load_json(table_path, ABLATION_TABLE_SCHEMA)
    experiment, rows, metric = data["experiment"], data["rows"], data["main_metric"]
    if experiment != meta["experiment"]:
        raise AttnkitError(f"{table_path} is unreadable: it holds a {experiment!r} table, {meta_path.name} says "
                           f"{meta['experiment']!r}")
    key = f"delta_{metric}"
    for i, r in enumerate(rows):
        for k in (metric, key, f"{key}_lo", f"{key}_hi"):
            if not (r.get(k) is None or isinstance(r[k], (int, float)) and not isinstance(r[k], bool)):
                raise AttnkitError(f"{table_path}: field rows[{i}].{k}: expected a number or null, got "
                                   f"{type(r[k]).__name__} ({str(r[k])[:40]!r})")
    out = {"experiment": experiment, "metric": metric, "path": table_path, "meta_path": meta_path, "meta": meta,
           "rows": rows,
           "figure": meta_path.with_name(f"{stem}.png")}
    if experiment in ("heads", "layers"):
        grid = shape if experiment == "heads" else (shape[0],)
        delta, lo, hi = (np.full(grid, np.nan) for _ in range(3))
        for r in rows[1:]:
            at = (r.get("layer"), r.get("head")) if experiment == "heads" else (r.get("layer"),)
            if not all(isinstance(x, int) and 0 <= x < n for x, n in zip(at, grid)):
                what = f"head L{at[0]}H{at[1]}" if len(at) == 2 else f"layer {at[0]}"
                raise _Elsewhere(f"{table_path.name} names {what}, outside the run's {shape[0]} × {shape[1]}")
            delta[at], lo[at], hi[at] = _number(r.get(key)), _number(r.get(f"{key}_lo")), _number(r.get(f"{key}_hi"))
        out.update(delta=delta, lo=lo, hi=hi)
    elif experiment == "importance":
        try:
            imp = np.array([[_number(x) for x in row] for row in data.get("importance") or []], dtype=np.float64)
        except ValueError:
            imp = np.zeros(0)
        if imp.shape != tuple(shape):
            raise _Elsewhere(f"{table_path.name} holds importance scores of shape {imp.shape}, the run {shape}")
        out["importance"] = imp
    return out


def read_detected(table: Path, meta_path: Path, shape: tuple[int, int], run: dict | None = None,
                  partial: list | None = None) -> dict:
    """`attnkit detect-heads`'s scores (detected_heads.csv, its settings in detected_heads.json; docs/files.md):
    {"path", "source" (its folder and name, as the page names it), "meta", "kinds", "scores": {kind: layers × heads,
    NaN for a head removed by pruning}}. Every (layer,
    head) of the grid must be there once, every score a share (0–1) or empty. `run`, `partial`: as `_same_model`'s."""
    meta = load_json(meta_path, DETECTED_HEADS_SCHEMA)
    kinds = meta["kinds"]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or len(set(kinds)) != len(kinds):
        raise AttnkitError(f"{meta_path}: field kinds: " + (f"unknown kind {unknown[0]!r} (known: {', '.join(KINDS)})"
                                                           if unknown else "a kind is named twice"))
    if (meta["n_layers"], meta["n_heads"]) != tuple(shape):
        raise _Elsewhere(f"the heads were detected on a model of {meta['n_layers']} layers × {meta['n_heads']} heads, "
                         f"the run has {shape[0]} × {shape[1]}")
    _same_model(run, meta, meta_path, partial)
    if not table.is_file():
        raise _Elsewhere(f"{table.name} is missing beside {meta_path.name}")
    scores = np.full((len(kinds),) + tuple(shape), np.nan)
    seen = np.zeros(shape, dtype=bool)
    try:
        with open(table, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header != ["layer", "head", *kinds]:
                raise ValueError(f"its columns are {header}, {meta_path.name} names layer, head, {', '.join(kinds)}")
            for i, row in enumerate(reader, start=2):
                l, h = int(row[0]), int(row[1])
                values = [float(x) if x.strip() else np.nan for x in row[2:]]
                if len(values) != len(kinds) or not (0 <= l < shape[0] and 0 <= h < shape[1]) or seen[l, h]:
                    raise ValueError(f"line {i} is out of range or repeats a head")
                if any(not (np.isnan(v) or 0 <= v <= 1) for v in values):
                    raise ValueError(f"line {i} holds a score outside 0–1")
                scores[:, l, h], seen[l, h] = values, True
    except (OSError, ValueError, IndexError, UnicodeDecodeError, csv.Error) as exc:
        raise AttnkitError(f"{table} is unreadable: {type(exc).__name__}: {exc}") from None
    if not seen.all():
        raise AttnkitError(f"{table} is unreadable: it lacks {int((~seen).sum())} of the {seen.size} heads")
    return {"path": table, "meta_path": meta_path, "source": f"{table.parent.name}/{table.name}", "meta": meta,
            "kinds": kinds,
            "scores": dict(zip(kinds, scores))}


def is_legacy_detection(meta_path: Path) -> bool:
    """Whether `meta_path` is the settings of an older `attnkit detect-heads` (heads.meta.json beside heads.csv,
    holding `kinds` and no `experiment`), not an ablation's meta file of the same name."""
    if meta_path.name != LEGACY_DETECTED_HEADS[1]:
        return False
    try:
        data = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return False  # the ablation reader names the damage
    return isinstance(data, dict) and "kinds" in data and "experiment" not in data


def _other_weighting(place: Path, features: HeadFeatures, run: dict, partial: list) -> dict:
    """The run of `features` against the run directory `place` of the same corpus under the other weighting."""
    other = HeadFeatures.load(place)
    _same_model(run, other.meta, place / META_FILE, partial, other.n_layers, other.n_heads)
    if weighting_of(other.meta) == weighting_of(features.meta):
        raise _Elsewhere(f"a run with the same weighting ({weighting_of(features.meta)}) as this one")
    attention, norm = (features, other) if weighting_of(features.meta) == "attention" else (other, features)
    try:
        res = compare_weightings(attention, norm)
    except AttnkitError as exc:
        raise _Elsewhere(str(exc)) from None
    return {**res, "other": place, "other_weighting": weighting_of(other.meta)}


def _count(found: Attached) -> int:
    """How many results `found` holds, shown or named."""
    return (found.probe is not None) + (found.detected is not None) + (found.weighting is not None) \
        + len(found.ablations) + len(found.links)


def _read_place(found: Attached, place: Path, run_dir: Path, shape: tuple[int, int], run, partial: list,
                features: HeadFeatures | None) -> None:
    """Add to `found` the results in directory `place` (the run directory, or one `include` names)."""
    before = _count(found)
    if (place / PROBE_JSON).is_file():
        try:
            probe = read_probe(place, shape, run, partial)
            if found.probe is None:
                found.probe = probe
            else:
                found.links.append(("syntax probe", place / PROBE_JSON, "a second probe result (the report "
                                                                        f"shows {found.probe['path'].name})"))
        except _Elsewhere as exc:
            found.links.append(("syntax probe", place / PROBE_JSON, str(exc)))
    detections = [(place / DETECTED_HEADS_FILE, place / DETECTED_HEADS_META)]
    legacy = place / LEGACY_DETECTED_HEADS[1]
    legacy_is_detection = is_legacy_detection(legacy)  # else an ablation's heads.meta.json, read below
    if legacy_is_detection:
        detections.append((place / LEGACY_DETECTED_HEADS[0], legacy))
    for table, meta_path in detections:
        if not meta_path.is_file():
            continue
        try:
            if found.detected is None:
                found.detected = read_detected(table, meta_path, shape, run, partial)
            else:
                found.links.append(("detected heads", meta_path, "a second detect-heads result (the report "
                                    f"shows {found.detected['source']})"))
        except _Elsewhere as exc:
            found.links.append(("detected heads", meta_path, str(exc)))
    for meta_path in sorted(place.glob("*" + ABLATION_META_SUFFIX)):
        if legacy_is_detection and meta_path == legacy:
            continue
        try:
            found.ablations.append(read_ablation(meta_path, shape, run, partial))
        except _Elsewhere as exc:
            found.links.append(("ablation", meta_path, str(exc)))
    if features is not None and place != run_dir and (place / FEATURES_FILE).is_file() \
            and not (place / META_FILE).is_file():
        found.links.append(("run", place / FEATURES_FILE, f"{META_FILE} is missing beside {FEATURES_FILE}: "
                                                           "which model and corpus it measured is unknown"))
    elif features is not None and place != run_dir and (place / FEATURES_FILE).is_file():
        try:
            if found.weighting is None:
                found.weighting = _other_weighting(place, features, run, partial)
            else:
                found.links.append(("run", place / META_FILE, "a second run of the other weighting (the report "
                                                               f"shows {found.weighting['other'].name})"))
        except _Elsewhere as exc:
            found.links.append(("run", place / META_FILE, str(exc)))
    if place != run_dir and _count(found) == before:  # a directory given to --include that holds nothing
        found.links.append(("directory", place, "it holds no result attnkit report can show (of attnkit probe, "
                                                "ablate or detect-heads, or a run of the other weighting)"))


def find_attached(run_dir, shape: tuple[int, int], include=(), features: HeadFeatures | None = None) -> Attached:
    """Patterns, probe, ablation and detect-heads results of a run: in `run_dir` and in the directories `include`
    names; and, with the run's `features`, an included run directory of the other weighting. A damaged file (not
    JSON, or not following its schema) raises an AttnkitError that names it; a readable result that does not fit
    the run is listed in `links` with the reason."""
    run_dir = Path(run_dir)
    found = Attached()
    places = [run_dir] + [Path(p) if Path(p).is_dir() else Path(p).parent for p in include]
    meta = features.meta if features is not None else \
        load_json(run_dir / META_FILE, META_SCHEMA) if (run_dir / META_FILE).is_file() else {}
    run = recorded_identity(meta, *shape)  # what every result is compared with before it is shown
    partial: list[Path] = []
    if (run_dir / DISTANCES_FILE).is_file():
        try:
            found.distances = read_distances(run_dir / DISTANCES_FILE, shape, meta, run, partial)
        except _Elsewhere as exc:
            found.links.append(("Jensen-Shannon distances", run_dir / DISTANCES_FILE, str(exc)))
    kinds = features.kinds if features is not None else None  # an encoder–decoder's: its distances per kind
    for kind in kinds or []:
        path = run_dir / distances_file(kind)
        if path.is_file():
            try:
                found.distances_by_kind[kind] = read_distances(path, (features.n_layers_of(kind), shape[1]), meta,
                                                               run, partial, kind)
            except _Elsewhere as exc:
                found.links.append((f"Jensen-Shannon distances of the {kind} heads", path, str(exc)))
    if (run_dir / PATTERNS_FILE).is_file():
        try:
            found.patterns = read_patterns(run_dir / PATTERNS_FILE, shape, features)
        except _Elsewhere as exc:
            found.links.append(("pattern classes", run_dir / PATTERNS_FILE, str(exc)))
    for place in dict.fromkeys(places):
        _read_place(found, place, run_dir, shape, run, partial, features)
    shown = {found.probe and found.probe["path"] / PROBE_JSON, found.detected and found.detected["meta_path"],
             found.weighting and found.weighting["other"] / META_FILE,
             found.distances and run_dir / DISTANCES_FILE} | {a["meta_path"] for a in found.ablations} \
        | {run_dir / distances_file(kind) for kind in found.distances_by_kind}
    found.partial = [p for p in dict.fromkeys(partial) if p in shown]
    return found


__all__ = ["Attached", "find_attached", "is_legacy_detection", "read_ablation", "read_detected", "read_distances",
           "read_patterns",
           "read_probe"]
