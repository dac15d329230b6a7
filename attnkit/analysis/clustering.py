"""Head types by clustering, with Guan et al.'s stability measure (after von Luxburg 2010).

`HeadClusterer` follows scikit-learn's estimator contract: parameters are set in `__init__` and stored
unchanged, `fit` does the work and leaves its results in attributes ending in `_`. It wraps
scikit-learn's `KMeans` or `GaussianMixture` (no hand-written clustering) and adds

* feature selection from a `HeadFeatures` (default: the 5 + num_windows distance buckets, Guan's
  21-dim distance feature for 16 windows), optional standardisation;
* names for the clusters (`attnkit.analysis.naming`);
* stability: `n_stability` times, fit a fresh estimator on a random half of the heads, predict every
  head, map that fit's labels onto the reference labels by Hungarian matching of the confusion matrix
  (`scipy.optimize.linear_sum_assignment`); a head is stable when it gets the same (matched) label in
  every one of the fits; `stability_` is the share of stable heads. Several renamings often agree with
  the reference on equally many heads; `match_labels` then takes the one whose clusters lie nearest the
  reference clusters they are renamed to, and works on canonically numbered clusters, so the result
  never depends on how the estimators happen to number their clusters.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment
from sklearn.base import BaseEstimator, ClusterMixin, clone
from sklearn.cluster import KMeans
from sklearn.metrics import silhouette_score
from sklearn.mixture import GaussianMixture
from sklearn.preprocessing import StandardScaler

from ..errors import SEED_MAX, AttnkitError, check_int
from ..features import distance_feature_names, resolve_subset  # re-exported: checked without scikit-learn
from ..run.clusters import REMOVED
from ..run.head_features import HeadFeatures
from ..run.model_dir import is_decoder_meta
from .naming import class_matrix, class_names, cluster_features

METHODS = ("kmeans", "gmm")
STABILITY_WARN = 0.8  # below this mean stability over seeds, head types are called unreliable
DEFAULT_SEEDS = 10  # seeds for the mean and range of the stability
SWEEP_KS = range(2, 9)  # the k a sweep, and the default k chosen by stability, range over


def head_matrix(features: HeadFeatures, subset: list[str]) -> np.ndarray:
    """(n_layers·n_heads) × len(subset) rows in (layer, head) order; a class name of the run's kind (`vertical`,
    ...; attnkit.analysis.naming.class_matrix) is that class's share of each head's distance buckets."""
    L, H, F = features.mean.shape
    mean = np.asarray(features.mean, dtype=np.float64).reshape(L * H, F)
    decoder = is_decoder_meta(features.meta)
    shares = (class_matrix(mean, features.names, decoder) if any(n in class_names(decoder) for n in subset)
              else {})
    cols = [shares[n] if n in shares else mean[:, features.names.index(n)] for n in subset]
    return np.stack(cols, axis=1) if cols else np.zeros((L * H, 0))


def canonical_numbering(labels: np.ndarray, k: int) -> np.ndarray:
    """The renumbering `remap` (old label → new label) that orders clusters by decreasing size, ties by the
    position of their first member, empty clusters last (by old label). It depends only on which items
    share a cluster, so `remap[labels]` is the same partition numbered the same way, whatever the input
    numbering (for clusters that have members)."""
    labels = np.asarray(labels)
    counts = np.bincount(labels, minlength=k)
    first = np.array([np.argmax(labels == c) if counts[c] else len(labels) for c in range(k)])
    order = sorted(range(k), key=lambda c: (-counts[c], first[c], c))
    remap = np.empty(k, dtype=np.int64)
    remap[order] = np.arange(k)
    return remap


def _member_means(data: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """k × d mean of each cluster's rows of `data` (NaN rows for empty clusters)."""
    return np.stack([data[labels == c].mean(0) if np.any(labels == c) else np.full(data.shape[1], np.nan)
                     for c in range(k)])


