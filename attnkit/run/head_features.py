"""Per-head corpus features: the accumulator that extraction feeds, and the result it produces."""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import AttnkitError
from .files import FEATURES_FILE, META_FILE, PER_SAMPLE_FILE
from .outputs import atomic_write, ensure_writable_dir, write_json
from .per_sample import PerSampleWriter, load_per_sample
from .schemas import FEATURES_ARRAYS, META_SCHEMA, load_json, load_npz


@dataclass
class HeadGrid:
    """A layer × head grid of one feature (`HeadFeatures.grid`): `values` (n_layers × n_heads), shown in a
    notebook as a table whose cells are shaded from the smallest value (white) to the largest (blue)."""

    values: np.ndarray
    feature: str
    stat: str = "mean"

    def __repr__(self) -> str:
        L, H = self.values.shape
        lines = [f"{self.feature} ({self.stat}), {L} layers × {H} heads",
                 "      " + " ".join(f"{'H' + str(h):>6}" for h in range(H))]
        lines += [f"L{l:<4} " + " ".join(f"{v:6.3f}" for v in self.values[l]) for l in range(L)]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        v = np.asarray(self.values, dtype=float)
        finite = v[np.isfinite(v)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        span = hi - lo or 1.0
        head = "".join(f"<th>H{h}</th>" for h in range(v.shape[1]))
        rows = []
        for l in range(v.shape[0]):
            cells = []
            for x in v[l]:
                t = (x - lo) / span if np.isfinite(x) else 0.0
                bg = f"rgb({int(255 - 222 * t)},{int(255 - 160 * t)},{int(255 - 75 * t)})"
                fg = "#000" if t < 0.55 else "#fff"
                cells.append(f'<td style="background:{bg};color:{fg};text-align:right">{x:.3f}</td>')
            rows.append(f"<tr><th>L{l}</th>{''.join(cells)}</tr>")
        caption = f"{html.escape(self.feature)} ({self.stat}); shading from {lo:.3f} to {hi:.3f}"
        return (f'<table style="border-collapse:collapse;font-size:11px"><caption style="text-align:left">'
                f"{caption}</caption><thead><tr><th></th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")


@dataclass(repr=False)
class HeadFeatures:
    """Corpus-level features per head.

    mean, std: numpy arrays n_layers × n_heads × n_features (std over samples, every sample weighs
    the same); names: the feature names; n_samples, n_tokens: what was measured; meta: settings;
    per_sample: every sample's features, n_samples × n_layers × n_heads × n_features float32 in input order
    (`extract(..., per_sample=True)`; memory-mapped from a run directory that holds per_sample.npy), or None.
    A head that a pruning removed from the model (docs/pruning.md) has no attention: its features are NaN, and
    `removed` marks it (`meta["removed_heads"]`); analyses leave such heads out.
    """

    mean: np.ndarray
    std: np.ndarray
    names: list[str]
    n_samples: int
    n_tokens: int
    meta: dict = field(default_factory=dict)
    per_sample: np.ndarray | None = None
    # n_layers × n_heads: each head's max logit over the corpus (docs/features.md, "Max logit"; NaN for a removed
    # head), when `extract(..., max_logit=True)` or `attnkit extract --max-logit` measured it (saved in
    # features.npz); None otherwise
    max_logit: np.ndarray | None = None

    @property
    def n_layers(self) -> int:
        return self.mean.shape[0]

    @property
    def n_heads(self) -> int:
        return self.mean.shape[1]

    @property
    def removed(self) -> np.ndarray:
        """n_layers × n_heads booleans, True for a head removed from the model (`meta["removed_heads"]`; its
        features are NaN)."""
        return removed_grid(self.meta, self.mean)

    @property
    def kept(self) -> np.ndarray:
        """n_layers × n_heads booleans, True for a head the model has (the heads analyses use)."""
        return ~self.removed

    @property
    def n_removed(self) -> int:
        return int(self.removed.sum())

    def feature(self, name: str, stat: str = "mean") -> np.ndarray:
        """n_layers × n_heads array of one feature."""
        if name not in self.names:
            raise AttnkitError(f"unknown feature {name!r}; known: {', '.join(self.names)}")
        return getattr(self, stat)[:, :, self.names.index(name)]

    def to_pandas(self):
        """One row per (layer, head): columns `layer`, `head` (an encoder–decoder's run: then `kind` and `kind_layer`,
        its layer within its kind), then one column per feature mean (named as the
        feature) and `<name>_std` per standard deviation, in the order of `names` (what `attnkit export`
        writes), and last `max_logit` when the run measured it. A removed head's row holds NaN (empty cells in a
        CSV)."""
        import pandas as pd

        L, H, F = self.mean.shape
        heads = pd.DataFrame({"layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L)})
        kinds = self.layer_kinds
        if kinds is not None:  # an encoder–decoder's run: each head's kind and layer within its kind
            heads["kind"] = np.repeat([k for k, _ in kinds], H)
            heads["kind_layer"] = np.repeat([i for _, i in kinds], H)
        df = pd.DataFrame(self.mean.reshape(L * H, F), columns=self.names)
        std = pd.DataFrame(self.std.reshape(L * H, F), columns=[f"{n}_std" for n in self.names])
        parts = [heads, df, std]
        if self.max_logit is not None:
            parts.append(pd.DataFrame({"max_logit": np.asarray(self.max_logit, dtype=np.float64).reshape(L * H)}))
        return pd.concat(parts, axis=1)

    @property
    def layer_kinds(self) -> list[tuple[str, int]] | None:
        """(kind, index in its kind) of each layer of an encoder–decoder's run ("encoder", "decoder", "cross";
        meta.json `layer_kinds`, docs/seq2seq.md); None for a run of one stack."""
        kinds = self.meta.get("layer_kinds")
        if not isinstance(kinds, list) or len(kinds) != self.n_layers:
            return None
        return [(str(k), int(i)) for k, i in kinds]

    @property
    def kinds(self) -> list[str] | None:
        """The kinds of an encoder–decoder's layers, each once, in the order of its layers (encoder, decoder,
        cross); None for a run of one stack."""
        kinds = self.layer_kinds
        return None if kinds is None else list(dict.fromkeys(kind for kind, _ in kinds))

    def n_layers_of(self, kind: str) -> int:
        """How many of an encoder–decoder's layers are of `kind` (0 for a run of one stack)."""
        return sum(k == kind for k, _ in self.layer_kinds or [])

    def layer_labels(self) -> list[str]:
        """Each layer as figures and tables name it: its number, and for an encoder–decoder's run its kind and
        index in its kind as well ("4 · cross 0")."""
        kinds = self.layer_kinds
        if kinds is None:
            return [str(layer) for layer in range(self.n_layers)]
        return [f"{layer} · {kind} {index}" for layer, (kind, index) in enumerate(kinds)]

    def grid(self, feature: str = "cls", stat: str = "mean") -> HeadGrid:
        """One feature as a layer × head grid that a notebook shows as a coloured table (`_repr_html_`)."""
        if stat not in ("mean", "std"):
            raise AttnkitError(f"unknown stat {stat!r}; use mean or std")
        return HeadGrid(self.feature(feature, stat), feature, stat)

    def __repr__(self) -> str:
        model = self.meta.get("model")
        where = f", model={str(model)!r}" if model else ""
        return (f"HeadFeatures({self.n_layers} layers × {self.n_heads} heads × {len(self.names)} features, "
                f"{self.n_samples} samples, {self.n_tokens} tokens{where})")

    def _repr_html_(self) -> str:
        """A notebook's view: the summary line and the grid of `cls` (or of the first feature); `.grid(name)`
        shows another."""
        shown = "cls" if "cls" in self.names else self.names[0]
        return (f"<div><p><code>{html.escape(repr(self))}</code></p>{self.grid(shown)._repr_html_()}"
                f"<p style=\"font-size:smaller\">features: {html.escape(', '.join(self.names))}; "
                f"<code>.grid(name)</code> shows another, <code>.to_pandas()</code> gives the table.</p></div>")

    def save(self, directory) -> Path:
        directory = ensure_writable_dir(directory, "run directory")
        atomic_write(
            directory / FEATURES_FILE,
            lambda f: np.savez(f, mean=self.mean, std=self.std, names=np.array(self.names), **self._optional_arrays()),
        )
        meta = dict(self.meta)
        meta.update(n_samples=int(self.n_samples), n_tokens=int(self.n_tokens),
                    n_layers=self.n_layers, n_heads=self.n_heads)
        if self.n_removed or "removed_heads" in meta:
            meta["removed_heads"] = [[int(l), int(h)] for l, h in np.argwhere(self.removed)]
        write_json(directory / META_FILE, meta)
        if self.per_sample is not None and not _is_file_of(self.per_sample, directory / PER_SAMPLE_FILE):
            writer = PerSampleWriter(directory, self.n_layers, self.n_heads, self.names)
            for i in range(0, len(self.per_sample), 4096):
                rows = np.asarray(self.per_sample[i:i + 4096])
                writer.add(np.arange(i, i + len(rows)), rows)
            writer.close()
        return directory

    def _optional_arrays(self) -> dict:
        """The arrays of features.npz that a run holds only when it measured them (docs/files.md)."""
        if self.max_logit is None:
            return {}
        m = np.asarray(self.max_logit, dtype=np.float64)
        if m.shape != self.mean.shape[:2]:
            raise AttnkitError(f"max_logit has shape {m.shape}, the features {self.n_layers} layers × "
                               f"{self.n_heads} heads")
        return {"max_logit": m}

    @classmethod
    def load(cls, directory) -> HeadFeatures:
        """Read a run directory; features.npz and meta.json are checked against their schemas
        (attnkit.run.schemas) and against each other, so a malformed file ends in an AttnkitError naming it."""
        directory = Path(directory)
        fpath = directory / FEATURES_FILE
        if not fpath.is_file():
            raise AttnkitError(f"{directory} is not a run directory: {FEATURES_FILE} is missing")
        arrays = load_npz(fpath, FEATURES_ARRAYS)
        mean, std, names = arrays["mean"].astype(np.float64), arrays["std"].astype(np.float64), \
            [str(n) for n in arrays["names"]]
        if mean.shape != std.shape or mean.shape[2] != len(names) or 0 in mean.shape:
            raise AttnkitError(f"{fpath} is inconsistent: mean {mean.shape}, std {std.shape}, {len(names)} names")
        if len(set(names)) != len(names):
            raise AttnkitError(f"{fpath}: feature names repeat: {names}")
        if np.any(std < 0):
            raise AttnkitError(f"{fpath}: array 'std' holds negative standard deviations")
        max_logit = arrays.get("max_logit")  # absent: a run that did not measure it, or one made before it was saved
        if max_logit is not None:
            max_logit = max_logit.astype(np.float64)
            if max_logit.shape != mean.shape[:2]:
                raise AttnkitError(f"{fpath}: array 'max_logit' has shape {max_logit.shape}, but 'mean' holds "
                                   f"{mean.shape[0]} layers × {mean.shape[1]} heads")
        meta = {}
        mpath = directory / META_FILE
        if mpath.is_file():
            meta = load_json(mpath, META_SCHEMA)
            L, H, _ = mean.shape
            for key, want in (("n_layers", L), ("n_heads", H)):
                if key in meta and meta[key] != want:
                    raise AttnkitError(f"{mpath}: field {key} is {meta[key]} but {fpath} holds {want}")
            if "feature_names" in meta and meta["feature_names"] != names:
                raise AttnkitError(f"{mpath}: field feature_names does not match the names in {fpath}")
            if "layer_kinds" in meta and len(meta["layer_kinds"]) != L:
                raise AttnkitError(f"{mpath}: field layer_kinds names {len(meta['layer_kinds'])} layers but "
                                   f"{fpath} holds {L}")
            for i, (l, h) in enumerate(meta.get("removed_heads", [])):
                if l >= L or h >= H:
                    raise AttnkitError(f"{mpath}: field removed_heads[{i}]: L{l}H{h} is outside the run's "
                                       f"{L} layers × {H} heads")
        per_sample = None
        if (directory / PER_SAMPLE_FILE).is_file():  # attnkit patterns reads it with every check; here only a
            try:                                    # file that fits the features is attached
                per_sample, ps_names = load_per_sample(directory)
                if per_sample.shape[1:3] != mean.shape[:2] or ps_names != names:
                    per_sample = None
            except AttnkitError:
                per_sample = None
        return cls(mean, std, names, int(meta.get("n_samples", 0)), int(meta.get("n_tokens", 0)), meta, per_sample,
                   max_logit)


def removed_grid(meta: dict, mean: np.ndarray) -> np.ndarray:
    """n_layers × n_heads booleans: the heads `meta["removed_heads"]` names (runs made before it was recorded
    have none). Only the record counts: a head whose features are NaN for another reason is not called removed
    (analyses refuse it instead)."""
    grid = np.zeros(np.shape(mean)[:2], dtype=bool)
    for l, h in meta.get("removed_heads") or []:
        grid[l, h] = True
    return grid


def _is_file_of(array, path: Path) -> bool:
    """Whether `array` is the memory map of `path` (saving a loaded run into its own directory)."""
    filename = getattr(array, "filename", None)
    return filename is not None and path.exists() and Path(filename).resolve() == path.resolve()


def merge_moments(n_a: int, sum_a, m2_a, n_b: int, sum_b, m2_b):
    """(n, sum, m2) of two parts given as counts, sums and sums of squared deviations from their own means
    (Chan et al.'s pairwise update). Unlike sums of squares, m2 keeps its precision when the spread is tiny
    next to the mean, so the std does not depend on how the samples were split into parts."""
    if n_a == 0:
        return n_b, np.array(sum_b, dtype=np.float64), np.array(m2_b, dtype=np.float64)
    if n_b == 0:
        return n_a, np.array(sum_a, dtype=np.float64), np.array(m2_a, dtype=np.float64)
    n = n_a + n_b
    delta = sum_b / n_b - sum_a / n_a
    return n, sum_a + sum_b, m2_a + m2_b + delta * delta * (n_a * n_b / n)


def batch_moments(feats: np.ndarray):
    """(n, sum, m2) over the first axis of per-sample features, in float64."""
    f = np.asarray(feats, dtype=np.float64)
    total = f.sum(0)
    return f.shape[0], total, np.square(f - total / max(f.shape[0], 1)).sum(0)


class FeatureAccumulator:
    """Per-head corpus statistics built from per-sample feature vectors in any number of pieces: `update` adds a
    batch, `merge` another accumulator (distributed runs), `state`/`from_state` round-trip through checkpoints.
    Kept in float64 as sums (for the mean) and sums of squared deviations `m2` (for the std), merged with
    `merge_moments`, so the std stays exact to rounding whatever the split."""

    def __init__(self, n_layers: int, n_heads: int, names: list[str]):
        self.names = list(names)
        shape = (n_layers, n_heads, len(self.names))
        self.sum = np.zeros(shape, dtype=np.float64)
        self.m2 = np.zeros(shape, dtype=np.float64)
        self.n_samples = 0
        self.n_tokens = 0

    @property
    def sumsq(self) -> np.ndarray:
        """Sums of squares (derived: m2 + sum²/n)."""
        return self.m2 + np.square(self.sum) / max(self.n_samples, 1)

    def add_moments(self, n: int, total, m2, n_tokens: int) -> None:
        """Add a part given as (count, sums, sums of squared deviations from its own mean)."""
        self.n_samples, self.sum, self.m2 = merge_moments(self.n_samples, self.sum, self.m2, int(n), total, m2)
        self.n_tokens += int(n_tokens)

    def update(self, feats: np.ndarray, n_tokens: int) -> None:
        """feats: B × n_layers × n_heads × F per-sample feature vectors."""
        self.add_moments(*batch_moments(feats), n_tokens)

    def merge(self, other: FeatureAccumulator) -> FeatureAccumulator:
        if other.names != self.names or other.sum.shape != self.sum.shape:
            raise AttnkitError("cannot merge feature sums of different models or feature sets")
        self.add_moments(other.n_samples, other.sum, other.m2, other.n_tokens)
        return self

    def state(self) -> dict:
        return {"sum": self.sum, "m2": self.m2, "n_samples": np.int64(self.n_samples),
                "n_tokens": np.int64(self.n_tokens), "names": np.array(self.names)}

    @classmethod
    def from_state(cls, state) -> FeatureAccumulator:
        names = [str(n) for n in state["names"]]
        acc = cls(state["sum"].shape[0], state["sum"].shape[1], names)
        acc.sum = np.array(state["sum"], dtype=np.float64)
        acc.n_samples = int(state["n_samples"])
        acc.n_tokens = int(state["n_tokens"])
        if "m2" in state:
            acc.m2 = np.array(state["m2"], dtype=np.float64)
        else:  # checkpoints of attnkit 0.1 kept sums of squares
            acc.m2 = np.array(state["sumsq"], dtype=np.float64) - np.square(acc.sum) / max(acc.n_samples, 1)
        return acc

    def result(self, meta: dict | None = None) -> HeadFeatures:
        if self.n_samples == 0:
            raise AttnkitError("no samples were measured")
        mean = self.sum / self.n_samples
        var = np.maximum(self.m2 / self.n_samples, 0.0)
        return HeadFeatures(mean, np.sqrt(var), self.names, self.n_samples, self.n_tokens, dict(meta or {}))


def features_table(features: HeadFeatures):
    """pandas DataFrame with one row per head: `layer`, `head`, then one column per feature mean (named
    as the feature) and one `<name>_std` per feature standard deviation (over samples), in the order
    of `features.names` (what `attnkit export` writes)."""
    return features.to_pandas()  # the same table: kept for the callers that name it so
