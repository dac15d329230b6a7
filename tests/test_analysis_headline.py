"""The headline run (README's first command, `attnkit extract` on the embedded defaults, then `attnkit cluster`) gives
head types that attnkit itself calls reliable; heads without types are still called unreliable (docs/analysis.md §2)."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit.analysis.clustering import STABILITY_WARN, fit_types
from attnkit.cli.main import main
from attnkit.run.head_features import HeadFeatures

from .synthetic import layered_truth, make_features


def test_the_embedded_defaults_give_stable_types(tmp_path):
    run = tmp_path / "attnkit-run"
    res = CliRunner().invoke(main, ["extract", "-o", str(run), "-q"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["cluster", str(run), "-q"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "not reliable" not in res.output and "warning" not in res.output
    data = json.loads((run / "clusters.json").read_text())
    over = data["stability"]["over_seeds"]
    assert over["n_seeds"] == 10 and over["mean"] >= STABILITY_WARN
    assert data["stability"]["assessment"]["stable"] is True
    # the k was chosen by stability: no k of the sweep is steadier than the one written
    assert over["mean"] == max(r["stability_mean"] for r in data["stability"]["sweep"])
    assert sorted(c["type"] for c in data["clusters"]) == ["dense", "diagonal", "vertical"]


def simplex_heads(n_layers=6, n_heads=12, seed=0) -> HeadFeatures:
    """Heads with no types: class shares spread evenly over the whole triangle of (vertical, diagonal, dense)
    compositions (Dirichlet(1, 1, 1)), so no partition of them is favoured."""
    f = make_features(layered_truth(n_layers, n_heads), seed=seed)
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.ones(3), size=(n_layers, n_heads))
    names = f.names
    buckets = np.zeros((n_layers, n_heads, 21))
    buckets[..., [names.index("cls"), names.index("sep")]] = shares[..., :1] / 2
    buckets[..., [names.index("self"), names.index("win_0")]] = shares[..., 1:2] / 2
    buckets[..., 7:21] = shares[..., 2:] / 14  # win_2 .. win_15: the windows of `dense`
    f.mean[..., :21] = buckets
    return f


def test_heads_without_types_are_still_unreliable(tmp_path):
    simplex_heads().save(tmp_path / "run")
    # k chosen by stability as by default, over 3 seeds rather than 10: no seed of any k reaches 0.7 on these heads
    res = CliRunner().invoke(main, ["cluster", str(tmp_path / "run"), "-q", "--seeds", "3"], catch_exceptions=False)
    assert res.exit_code == 0, res.output  # k chosen by stability: even the most stable k is not
    assert "no k from 2 to 8 gives stable head types" in res.output
    assert f"is below {STABILITY_WARN}: these head types are not reliable" in res.output
    verdict = json.loads((tmp_path / "run" / "clusters.json").read_text())["stability"]["assessment"]
    assert verdict["stable"] is False and not verdict["any_k_stable"] and verdict["value"] < STABILITY_WARN


@pytest.mark.parametrize("k", [3])
def test_a_given_k_is_kept(tmp_path, k):
    f = simplex_heads(seed=1)
    c, over, rows = fit_types(f, k=k, n_seeds=2)
    assert c.k == k and over["n_seeds"] == 2