def match_labels(reference: np.ndarray, labels: np.ndarray, k: int, data: np.ndarray | None = None) -> np.ndarray:
    """Relabel `labels` so they agree with `reference` as much as possible (Hungarian matching).

    Builds the k×k confusion matrix C[r, l] = #{items with reference r and label l} and finds the
    one-to-one map l → r that maximises the matched count. Labels must be integers in [0, k).

    Ties (several maps with the same count) are broken without regard to how either labelling is
    numbered: with `data` (items × d, the clustered points), by the smallest total Euclidean distance
    between the mean of each cluster of `labels` and the mean of the reference cluster it is mapped to;
    remaining exact ties by the canonical numbering of both labellings (`canonical_numbering`). So
    permuting the numbers of `labels` never changes the result, and permuting those of `reference`
    permutes the result the same way.
    """
    reference = np.asarray(reference)
    labels = np.asarray(labels)
    if reference.shape != labels.shape:
        raise AttnkitError(f"cannot match labelings of different sizes: {reference.shape} vs {labels.shape}")
    for arr in (reference, labels):
        if arr.size and (arr.min() < 0 or arr.max() >= k):
            raise AttnkitError(f"labels must lie in [0, {k}), got {arr.min()}..{arr.max()}")
    ref_map, lab_map = canonical_numbering(reference, k), canonical_numbering(labels, k)
    ref_c, lab_c = ref_map[reference], lab_map[labels]
    conf = np.zeros((k, k), dtype=np.int64)
    np.add.at(conf, (ref_c, lab_c), 1)
    cost = -conf.astype(np.float64)
    if data is not None:
        data = np.asarray(data, dtype=np.float64)
        if data.ndim != 2 or data.shape[0] != reference.shape[0]:
            raise AttnkitError(f"data must have one row per labelled item ({reference.shape[0]}), got shape "
                               f"{data.shape}")
        a, b = _member_means(data, ref_c, k), _member_means(data, lab_c, k)
        dist = np.nan_to_num(np.linalg.norm(a[:, None, :] - b[None, :, :], axis=-1), nan=0.0)
        if dist.max() > 0:  # k distances sum to < 0.5: they can only decide between maps of equal count
            cost += dist / (2.0 * k * dist.max())
    rows, cols = linear_sum_assignment(cost)
    mapping = np.empty(k, dtype=np.int64)
    mapping[cols] = rows  # canonical label of `labels` → canonical reference label
    back = np.argsort(ref_map)  # canonical reference label → reference label
    return back[mapping[lab_c]]


