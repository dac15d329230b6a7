"""RUN/distances.npz: Jensen-Shannon divergence sums between every pair of heads (docs/files.md, "distances.npz";
the measure: docs/analysis.md); an encoder–decoder's run holds one file per kind instead, RUN/distances_KIND.npz
(docs/seq2seq.md §9). Written by `attnkit distances` (attnkit/engine/distances.py collects them)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from .files import DISTANCES_FILE, DISTANCES_KIND_FILES
from .identity import IDENTITY_FIELD
from .outputs import atomic_write, ensure_writable_dir
from .schemas import DISTANCES_ARRAYS, MODEL_IDENTITY_SCHEMA, load_npz, validate


class HeadDistances:
    """Jensen-Shannon divergence sums between heads (M×M, M = n_layers·n_heads), rows counted, and settings
    (`meta["smoothing"]`: ε of the smoothing applied before the divergence, 0 for none; `meta["removed_heads"]`:
    [[layer, head], ...] removed by pruning, whose rows and columns of `per_token` are NaN: a removed head has
    no attention to compare; `meta["model_identity"]`: the model they were measured with, as
    attnkit/run/identity.py records it, and `meta["corpus_sha256"]`: the corpus's fingerprint, both None in files
    made before they were recorded; `meta["kind"]`: an encoder–decoder's kind of layers, whose heads alone the
    matrix compares, numbered within the kind; None for a model of one stack)."""

    def __init__(self, total: np.ndarray, n_rows: int, n_layers: int, n_heads: int, meta: dict | None = None):
        total = np.asarray(total, dtype=np.float64)
        if total.shape != (n_layers * n_heads,) * 2:
            raise AttnkitError(f"distance matrix {total.shape} does not fit {n_layers} layers × {n_heads} heads")
        self.total, self.n_rows, self.n_layers, self.n_heads = total, int(n_rows), int(n_layers), int(n_heads)
        self.meta = dict(meta or {})

    @property
    def removed(self) -> np.ndarray:
        """(M,) booleans: the heads removed by pruning (in layer-major order)."""
        out = np.zeros(self.n_layers * self.n_heads, dtype=bool)
        for l, h in self.meta.get("removed_heads") or []:
            out[l * self.n_heads + h] = True
        return out

    @property
    def per_token(self) -> np.ndarray:
        """Mean JS divergence per query token (between 0 and ln 2); NaN in the rows and columns of removed heads."""
        out = self.total / max(self.n_rows, 1)
        gone = self.removed
        if gone.any():
            out = out.copy()
            out[gone, :] = np.nan
            out[:, gone] = np.nan
        return out

    def labels(self) -> list[str]:
        return [f"L{l}H{h}" for l in range(self.n_layers) for h in range(self.n_heads)]

    def save(self, directory) -> Path:
        """Write RUN/distances.npz, or an encoder–decoder kind's RUN/distances_KIND.npz (`meta["kind"]`)."""
        directory = ensure_writable_dir(directory, "run directory")
        path = directory / distances_file(self.meta.get("kind"))
        atomic_write(path, lambda f: np.savez(
            f, total=self.total, per_token=self.per_token, n_rows=np.int64(self.n_rows),
            n_layers=np.int64(self.n_layers), n_heads=np.int64(self.n_heads),
            rows_per_sample=np.int64(-1 if self.meta.get("rows_per_sample") is None else self.meta["rows_per_sample"]),
            smoothing=np.float64(self.meta.get("smoothing", 0.0)), measure=np.array("jensen-shannon divergence"),
            removed_heads=np.array(self.meta.get("removed_heads") or [], dtype=np.int64).reshape(-1, 2),
            **self._provenance()))
        return path

    def _provenance(self) -> dict:
        """The arrays that say which model and corpus the sums come from (those that are known): `model_identity`
        as JSON text, `corpus_sha256` as text."""
        out = {}
        if self.meta.get(IDENTITY_FIELD) is not None:
            out[IDENTITY_FIELD] = np.array(json.dumps(self.meta[IDENTITY_FIELD], sort_keys=True))
        if self.meta.get("corpus_sha256") is not None:
            out["corpus_sha256"] = np.array(str(self.meta["corpus_sha256"]))
        if self.meta.get("kind") is not None:
            out["kind"] = np.array(str(self.meta["kind"]))
        return out

    @classmethod
    def load(cls, directory, shape: tuple[int, int] | None = None) -> HeadDistances:
        """Read RUN/distances.npz, checked against `attnkit.run.schemas.DISTANCES_ARRAYS` (and against the
        run's (n_layers, n_heads) when `shape` is given)."""
        return cls._read(Path(directory) / DISTANCES_FILE, directory, None, shape)

    @classmethod
    def load_by_kind(cls, directory, kinds=None) -> dict[str, HeadDistances]:
        """An encoder–decoder's run: {kind: HeadDistances} from RUN/distances_KIND.npz, each kind's heads compared
        within it and numbered within it (docs/seq2seq.md §9). `kinds`: the kinds to read (default: those of the
        run's meta.json `layer_kinds`), each checked against that kind's number of layers in the run."""
        from .head_features import HeadFeatures

        directory = Path(directory)
        run = HeadFeatures.load(directory)
        if run.kinds is None:
            raise AttnkitError(f"{directory} measured a model of one stack: its distances are "
                               f"{DISTANCES_FILE} (HeadDistances.load)")
        wanted = run.kinds if kinds is None else list(kinds)
        for kind in wanted:
            if kind not in run.kinds:
                raise AttnkitError(f"{directory} has no layers of kind {kind!r} (its kinds: {', '.join(run.kinds)})")
        return {kind: cls.load_kind(directory, kind, (run.n_layers_of(kind), run.n_heads)) for kind in wanted}

    @classmethod
    def load_kind(cls, directory, kind: str, shape: tuple[int, int] | None = None) -> HeadDistances:
        """One kind's RUN/distances_KIND.npz of an encoder–decoder's run (checked against that kind's (layers, heads)
        in the run when `shape` is given), without reading the run's features: for a caller that has them."""
        return cls._read(Path(directory) / distances_file(kind), directory, kind, shape)

    @classmethod
    def _read(cls, path: Path, directory, kind: str | None, shape) -> HeadDistances:
        arrays = load_npz(path, DISTANCES_ARRAYS,
                          missing=f"collect distances first (attnkit distances {directory})")
        if _text(arrays, "kind", path) != kind:
            raise AttnkitError(f"{path} holds the distances of kind {_text(arrays, 'kind', path)!r}, not {kind!r}")
        L, H, n_rows = int(arrays["n_layers"]), int(arrays["n_heads"]), int(arrays["n_rows"])
        total = arrays["total"].astype(np.float64)
        if L < 1 or H < 1 or n_rows < 0:
            raise AttnkitError(f"{path}: n_layers {L}, n_heads {H}, n_rows {n_rows} are impossible")
        if total.shape != (L * H, L * H):
            raise AttnkitError(f"{path}: array 'total' has shape {total.shape}, but {L} layers × {H} heads "
                               f"need {L * H} × {L * H}")
        if shape is not None and (L, H) != tuple(shape):
            raise AttnkitError(f"{path} covers {L} layers × {H} heads, but the run has {shape[0]} × {shape[1]}"
                               f"{'' if kind is None else f' of kind {kind!r}'}: "
                               f"re-run `attnkit distances`")
        if np.any(total < 0) or not np.allclose(total, total.T):
            raise AttnkitError(f"{path}: array 'total' is not a distance matrix (negative or not symmetric)")
        rps = int(arrays["rows_per_sample"]) if "rows_per_sample" in arrays and arrays["rows_per_sample"].ndim == 0 \
            else -1
        smoothing = float(arrays["smoothing"]) if "smoothing" in arrays and arrays["smoothing"].ndim == 0 else 0.0
        removed = arrays["removed_heads"] if "removed_heads" in arrays else np.zeros((0, 2), dtype=np.int64)
        if removed.ndim != 2 or removed.shape[1] != 2 or ((removed < 0) | (removed >= [L, H])).any():
            raise AttnkitError(f"{path}: array 'removed_heads' is not a list of heads of {L} layers × {H} heads")
        return cls(total, n_rows, L, H, {"rows_per_sample": None if rps < 0 else rps, "smoothing": smoothing,
                                         "removed_heads": removed.astype(int).tolist(),
                                         IDENTITY_FIELD: _identity(arrays, path),
                                         "corpus_sha256": _text(arrays, "corpus_sha256", path),
                                         **({} if kind is None else {"kind": kind})})


