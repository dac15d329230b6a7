"""Saved settings against the settings of this run: what a checkpoint, a finished run or a shard file must
match before attnkit adds to it (docs/files.md, docs/pipeline.md)."""
from __future__ import annotations

import hashlib
import json


def settings_fingerprint(settings: dict) -> str:
    """sha256 of the settings as canonical JSON: what a shard file must match to be reused."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def setting_differences(saved: dict, now: dict) -> list[str]:
    """One "key: saved then, now now" per setting that differs (nested settings as dotted keys), sorted."""
    a, b = _flatten(saved), _flatten(now)
    return [f"{k}: {a.get(k)!r} then, {b.get(k)!r} now" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def changed_inputs(saved: list | None, now: list | None) -> list[str]:
    """How the inputs differ, one line each, by path and by what can be seen without the old bytes: size and
    modification time ("input corpus.txt changed (size 1200 then, 1264 now)"). `saved`, `now`: per input a
    dict with path, sha256, size, mtime (Corpus.describe(), meta.json "inputs"). [] when they cannot be
    compared (an older run that did not record them)."""
    if not isinstance(saved, list) or not isinstance(now, list) or not all(isinstance(d, dict) for d in saved):
        return []
    if len(saved) != len(now):
        return [f"inputs: {len(saved)} then, {len(now)} now"]
    out = []
    for then, cur in zip(saved, now):
        if then.get("sha256") is None or then.get("sha256") == cur.get("sha256"):
            continue
        how = [f"{key} {then.get(key)} then, {cur.get(key)} now" for key in ("size", "mtime")
               if then.get(key) is not None and then.get(key) != cur.get(key)]
        name = cur.get("path") if cur.get("path") == then.get("path") else f"{then.get('path')} → {cur.get('path')}"
        out.append(f"input {name} changed ({', '.join(how) if how else 'same size and time, other bytes'})")
    return out


__all__ = ["changed_inputs", "setting_differences", "settings_fingerprint"]