class HeadClusterer(ClusterMixin, BaseEstimator):
    """Cluster attention heads into types.

    Parameters
    ----------
    k : number of clusters (types).
    method : "kmeans" (sklearn KMeans, n_init=10) or "gmm" (sklearn GaussianMixture, diagonal covariance:
        a model has too few heads for full 21×21 covariances (72 heads, 231 parameters per component);
        small `reg_covar`, n_init=3).
    features_subset : None (or "classes") for the class shares of the run's kind that the type names are made of
        (`vertical`, `diagonal`, `dense`; a decoder's six; attnkit.analysis.naming.class_matrix), "distance" for the
        distance buckets (cls, sep, comma, period, self, win_0..win_{N-1}: Guan et al.'s 21-dim feature),
        "all", a comma-separated string or a list of feature names. Only used when fitting a
        `HeadFeatures`; a plain array is clustered as given. On a decoder's run "all" leaves out the features
        that are 0 for every head (`attnkit.features.DECODER_CONSTANT`).
    standardize : scale each chosen feature to zero mean and unit variance before clustering. Off by
        default: the distance buckets share one unit (attention mass) and standardising would blow up
        the far windows, which carry almost no mass.
    seed : random seed for the estimator and the stability subsets.
    n_stability : number of random half-subsets for the stability measure (0 skips it).
    subsample : share of heads each stability fit sees (Guan et al.: 0.5).

    Attributes after `fit`
    ----------------------
    labels_ : int array, one label per clustered head in (layer, head) order; `labels_grid_` is
        n_layers × n_heads (only when fitted on `HeadFeatures`), -1 for a head removed by pruning.
    kept_ : (n_layers·n_heads,) booleans, the heads clustered (fitted on `HeadFeatures`: those not removed by
        pruning, whose features are NaN, docs/pruning.md; else None); `n_removed_` counts those left out.
    centroids_ : k × d cluster centres in the units of the chosen features (not standardised).
    profiles_ : k × F member means of every feature (for naming and reports), with `profile_names_`.
    type_names_ : list of k unique names (see `attnkit.analysis.naming.name_clusters`; a decoder's run, meta.json
        `model_type`, is named by a decoder's classes: `decoder_`).
    shares_ : share of heads per cluster.
    stability_ : share of heads labelled the same in every stability fit (nan when n_stability == 0).
    head_stability_ : per head, share of stability fits that agree with `labels_`.
    stability_runs_ : n_stability × n_heads matched labels of the stability fits.
    silhouette_ : silhouette score of `labels_` on the clustered (possibly standardised) data.
    feature_names_in_ : the features clustered; `n_features_in_` their number.
    estimator_ : the fitted sklearn estimator; `scaler_` the StandardScaler or None.
    """

    def __init__(self, k=4, method="kmeans", features_subset=None, standardize=False, seed=0,
                 n_stability=10, subsample=0.5):
        self.k = k
        self.method = method
        self.features_subset = features_subset
        self.standardize = standardize
        self.seed = seed
        self.n_stability = n_stability
        self.subsample = subsample

    # -- helpers -----------------------------------------------------------------------------------
    def _check_params(self, n: int) -> None:
        if self.method not in METHODS:
            raise AttnkitError(f"unknown clustering method {self.method!r}; use one of {', '.join(METHODS)}")
        if not isinstance(self.k, (int, np.integer)) or self.k < 2:
            raise AttnkitError(f"k must be an integer >= 2, got {self.k!r}")
        if self.k >= n:
            raise AttnkitError(f"k = {self.k} clusters need more than {n} heads")
        if not isinstance(self.n_stability, (int, np.integer)) or self.n_stability < 0:
            raise AttnkitError(f"n_stability must be a non-negative integer, got {self.n_stability!r}")
        check_int(self.n_stability, "n_stability")
        check_int(self.seed, "seed")
        if not 0.0 < float(self.subsample) <= 1.0:
            raise AttnkitError(f"subsample must lie in (0, 1], got {self.subsample!r}")
        if self.n_stability and int(round(self.subsample * n)) < self.k:
            raise AttnkitError(f"a {self.subsample:.0%} subset of {n} heads is too small for k = {self.k}")

    def _make_estimator(self, seed: int):
        if self.method == "kmeans":
            return KMeans(n_clusters=int(self.k), n_init=10, random_state=seed)
        return GaussianMixture(n_components=int(self.k), covariance_type="diag", reg_covar=1e-4,
                               n_init=3, random_state=seed)

    def _prepare(self, X):
        if isinstance(X, HeadFeatures):
            self.decoder_ = is_decoder_meta(X.meta)  # names by a decoder's classes (attnkit.analysis.naming)
            subset = cluster_features(X.names, self.features_subset, decoder=self.decoder_)
            self.grid_shape_ = X.mean.shape[:2]
            self.kept_ = X.kept.reshape(-1)  # a removed head has no features: it is no member of any type
            self.n_removed_ = int((~self.kept_).sum())
            self._all = np.asarray(X.mean, dtype=np.float64).reshape(-1, X.mean.shape[2])[self.kept_]
            self._all_names = list(X.names)
            return head_matrix(X, subset)[self.kept_], subset
        arr = np.asarray(X, dtype=np.float64)
        if arr.ndim != 2:
            raise AttnkitError(f"expected HeadFeatures or a 2-D array (heads × features), got shape {arr.shape}")
        self.grid_shape_ = None
        self.decoder_ = False
        self.kept_, self.n_removed_ = None, 0
        self._all = arr
        names = getattr(X, "columns", None)
        self._all_names = [str(c) for c in names] if names is not None else [f"x{i}" for i in range(arr.shape[1])]
        return arr, list(self._all_names)

    # -- estimator API -----------------------------------------------------------------------------
    def fit(self, X, y=None):
        """Cluster the heads of `X` (HeadFeatures, or an array n_heads × d)."""
        from threadpoolctl import threadpool_limits

        # A model has at most a few thousand heads: starting a thread pool costs more than the fit itself.
        with threadpool_limits(1):
            return self._fit(X)

    def _fit(self, X):
        from .naming import name_clusters

        data, subset = self._prepare(X)
        if not np.all(np.isfinite(data)):
            raise AttnkitError("the features contain NaN or infinite values")
        n = data.shape[0]
        self._check_params(n)
        self.feature_names_in_ = np.array(subset, dtype=object)
        self.n_features_in_ = data.shape[1]
        self.scaler_ = StandardScaler().fit(data) if self.standardize else None
        Z = self.scaler_.transform(data) if self.scaler_ is not None else data
        est = self._make_estimator(int(self.seed)).fit(Z)
        labels = np.asarray(est.predict(Z), dtype=np.int64)
        labels = self._order_labels(labels, data)
        self.estimator_ = est
        self.labels_ = labels
        k = int(self.k)
        self.centroids_ = _member_means(data, labels, k)
        self.profiles_ = _member_means(self._all, labels, k)
        self.profile_names_ = list(self._all_names)
        self.shares_ = np.bincount(labels, minlength=k) / n
        self.type_names_ = name_clusters(self.profiles_, self.profile_names_, decoder=self.decoder_)
        self.silhouette_ = float(silhouette_score(Z, labels)) if len(np.unique(labels)) > 1 else float("nan")
        if self.grid_shape_ is not None:
            grid = np.full(self.kept_.shape, -1, dtype=np.int64)
            grid[self.kept_] = labels
            self.labels_grid_ = grid.reshape(self.grid_shape_)
        self._stability(Z)
        del self._all
        return self

    def _order_labels(self, labels: np.ndarray, data: np.ndarray) -> np.ndarray:
        """Renumber clusters by decreasing size (ties: by first head) so label ids are reproducible."""
        self._label_remap = canonical_numbering(labels, int(self.k))
        return self._label_remap[labels]

    def _stability(self, Z: np.ndarray) -> None:
        n, k = Z.shape[0], int(self.k)
        reps = int(self.n_stability)
        if reps == 0:
            self.stability_ = float("nan")
            self.head_stability_ = np.full(n, np.nan)
            self.stability_runs_ = np.zeros((0, n), dtype=np.int64)
            return
        rng = np.random.default_rng(self.seed)
        m = int(round(float(self.subsample) * n))
        runs = np.empty((reps, n), dtype=np.int64)
        for r in range(reps):
            idx = rng.choice(n, size=m, replace=False)
            est = self._make_estimator(derived_seed(self.seed, 1 + r)).fit(Z[idx])
            runs[r] = match_labels(self.labels_, np.asarray(est.predict(Z), dtype=np.int64), k, data=Z)
        self.stability_runs_ = runs
        self.stability_ = float(np.mean(np.all(runs == runs[0], axis=0)))
        self.head_stability_ = np.mean(runs == self.labels_[None, :], axis=0)

    def predict(self, X):
        """Cluster ids (in this fit's numbering) for new heads."""
        if not hasattr(self, "estimator_"):
            raise AttnkitError("this HeadClusterer is not fitted yet: call fit() first")
        if isinstance(X, HeadFeatures):  # a head removed by pruning gets -1
            data = head_matrix(X, list(self.feature_names_in_))
            kept = X.kept.reshape(-1)
            out = np.full(len(kept), -1, dtype=np.int64)
            if kept.any():
                Z = self.scaler_.transform(data[kept]) if self.scaler_ is not None else data[kept]
                out[kept] = self._label_remap[np.asarray(self.estimator_.predict(Z), dtype=np.int64)]
            return out
        else:
            data = np.asarray(X, dtype=np.float64)
        if data.ndim != 2 or data.shape[1] != self.n_features_in_:
            raise AttnkitError(f"expected {self.n_features_in_} features per head, got shape {data.shape}")
        Z = self.scaler_.transform(data) if self.scaler_ is not None else data
        return self._label_remap[np.asarray(self.estimator_.predict(Z), dtype=np.int64)]

    def type_of(self, layer: int, head: int) -> str:
        """The type of a head ("removed" for one a pruning removed)."""
        label = int(self.labels_grid_[layer, head])
        return REMOVED if label < 0 else self.type_names_[label]