def distances_file(kind: str | None) -> str:
    """The file name of the distances of `kind` (an encoder–decoder's kind of layers), or of all heads (None)."""
    if kind is None:
        return DISTANCES_FILE
    if kind not in DISTANCES_KIND_FILES:
        raise AttnkitError(f"distances are kept per kind of {', '.join(DISTANCES_KIND_FILES)}, not {kind!r}")
    return DISTANCES_KIND_FILES[kind]


def _text(arrays: dict, name: str, path) -> str | None:
    """The text array `name` (a 0-d array of a string), None when the file has none (made before it was recorded)."""
    if name not in arrays:
        return None
    a = arrays[name]
    if a.dtype.kind != "U" or a.ndim != 0:
        raise AttnkitError(f"{path}: array {name!r} must be one string, got dtype {a.dtype} and shape {a.shape}")
    return str(a)


def _identity(arrays: dict, path) -> dict | None:
    """The model identity the file records (`model_identity`: JSON text of attnkit/run/identity.py's object)."""
    text = _text(arrays, IDENTITY_FIELD, path)
    if text is None:
        return None
    try:
        ident = json.loads(text)
    except ValueError as exc:
        raise AttnkitError(f"{path}: array {IDENTITY_FIELD!r} is not valid JSON: {exc}") from None
    validate(ident, MODEL_IDENTITY_SCHEMA, f"{path}: array {IDENTITY_FIELD!r}")
    return ident


__all__ = ["DISTANCES_FILE", "HeadDistances", "distances_file"]
