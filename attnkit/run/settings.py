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


__all__ = ["setting_differences", "settings_fingerprint"]