def cluster(features, *, k=4, method="kmeans", features_subset=None, standardize=False, seed=0,
            n_stability=10, subsample=0.5) -> HeadClusterer:
    """Fit a `HeadClusterer` on `features` (HeadFeatures or an array) and return it."""
    return HeadClusterer(k=k, method=method, features_subset=features_subset, standardize=standardize,
                         seed=seed, n_stability=n_stability, subsample=subsample).fit(features)


def stability_over_seeds(features, *, n_seeds: int = DEFAULT_SEEDS, seed: int = 0, first=None, **kwargs) -> dict:
    """The stability of `cluster(features, seed=s, **kwargs)` for s = seed .. seed + n_seeds − 1 (each seed
    changes the reference fit and the random halves): {"n_seeds", "seeds", "values", "mean", "min", "max"}.
    `first`: an already fitted clusterer for `seed` (its stability is reused)."""
    if not isinstance(n_seeds, (int, np.integer)) or n_seeds < 1:
        raise AttnkitError(f"the number of seeds must be a positive integer, got {n_seeds!r}")
    check_int(n_seeds, "n_seeds")
    check_int(seed, "seed")
    if not kwargs.get("n_stability", 10):
        raise AttnkitError("stability over seeds needs stability fits (n_stability > 0)")
    seeds = [derived_seed(seed, i) for i in range(int(n_seeds))]
    values = [float((first if (first is not None and s == seeds[0])
                     else cluster(features, seed=s, **kwargs)).stability_)
              for s in seeds]
    return seed_summary(seeds, values)


