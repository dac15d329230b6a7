"""2-D maps of heads: metric MDS of the JS distances (Clark et al. Fig. 6) and t-SNE of the feature
vectors (Guan et al. Fig. 2), both with scikit-learn."""
from __future__ import annotations

import inspect

import numpy as np
from sklearn.manifold import MDS, TSNE

from ..errors import AttnkitError


def _check_dissimilarity(d) -> np.ndarray:
    d = np.asarray(d, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise AttnkitError(f"a dissimilarity matrix must be square, got shape {d.shape}")
    if not np.all(np.isfinite(d)) or np.any(d < -1e-9):
        raise AttnkitError("dissimilarities must be finite and non-negative")
    d = 0.5 * (d + d.T)
    np.fill_diagonal(d, 0.0)
    return np.maximum(d, 0.0)


def mds(dissimilarity, *, seed: int = 0, n_init: int = 4, max_iter: int = 300) -> np.ndarray:
    """n × 2 metric-MDS embedding of a precomputed dissimilarity matrix (symmetrised, zero diagonal)."""
    d = _check_dissimilarity(dissimilarity)
    if d.shape[0] < 3:
        raise AttnkitError("MDS needs at least 3 heads")
    params = inspect.signature(MDS.__init__).parameters
    kw = dict(n_components=2, n_init=n_init, max_iter=max_iter, random_state=seed)
    if "metric_mds" in params:  # scikit-learn >= 1.8: metric= names the input, metric_mds= the method
        kw.update(metric="precomputed", metric_mds=True, init="random")
    else:
        kw.update(dissimilarity="precomputed", metric=True)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # a few hundred heads: thread pools only add overhead
        return np.asarray(MDS(**kw).fit_transform(d))


def tsne(X, *, seed: int = 0, perplexity: float | None = None) -> np.ndarray:
    """n × 2 t-SNE embedding of feature vectors X (n × d); perplexity defaults to min(30, (n − 1)/3)."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] < 4:
        raise AttnkitError(f"t-SNE needs a 2-D array of at least 4 rows, got shape {X.shape}")
    n = X.shape[0]
    if perplexity is None:
        perplexity = max(2.0, min(30.0, (n - 1) / 3.0))
    if not 0 < perplexity < n:
        raise AttnkitError(f"perplexity must lie in (0, {n}), got {perplexity}")
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        return np.asarray(TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(X))


__all__ = ["mds", "tsne"]
