"""Schemas of the files attnkit reads back (run files, and SQuAD JSON), checked at the boundary.

JSON files are described with JSON Schema (validated by `jsonschema`); `.npz` files by the arrays
they must hold (`ArraySpec`). `validate` and `validate_arrays` raise an AttnkitError that names the
file, the field and the problem, e.g.

    run/meta.json: field n_samples: expected an integer, got a string ("abc")

Checks that need more than one field (a head's layer against the run's number of layers, ...) are
done by the reader after the schema (see attnkit.run.clusters.load_clusters).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from ..errors import AttnkitError
from .model_dir import KINDS

_INT0 = {"type": "integer", "minimum": 0}
_INT1 = {"type": "integer", "minimum": 1}
_STR_OR_NULL = {"type": ["string", "null"]}
_NUM_OR_NULL = {"type": ["number", "null"]}
_HEAD_PAIRS = {"type": "array", "items": {"type": "array", "items": _INT0, "minItems": 2, "maxItems": 2}}  # [[l, h]]
# `model_identity`: which model a file was made from (attnkit/run/identity.py); absent in files made before it was
# recorded, which the report compares by what they have
_MODEL_IDENTITY = {"type": "object", "required": ["name", "n_layers", "n_heads"], "properties": {
    "name": {"type": "string"}, "path": _STR_OR_NULL, "model_type": _STR_OR_NULL, "n_layers": _INT1, "n_heads": _INT1,
    "config_sha256": {"type": ["string", "null"], "pattern": "^[0-9a-f]{64}$"}}}
MODEL_IDENTITY_SCHEMA = _MODEL_IDENTITY  # also the JSON text of distances.npz's array `model_identity`

# RUN/meta.json, written by `attnkit extract` (HeadFeatures.save). Every field is optional (a run saved
# from Python may carry only the counts), but a field that is there must have its type.
META_SCHEMA = {
    "type": "object",
    "properties": {
        "status": {"type": "string"},
        "n_samples": _INT0,
        "n_tokens": _INT0,
        "n_layers": _INT1,
        "n_heads": _INT1,
        "n_segments": _INT0,
        "n_truncated": _INT0,
        "max_length": _INT1,
        "num_windows": _INT1,
        # "norm": features of norm-weighted attention (docs/features.md); absent in runs made before it existed
        "weighting": {"enum": ["attention", "norm"]},
        "model": _STR_OR_NULL,
        "model_type": _STR_OR_NULL,
        "model_identity": _MODEL_IDENTITY,
        "corpus": _STR_OR_NULL,
        "format": _STR_OR_NULL,
        "text_unit": _STR_OR_NULL,
        "columns": _STR_OR_NULL,
        "squad_pairs": {"type": "boolean"},
        "backend": _STR_OR_NULL,
        "device": _STR_OR_NULL,
        "feature_names": {"type": "array", "items": {"type": "string"}},
        # [[layer, head], ...]: heads a pruning removed from the model (their features are NaN); absent in runs
        # of unpruned models and in runs made before it was recorded
        "removed_heads": _HEAD_PAIRS,
        # [[kind, index in its kind], ...], one per layer: an encoder–decoder's run (docs/seq2seq.md); absent for a
        # model of one stack
        "layer_kinds": {"type": "array", "items": {"type": "array", "minItems": 2, "maxItems": 2, "prefixItems": [
            {"enum": list(KINDS)}, _INT0]}},
        "settings": {
            "type": "object",
            "properties": {
                # how `attnkit extract` read its inputs; analysis commands read the corpus again with it
                "reading": {
                    "type": "object",
                    "properties": {
                        "paths": {"type": "array", "items": {"type": "string"}},
                        "format": _STR_OR_NULL,
                        "text_unit": _STR_OR_NULL,
                        "columns": {"type": ["array", "null"], "items": {"type": "string"}, "maxItems": 2},
                        "squad_pairs": {"type": "boolean"},
                    },
                },
            },
        },
        "inputs": {"type": "array", "items": {"type": "object"}},
        "versions": {"type": "object"},
        "elapsed_s": {"type": "number"},
        # how the local engine decided its workers and threads (docs/files.md); `initial` and `replans` only when
        # the run changed its plan as it went (attnkit/engine/tuning.py, Replanner)
        "pipeline": {"type": "object", "properties": {
            "workers": _INT0, "threads": _INT1, "how": {"type": "string"}, "cores": _INT1,
            "initial": {"type": "object", "required": ["workers", "threads"],
                        "properties": {"workers": _INT0, "threads": _INT1}},
            "replans": {"type": "array", "items": {
                "type": "object", "required": ["after_segments", "seconds", "workers", "threads"],
                "properties": {"after_segments": _INT0, "seconds": {"type": "number", "minimum": 0},
                               "workers": _INT0, "threads": _INT1, "tokenise_tokens_per_s": {"type": "number"},
                               "forward_tokens_per_s": {"type": "object",
                                                        "additionalProperties": {"type": "number"}}}}}}},
    },
}

# RUN/clusters.json, written by `attnkit cluster` (attnkit/analysis/results.py) and read by attnkit/run/clusters.py.
# CLUSTERS_SCHEMA is what every reader needs (the type of every head); CLUSTERS_REPORT_SCHEMA adds what the report
# draws.
CLUSTERS_SCHEMA = {
    "type": "object",
    "required": ["version", "settings", "run", "heads", "clusters", "stability"],
    "properties": {
        "version": {"const": 1},
        "settings": {"type": "object", "properties": {
            "k": _INT1, "method": {"type": "string"}, "seed": {"type": "integer"},
            "features": {"type": "array", "items": {"type": "string"}}}},
        "run": {"type": "object", "required": ["n_layers", "n_heads"], "properties": {
            "n_layers": _INT1, "n_heads": _INT1, "n_samples": _INT0, "n_tokens": _INT0,
            "model": _STR_OR_NULL, "corpus": _STR_OR_NULL}},
        # heads a pruning removed (no features, in no cluster, not in "heads"); absent when there are none
        "removed_heads": _HEAD_PAIRS,
        "heads": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["layer", "head", "label", "type"], "properties": {
                "layer": _INT0, "head": _INT0, "label": _INT0, "type": {"type": "string", "minLength": 1},
                "agreement": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
                # an encoder–decoder's run: the head's kind and its layer within that kind (docs/seq2seq.md)
                "kind": {"enum": ["encoder", "decoder", "cross"]}, "kind_layer": _INT0}}},
        "clusters": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["label", "type"], "properties": {
                "label": _INT0, "type": {"type": "string", "minLength": 1}, "n_heads": _INT0,
                "share": {"type": "number", "minimum": 0, "maximum": 1},
                "centroid": {"type": "object", "additionalProperties": {"type": "number"}},
                "profile": {"type": ["object", "null"], "additionalProperties": {"type": "number"}}}}},
        "stability": {"type": "object", "properties": {
            "k": _INT1, "stability": _NUM_OR_NULL, "silhouette": _NUM_OR_NULL, "n_stability": _INT0,
            "sweep": {"type": ["array", "null"], "items": {
                "type": "object", "required": ["k", "stability", "silhouette"], "properties": {
                    "k": _INT1, "stability": _NUM_OR_NULL, "silhouette": _NUM_OR_NULL,
                    "stability_mean": _NUM_OR_NULL, "stability_min": _NUM_OR_NULL, "stability_max": _NUM_OR_NULL,
                    "n_seeds": _INT1, "type_names": {"type": "array", "items": {"type": "string"}}}}},
            "over_seeds": {"type": "object", "required": ["n_seeds", "seeds", "mean", "min", "max"], "properties": {
                "n_seeds": _INT1, "seeds": {"type": "array", "minItems": 1, "items": {"type": "integer"}},
                "values": {"type": "array", "items": _NUM_OR_NULL}, "mean": _NUM_OR_NULL, "min": _NUM_OR_NULL,
                "max": _NUM_OR_NULL}}}},
    },
}

CLUSTERS_REPORT_SCHEMA = {
    "allOf": [CLUSTERS_SCHEMA, {
        "type": "object",
        "properties": {
            "settings": {"required": ["features"],
                         "properties": {"features": {"minItems": 1}}},
            "clusters": {"items": {"required": ["n_heads", "share", "centroid", "profile"]}},
            "stability": {"required": ["k", "stability", "silhouette", "n_stability"]},
        },
    }],
}

# RUN/per_sample.json, written with RUN/per_sample.npy by `attnkit extract --per-sample` (attnkit/run/per_sample.py)
PER_SAMPLE_SCHEMA = {
    "type": "object",
    "required": ["names"],
    "properties": {"names": {"type": "array", "items": {"type": "string"}}, "n_samples": _INT0, "n_layers": _INT1,
                   "n_heads": _INT1},
}

# DIR/importance.json, written by `attnkit ablate --experiment importance` (attnkit/ablation/experiments.py) and read
# by `attnkit prune --importance` (attnkit/ablation/prune.py): what the pruning order needs.
IMPORTANCE_SCHEMA = {
    "type": "object",
    "required": ["experiment", "rows", "importance"],
    "properties": {
        "experiment": {"const": "importance"},
        "importance": {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1,
                                                                 "items": {"type": "number"}}},
        "rows": {"type": "array", "items": {"type": "object", "properties": {
            "newly_pruned": {"type": ["string", "null"]}}}},
    },
}

_SHARE = {"type": "number", "minimum": 0, "maximum": 1}
_NAME = {"type": "string", "minLength": 1}

# RUN/patterns.json, written by `attnkit patterns` (attnkit/analysis/patterns.py) and shown by the report
# (attnkit/analysis/attached.py checks after the schema that every class has a rectangular layers × heads grid).
PATTERNS_SCHEMA = {
    "type": "object",
    "required": ["classes", "per_head", "per_layer", "overall", "n_examples"],
    "properties": {
        "version": {"const": 1},
        "classes": {"type": "array", "minItems": 1, "items": _NAME},
        "rules": {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean", "null"]}},
        "pairs": _STR_OR_NULL,
        "n_examples": _INT0, "n_layers": _INT1, "n_heads": _INT1,
        "labels": _STR_OR_NULL,
        "overall": {"type": "object", "additionalProperties": _SHARE},
        # null for a layer whose heads a pruning all removed (docs/patterns.md)
        "per_layer": {"type": "object", "additionalProperties": {"type": "array", "items": {
            "anyOf": [_SHARE, {"type": "null"}]}}},
        # a removed head's share may be null or NaN (docs/pruning.md); the reader checks the range of the others
        "per_head": {"type": "object", "additionalProperties": {
            "type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": _NUM_OR_NULL}}},
    },
}

# OUT/probe.json, written by `attnkit probe` (attnkit/probe/run.py): what the report reads of it.
PROBE_SCHEMA = {
    "type": "object",
    "required": ["layers", "heads"],
    "properties": {
        "model": _STR_OR_NULL, "model_identity": _MODEL_IDENTITY,
        "layers": _INT1, "heads": _INT1, "removed_heads": _HEAD_PAIRS,
        "settings": {"type": "object", "properties": {"min_count": _INT1}},
        "relations": {"type": "object", "additionalProperties": {"type": ["object", "null"], "properties": {
            "baseline_offset": {"type": ["integer", "string", "null"]}}}},
    },
}

# OUT/E.meta.json, written by `attnkit ablate` (attnkit/ablation/job.py). `experiment` names the kind of table; the
# table itself is read from the file beside it named by the meta file's own name (E.json), never by a field.
ABLATION_META_SCHEMA = {
    "type": "object",
    "required": ["experiment"],
    "properties": {
        "experiment": {"type": "string", "pattern": "^[a-z][a-z_]*$"},
        "model": _STR_OR_NULL, "task": _STR_OR_NULL, "mode": _STR_OR_NULL, "model_identity": _MODEL_IDENTITY,
    },
}

# OUT/detected_heads.json, written by `attnkit detect-heads` (attnkit/jobs/detect.py) beside detected_heads.csv;
# read by the report (attnkit/analysis/attached.py checks the kinds and the table after the schema).
DETECTED_HEADS_SCHEMA = {
    "type": "object",
    "required": ["kinds", "n_layers", "n_heads"],
    "properties": {
        "kinds": {"type": "array", "minItems": 1, "items": {"type": "string", "pattern": "^[a-z][a-z_]*$"}},
        "model": _STR_OR_NULL, "model_type": _STR_OR_NULL, "corpus": _STR_OR_NULL, "model_identity": _MODEL_IDENTITY,
        "length": _INT1, "n_sequences": _INT1, "seed": _INT0, "bos": {"type": ["integer", "null"]},
        "n_layers": _INT1, "n_heads": _INT1, "seconds": _NUM_OR_NULL,
    },
}

# OUT/E.json, the table of `attnkit ablate` (attnkit/ablation/experiments.py, ResultTable.save). Its
# `main_metric` is better when higher (spearman, accuracy, f1, restored), except these, where a rise is the harm:
LOWER_IS_BETTER = ("loss", "perplexity")
_CELL = {"type": ["number", "string", "boolean", "null"]}
ABLATION_TABLE_SCHEMA = {
    "type": "object",
    "required": ["experiment", "main_metric", "rows"],
    "properties": {
        "experiment": {"type": "string", "pattern": "^[a-z][a-z_]*$"},
        "main_metric": {"type": "string", "pattern": "^[A-Za-z0-9_]+$"},
        "rows": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "setting": {"type": "string"}, "layer": {"type": ["integer", "null"], "minimum": 0},
            "head": {"type": ["integer", "null"], "minimum": 0}},
            # Δ, its interval ends, and whether the interval excludes 0 beyond Monte-Carlo noise (a boolean)
            "patternProperties": {"^delta_(?!.*_excludes_0$)": _NUM_OR_NULL,
                                  "^delta_.*_excludes_0$": {"type": ["boolean", "null"]}},
            "additionalProperties": {}}},
        "importance": {"type": "array", "items": {"type": "array", "items": _NUM_OR_NULL}},
    },
}

# SQuAD v1.1 / v2.0 JSON as attnkit reads it: the corpus reader (contexts, or question + context pairs) and the
# ablation's squad task (which also reads ids and answers). Every field but data, context and question may be
# absent; a field that is there must have its type.
SQUAD_SCHEMA = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "version": {"type": ["string", "number"]},
        "data": {"type": "array", "items": {
            "type": "object", "properties": {
                "paragraphs": {"type": "array", "items": {
                    "type": "object", "required": ["context"], "properties": {
                        "context": {"type": "string"},
                        "qas": {"type": "array", "items": {
                            "type": "object", "required": ["question"], "properties": {
                                "id": {"type": ["string", "integer"]},
                                "question": {"type": "string"},
                                "is_impossible": {"type": "boolean"},
                                "answers": {"type": "array", "items": {
                                    "type": "object", "required": ["text", "answer_start"], "properties": {
                                        "text": {"type": "string"}, "answer_start": _INT0}}}}}}}}}}}},
    },
}

_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
               float: "a number", type(None): "null"}
_SCHEMA_TYPES = {"object": "an object", "array": "an array", "string": "a string", "boolean": "a boolean",
                 "integer": "an integer", "number": "a number", "null": "null"}


def _field(path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _short(value, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _problem(err) -> str:
    if err.validator == "type":
        want = err.validator_value if isinstance(err.validator_value, list) else [err.validator_value]
        got = _JSON_TYPES.get(type(err.instance), type(err.instance).__name__)
        return f"expected {' or '.join(_SCHEMA_TYPES.get(w, w) for w in want)}, got {got} ({_short(err.instance)})"
    if err.validator == "required":
        missing = [k for k in err.validator_value if k not in err.instance]
        return "missing " + ", ".join(repr(k) for k in missing)
    if err.validator in ("minimum", "maximum"):
        side = "at least" if err.validator == "minimum" else "at most"
        return f"must be {side} {err.validator_value}, got {_short(err.instance)}"
    if err.validator == "const":
        return f"must be {_short(err.validator_value)}, got {_short(err.instance)}"
    if err.validator == "minItems":
        return f"needs at least {err.validator_value} item(s), got {len(err.instance)}"
    if err.validator == "enum":
        return f"must be one of {', '.join(_short(v) for v in err.validator_value)}, got {_short(err.instance)}"
    if err.validator == "minLength":
        return "must not be empty"
    msg = err.message
    return msg if len(msg) <= 160 else msg[:157] + "..."


def validate(obj, schema: dict, path) -> None:
    """Raise AttnkitError "<path>: field <a.b[3].c>: <problem>" when `obj` does not follow `schema` (the one
    formatter of JSON Schema errors: every JSON file attnkit reads is checked through it)."""
    errors = list(Draft202012Validator(schema).iter_errors(obj))
    if not errors:
        return
    err = best_match(errors)
    where = _field(err.absolute_path)
    raise AttnkitError(f"{path}: " + (f"field {where}: " if where else "") + _problem(err))


def load_json(path, schema: dict, what: str = ""):
    """Read JSON file `path` and validate it against `schema` (errors name the file)."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except UnicodeDecodeError:
        raise AttnkitError(f"{path} is not UTF-8 text" + (f" ({what})" if what else "")) from None
    except ValueError as exc:
        raise AttnkitError(f"{path} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise AttnkitError(f"cannot read {path}: {exc.strerror or exc}") from None
    validate(obj, schema, path)
    return obj


@dataclass(frozen=True)
class ArraySpec:
    """An array an .npz file must hold: `kind` "float", "int" or "str"; `ndim` its number of dimensions;
    `finite`: no NaN or infinity allowed; `optional`: a file may lack it (files made before it existed), but one
    it holds must follow the spec."""

    kind: str
    ndim: int
    finite: bool = False
    optional: bool = False


# max_logit: layers × heads, each head's max logit over the corpus (`attnkit extract --max-logit`; NaN for a pruned
# head); absent in runs that did not measure it, and in runs made before it was saved. Its shape against mean's is
# checked by HeadFeatures.load.
FEATURES_ARRAYS = {"mean": ArraySpec("float", 3), "std": ArraySpec("float", 3), "names": ArraySpec("str", 1),
                   "max_logit": ArraySpec("float", 2, optional=True)}
DISTANCES_ARRAYS = {"total": ArraySpec("float", 2, finite=True), "n_rows": ArraySpec("int", 0),
                    "n_layers": ArraySpec("int", 0),
                    "n_heads": ArraySpec("int", 0)}

_KINDS = {"float": "fiu", "int": "iu", "str": "U"}
_KIND_NAMES = {"float": "numbers", "int": "integers", "str": "strings"}


def load_npz(path, spec: dict[str, ArraySpec] | None = None, *, what: str = "", missing: str = "",
             corrupt: str = "") -> dict:
    """Every array of the .npz file `path` (name → numpy array; no pickled objects), checked against `spec`
    (`validate_arrays`). The one reader of attnkit's .npz files: a missing file, an unreadable or corrupt one
    and one that does not follow `spec` end in an AttnkitError naming it (`what` it is; `missing` and
    `corrupt`: what to do about it)."""
    from pathlib import Path

    name = f"{what} {path}" if what else str(path)
    if not Path(path).is_file():
        raise AttnkitError(f"{name} is missing" + (f": {missing}" if missing else ""))
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as exc:
        raise AttnkitError(f"{name} is unreadable or corrupt ({type(exc).__name__}: {exc})"
                           + (f"; {corrupt}" if corrupt else "")) from None
    if spec:
        validate_arrays(arrays, spec, path)
    return arrays


def validate_arrays(arrays: dict, spec: dict[str, ArraySpec], path) -> None:
    """Check that `arrays` (name → numpy array, e.g. an opened .npz) holds every array of `spec` with
    the right kind and number of dimensions (and finite values where the spec says so)."""
    for name, s in spec.items():
        if name not in arrays:
            if s.optional:
                continue
            raise AttnkitError(f"{path}: array {name!r} is missing (has: {', '.join(sorted(arrays)) or 'none'})")
        a = np.asarray(arrays[name])
        if a.dtype.kind not in _KINDS[s.kind]:
            raise AttnkitError(f"{path}: array {name!r} must hold {_KIND_NAMES[s.kind]}, got dtype {a.dtype}")
        if a.ndim != s.ndim:
            raise AttnkitError(f"{path}: array {name!r} must have {s.ndim} dimension(s), got shape {a.shape}")
        if s.finite and not np.all(np.isfinite(a)):
            raise AttnkitError(f"{path}: array {name!r} holds NaN or infinite values")


__all__ = ["validate", "load_json", "load_npz", "validate_arrays", "ArraySpec", "META_SCHEMA", "CLUSTERS_SCHEMA",
           "CLUSTERS_REPORT_SCHEMA", "PER_SAMPLE_SCHEMA", "SQUAD_SCHEMA", "IMPORTANCE_SCHEMA", "FEATURES_ARRAYS",
           "DISTANCES_ARRAYS",
           "MODEL_IDENTITY_SCHEMA", "PATTERNS_SCHEMA", "PROBE_SCHEMA", "ABLATION_META_SCHEMA", "ABLATION_TABLE_SCHEMA",
           "DETECTED_HEADS_SCHEMA", "LOWER_IS_BETTER"]