def derived_seed(seed: int, offset: int) -> int:
    """Seed number `offset` after `seed` (seed + offset), wrapped into the 32 bits scikit-learn accepts as a
    random_state: every seed derived from a valid one is valid too."""
    return (int(seed) + int(offset)) % (SEED_MAX + 1)


def seed_summary(seeds, values) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return {"n_seeds": len(seeds), "seeds": [int(s) for s in seeds], "values": [float(x) for x in v],
            "mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}


def sweep(features, ks=SWEEP_KS, progress: bool = False, n_seeds: int = 1, **kwargs) -> list[dict]:
    """Stability and silhouette for every k in `ks` (same settings otherwise); `progress` shows a bar
    on stderr (one step per k). Values of k that the number of heads cannot support (k clusters need
    more than k heads, and a stability subset of at least k heads) are left out. With `n_seeds` > 1 each
    row also holds the stability's mean, min and max over that many seeds (`stability_over_seeds`)."""
    from tqdm.auto import tqdm

    n = int(features.kept.sum()) if isinstance(features, HeadFeatures) else len(features)
    share = float(kwargs.get("subsample", 0.5)) if kwargs.get("n_stability", 10) else 1.0
    feasible = [int(k) for k in ks if int(k) < n and int(round(share * n)) >= int(k)]
    if not feasible:
        raise AttnkitError(f"{n} heads are too few for a sweep over k = {', '.join(str(k) for k in ks)}")
    out = []
    # one step per k: the unit is spelt out, as "k" after a rate reads as thousands ("1.34k/s")
    for k in tqdm(feasible, desc=f"cluster sweep, k = {feasible[0]}..{feasible[-1]}", unit=" clusterings",
                  disable=not progress, dynamic_ncols=True):
        c = cluster(features, k=k, **kwargs)
        row = {"k": int(k), "stability": c.stability_, "silhouette": c.silhouette_,
               "type_names": list(c.type_names_), "shares": [float(s) for s in c.shares_]}
        if n_seeds > 1 and kwargs.get("n_stability", 10):
            base = int(kwargs.get("seed", 0))
            rest = {key: v for key, v in kwargs.items() if key != "seed"}
            seeds = [(base + i) % 2**32 for i in range(n_seeds)]
            values = [c.stability_] + [cluster(features, k=k, seed=s, **rest).stability_ for s in seeds[1:]]
            summary = seed_summary(seeds, values)
            row.update(stability_mean=summary["mean"], stability_min=summary["min"], stability_max=summary["max"],
                       n_seeds=int(n_seeds))
        out.append(row)
    return out


def most_stable(rows: list) -> tuple[int, float] | None:
    """(k, stability) of the most stable row of a sweep, judged by the mean over seeds when measured (else the one
    value); ties: the smaller k. None when no row has a stability."""
    def judged(r):
        v = r.get("stability_mean", r.get("stability"))
        return None if v is None or v != v else float(v)

    scored = [(judged(r), int(r["k"])) for r in rows if judged(r) is not None]
    if not scored:
        return None
    v, k = max(scored, key=lambda t: (t[0], -t[1]))
    return k, v


def fit_types(features, *, k: int | None = None, n_seeds: int = DEFAULT_SEEDS, do_sweep: bool | None = None,
              progress: bool = False, **kwargs) -> tuple[HeadClusterer, dict | None, list | None]:
    """(clusterer, stability over seeds or None, sweep rows or None): how `attnkit cluster` and the report fit the
    types. `k` None chooses k by stability: the most stable k of SWEEP_KS (`most_stable`, the mean over `n_seeds`
    seeds), so the default types are the steadiest the heads give, and a run where no k is stable is still called
    unreliable. With a k given, the sweep is made when asked for (`do_sweep` True), or, with `do_sweep` None, when
    the types at k are not stable (to say which k is). `kwargs`: the other arguments of `cluster`."""
    measured = bool(kwargs.get("n_stability", 10))
    rows = None
    if k is None:
        rows = sweep(features, ks=SWEEP_KS, progress=progress, n_seeds=n_seeds, **kwargs)
        best = most_stable(rows) if measured else None
        k = best[0] if best is not None else 4
    c = cluster(features, k=k, **kwargs)
    over = None
    if measured and n_seeds > 1:
        over = stability_over_seeds(features, n_seeds=n_seeds, first=c, k=k, **kwargs)
    judged = over["mean"] if over is not None else c.stability_
    if rows is None and (do_sweep or (do_sweep is None and judged == judged and judged < STABILITY_WARN)):
        rows = sweep(features, ks=SWEEP_KS, progress=progress, n_seeds=n_seeds, **kwargs)
    return c, over, rows


def stability_assessment(clusterer, over: dict | None = None, sweep_rows: list | None = None,
                         n_samples: int | None = None) -> dict:
    """Whether the head types are stable, judged as `attnkit cluster`, the report and `attnkit compare` judge
    them (the mean over seeds when measured, else seed `seed`'s value, against STABILITY_WARN), and, from the
    k sweep when there is one, which k are stable and which is the most stable; when the types are not stable,
    what would help. clusters.json records it as `stability.assessment` (docs/analysis.md, §2)."""
    k = int(clusterer.k)
    by = "mean over seeds" if over is not None else "one seed"
    value = over["mean"] if over is not None else clusterer.stability_
    value = None if value is None or value != value else float(value)
    out = {"threshold": STABILITY_WARN, "judged_by": by, "k": k, "value": value,
           "stable": None if value is None else value >= STABILITY_WARN}
    if sweep_rows:
        def judged(r):
            v = r.get("stability_mean", r.get("stability"))
            return None if v is None or v != v else float(v)

        out["sweep_judged_by"] = "mean over seeds" if any("stability_mean" in r for r in sweep_rows) else "one seed"
        out["stable_ks"] = [int(r["k"]) for r in sweep_rows if (judged(r) or 0.0) >= STABILITY_WARN]
        best = most_stable(sweep_rows)
        if best is not None:
            out["most_stable_k"], out["most_stable_value"] = best
        out["any_k_stable"] = bool(out["stable_ks"])
    if out["stable"] is False:
        help_ = []
        if n_samples is not None:
            help_.append(f"more text: the features are means over {n_samples} samples; a larger corpus makes "
                         "them less noisy")
        else:
            help_.append("more text: a larger corpus makes the features less noisy")
        help_.append("per-sample features (extract --per-sample): how much each head varies from text to text, "
                     "to tell noisy heads from real types")
        n_features = len(getattr(clusterer, "feature_names_in_", []))
        if n_features > len(class_names(getattr(clusterer, "decoder_", False))):
            help_.append(f"fewer features: {n_features} are clustered now; the class shares the names are made of "
                         "(the default, --features classes) give steadier clusters")
        out["what_would_help"] = help_
    return out


__all__ = ["HeadClusterer", "SWEEP_KS", "cluster", "fit_types", "most_stable", "stability_assessment", "sweep",
           "stability_over_seeds", "seed_summary", "STABILITY_WARN", "match_labels", "canonical_numbering",
           "resolve_subset", "distance_feature_names", "head_matrix", "clone"]
