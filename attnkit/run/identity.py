"""Which model a file was made from: the identity that every command which runs a model records beside its results
(`model_identity`, the field `model_identity` of meta.json, detected_heads.json, E.meta.json and probe.json), and the
one comparison the report makes before it shows another command's result beside a run's heads (`model_mismatch`;
docs/files.md, "Which model a file comes from").

Files written before the identity was recorded are compared by what they have: layers × heads, the model type and
the model's name or directory (its last part: a relative and an absolute path of one directory agree), and
`model_mismatch` says that the comparison was partial (`partial_identity`). Nothing here loads a model or imports
torch: `model_identity` reads the loaded model's config.
"""
from __future__ import annotations

import hashlib
import json
import os

from .model_dir import seq2seq_layer_kinds

IDENTITY_FIELD = "model_identity"
# The config fields that make the model's shape: what `config_sha256` hashes. A fixed list, not the whole config,
# so that the hash does not change with the class a model is loaded as (a bare model, a language-model head, a
# classifier), its dtype, or transformers' version (which adds defaults to the whole config). `attnkit_heads` is
# the heads a pruning kept (attnkit.arch.pruning.CONFIG_HEADS): a pruned model is another model.
CONFIG_KEYS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
               "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim", "attnkit_heads")
# How the commands name the embedded MiniLM when no model is given (`ablate default`, `probe` without --model).
DEFAULT_NAMES = ("default", "default (embedded MiniLM)")


def _plain(value):
    """A config value as JSON can hold it (lists of lists stay lists; other objects become their text)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def config_sha256(config) -> str:
    """SHA-256 of the model's shape fields (CONFIG_KEYS; absent ones as null) as canonical JSON."""
    shape = {k: _plain(getattr(config, k, None)) for k in CONFIG_KEYS}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()


def model_identity(model, name=None) -> dict:
    """What a command records of the model it ran (`model`: the loaded model, or its config; `name`: the model as
    the command was given it, None for the embedded MiniLM): `name`, `path` (the model's directory, absolute with
    symbolic links resolved; null when it is not a local directory), `model_type`, `n_layers` (attnkit's layers,
    those a run's features have: an encoder–decoder's encoder, decoder and cross-attention layers together,
    docs/seq2seq.md §2), `n_heads` and `config_sha256` (`config_sha256`)."""
    config = getattr(model, "config", model)
    kinds = seq2seq_layer_kinds(config)
    n_layers = int(config.num_hidden_layers) if kinds is None else len(kinds)
    where = getattr(config, "_name_or_path", "") or ""
    path = os.path.realpath(where) if where and os.path.isdir(where) else None
    return {"name": "default" if name is None else str(name), "path": path,
            "model_type": getattr(config, "model_type", None), "n_layers": n_layers,
            "n_heads": int(config.num_attention_heads), "config_sha256": config_sha256(config)}


def recorded_identity(record: dict, n_layers=None, n_heads=None) -> dict:
    """The identity a file records (`record`: its JSON object): its `model_identity` when it has one, else what an
    older file has, `model` as the name, `model_type`, and its n_layers, n_heads; `partial` tells which. The layers ×
    heads given (the shape of the file's own arrays) replace the recorded ones: an encoder–decoder's run made before
    `model_identity` counted attnkit's layers records its encoder's alone."""
    ident = record.get(IDENTITY_FIELD) if isinstance(record, dict) else None
    if isinstance(ident, dict):
        shape = {k: v for k, v in (("n_layers", n_layers), ("n_heads", n_heads)) if v is not None}
        return {**ident, **shape, "partial": False}
    record = record if isinstance(record, dict) else {}
    return {"name": record.get("model"), "path": None, "model_type": record.get("model_type"),
            "n_layers": record.get("n_layers") if n_layers is None else n_layers,
            "n_heads": record.get("n_heads") if n_heads is None else n_heads,
            "config_sha256": None, "partial": True}


def _default_path() -> str | None:
    try:
        from .model_dir import default_model_path

        return os.path.realpath(default_model_path())
    except Exception:  # the package of the embedded MiniLM is not installed: no path is it
        return None


def _name_keys(ident: dict) -> set[str]:
    """What an identity's model can be recognised by without its directory: the embedded MiniLM as one name
    whatever a command called it, else the last part of its name and of its path."""
    keys = set()
    for value in (ident.get("name"), ident.get("path")):
        if not isinstance(value, str) or not value.strip():
            continue
        if value in DEFAULT_NAMES or (os.path.isabs(value) and os.path.realpath(value) == _default_path()):
            keys.add("(embedded MiniLM)")
        else:
            keys.add(os.path.basename(os.path.normpath(value)))
    return keys


def _shown(ident: dict) -> str:
    return str(ident.get("path") or ident.get("name"))


def model_mismatch(run: dict, other: dict) -> str | None:
    """Why `other` (an identity, `recorded_identity`) is not the model of `run` (the run's), or None when nothing
    they both record differs: layers × heads, model type, config hash, directory, and, where a directory is not
    recorded on both sides, the model's name."""
    shape = (run.get("n_layers"), run.get("n_heads"))
    theirs = (other.get("n_layers"), other.get("n_heads"))
    if None not in shape and None not in theirs and tuple(shape) != tuple(theirs):
        return f"made with a model of {theirs[0]} layers × {theirs[1]} heads, the run's has {shape[0]} × {shape[1]}"
    if run.get("model_type") and other.get("model_type") and run["model_type"] != other["model_type"]:
        return f"made with a {other['model_type']} model, the run's is a {run['model_type']} model"
    if run.get("config_sha256") and other.get("config_sha256") and run["config_sha256"] != other["config_sha256"]:
        return (f"made with another model ({_shown(other)}: its configuration differs from that of the run's "
                f"model, {_shown(run)})")
    if run.get("path") and other.get("path"):
        if run["path"] != other["path"]:
            return f"made with the model in {other['path']}, the run with the one in {run['path']}"
        return None
    mine, yours = _name_keys(run), _name_keys(other)
    if mine and yours and not mine & yours:
        return f"made with the model {_shown(other)}, the run with {_shown(run)}"
    return None


def partial_identity(run: dict, other: dict) -> bool:
    """Whether `model_mismatch` could compare only part of the identity (a file, or the run, from before it was
    recorded)."""
    return bool(run.get("partial") or other.get("partial"))


__all__ = ["CONFIG_KEYS", "DEFAULT_NAMES", "IDENTITY_FIELD", "config_sha256", "model_identity", "model_mismatch",
           "partial_identity", "recorded_identity"]
