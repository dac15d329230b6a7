"""attnkit/run/schemas.py and its readers: the files attnkit reads back (meta.json, features.npz, clusters.json,
distances.npz) are validated at the boundary, and every problem is one line naming the file and the field."""
import json

import numpy as np
import pytest

from attnkit import AttnkitError
from attnkit.analysis import HeadDistances, cluster
from attnkit.analysis.results import load_clusters, save_clusters
from attnkit.run import HeadFeatures
from attnkit.run.schemas import CLUSTERS_SCHEMA, validate


@pytest.fixture(scope="module")
def clusters_data(tmp_path_factory, feats):
    d = tmp_path_factory.mktemp("c")
    save_clusters(d, cluster(feats, k=3, n_stability=2), feats)
    return json.loads((d / "clusters.json").read_text())


# --- meta.json and features.npz ---------------------------------------------------------------------------
@pytest.mark.parametrize("meta, field, problem", [
    ([1, 2], None, "expected an object, got an array"),
    ({"n_samples": "abc"}, "field n_samples", "expected an integer, got a string (\"abc\")"),
    ({"n_tokens": -5}, "field n_tokens", "must be at least 0"),
    ({"max_length": 12.5}, "field max_length", "expected an integer, got a number"),
    ({"settings": "x"}, "field settings", "expected an object"),
    ({"n_layers": 7}, "field n_layers", "is 7 but"),
    ({"feature_names": ["a"]}, "field feature_names", "does not match"),
    ({"layer_kinds": [["encoder", 0], ["decodr", 0], ["cross", 0]]}, "field layer_kinds[1][0]", 'must be one of "encoder", "decoder", "cross", got "decodr"'),
    ({"layer_kinds": [["encoder", 0], ["decoder", -1], ["cross", 0]]}, "field layer_kinds", "must be at least 0"),
    ({"layer_kinds": [["encoder", 0], ["decoder"], ["cross", 0]]}, "field layer_kinds[1]", "needs at least 2 item(s), got 1"),
    ({"layer_kinds": [["encoder", 0], ["cross", 0]]}, "field layer_kinds", "names 2 layers but"),
])
def test_meta_json_is_validated(run, meta, field, problem):
    (run / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(AttnkitError) as e:
        HeadFeatures.load(run)
    msg = str(e.value)
    assert "meta.json" in msg and problem in msg and "\n" not in msg
    if field:
        assert field in msg


def test_meta_json_valid_fields_load(run, feats):
    got = HeadFeatures.load(run)
    assert got.n_samples == feats.n_samples == 100 and got.n_tokens == 3000
    np.testing.assert_array_equal(got.mean, feats.mean)


def test_an_encoder_decoders_kinds_are_named_once_in_layer_order(run):
    meta = json.loads((run / "meta.json").read_text())
    meta["layer_kinds"] = [["encoder", 0], ["decoder", 0], ["cross", 0]]
    (run / "meta.json").write_text(json.dumps(meta))
    got = HeadFeatures.load(run)
    assert got.kinds == ["encoder", "decoder", "cross"]
    assert [got.n_layers_of(k) for k in ("encoder", "decoder", "cross")] == [1, 1, 1]
    meta["layer_kinds"] = [["encoder", 0], ["encoder", 1], ["decoder", 0]]
    (run / "meta.json").write_text(json.dumps(meta))
    got = HeadFeatures.load(run)
    assert got.kinds == ["encoder", "decoder"] and got.n_layers_of("encoder") == 2 and got.n_layers_of("cross") == 0
    del meta["layer_kinds"]
    (run / "meta.json").write_text(json.dumps(meta))
    got = HeadFeatures.load(run)
    assert got.kinds is None and got.n_layers_of("encoder") == 0


@pytest.mark.parametrize("arrays, problem", [
    (dict(mean=np.zeros((2, 2)), std=np.zeros((2, 2)), names=np.array(["a", "b"])), "'mean' must have 3 dimension"),
    (dict(mean=np.array(["x"]), std=np.zeros(1), names=np.array(["a"])), "'mean' must hold numbers"),
    (dict(std=np.zeros((1, 1, 1)), names=np.array(["a"])), "array 'mean' is missing"),
    (dict(mean=np.zeros((1, 1, 2)), std=np.zeros((1, 1, 2)), names=np.array([1.5, 2.5])), "'names' must hold strings"),
    (dict(mean=np.zeros((1, 1, 2)), std=np.zeros((1, 1, 2)), names=np.array(["a", "a"])), "names repeat"),
    (dict(mean=np.zeros((1, 1, 1)), std=-np.ones((1, 1, 1)), names=np.array(["a"])), "negative standard dev"),
    (dict(mean=np.zeros((2, 3, 1)), std=np.zeros((2, 3, 1)), names=np.array(["a"]), max_logit=np.zeros((3, 2))),
     r"'max_logit' has shape \(3, 2\), but 'mean' holds 2 layers × 3 heads"),
    (dict(mean=np.zeros((2, 3, 1)), std=np.zeros((2, 3, 1)), names=np.array(["a"]), max_logit=np.zeros(6)),
     "'max_logit' must have 2 dimension"),
    (dict(mean=np.zeros((2, 3, 1)), std=np.zeros((2, 3, 1)), names=np.array(["a"]),
          max_logit=np.array([["x"] * 3] * 2)), "'max_logit' must hold numbers"),
])
def test_features_npz_is_validated(tmp_path, arrays, problem):
    np.savez(tmp_path / "features.npz", **arrays)
    with pytest.raises(AttnkitError, match=problem):
        HeadFeatures.load(tmp_path)


def test_max_logit_round_trips_and_older_runs_load_without_it(tmp_path, feats):
    """HeadFeatures.save writes max_logit (layers × heads, NaN kept for a removed head) into features.npz and load
    reads it back; a run saved without it (as every run before it was saved) loads with max_logit None."""
    import dataclasses

    m = np.arange(feats.n_layers * feats.n_heads, dtype=np.float64).reshape(feats.n_layers, feats.n_heads) / 7
    m[1, 2] = np.nan
    with_max = dataclasses.replace(feats, max_logit=m)
    with_max.save(tmp_path / "with")
    got = HeadFeatures.load(tmp_path / "with")
    np.testing.assert_array_equal(got.max_logit, m)
    np.testing.assert_array_equal(got.mean, feats.mean)
    with np.load(tmp_path / "with" / "features.npz") as z:
        assert set(z.files) == {"mean", "std", "names", "max_logit"}
    feats.save(tmp_path / "without")
    with np.load(tmp_path / "without" / "features.npz") as z:
        assert set(z.files) == {"mean", "std", "names"}
    assert HeadFeatures.load(tmp_path / "without").max_logit is None
    with pytest.raises(AttnkitError, match="max_logit has shape"):
        dataclasses.replace(feats, max_logit=m.T).save(tmp_path / "bad")


# --- clusters.json ----------------------------------------------------------------------------------------
def _edit(data, fn):
    data = json.loads(json.dumps(data))
    fn(data)
    return data


@pytest.mark.parametrize("edit, problem", [
    (lambda d: d["heads"][3].update(layer=9), "heads[3].layer: layer 9 is out of range (the run has 3 layers)"),
    (lambda d: d["heads"][0].update(head=4), "heads[0].head: head 4 is out of range"),
    (lambda d: d["heads"][1].update(layer=-1), "heads[1].layer: must be at least 0"),
    (lambda d: d["heads"].pop(), "11 heads listed, but the run has 3 × 4 = 12"),
    (lambda d: d["heads"].__setitem__(1, d["heads"][0]), "L0H0 appears twice"),
    (lambda d: d["heads"][2].update(label=7), "heads[2].label: label 7 is none of the clusters' labels"),
    (lambda d: d["heads"][2].update(type="bogus"), "heads[2].type: 'bogus' differs"),
    (lambda d: d.update(heads="abc"), "field heads: expected an array, got a string"),
    (lambda d: d["heads"].__setitem__(0, 5), "field heads[0]: expected an object, got an integer"),
    (lambda d: d["run"].update(n_layers="3"), "field run.n_layers: expected an integer"),
    (lambda d: d.pop("run"), "missing 'run'"),
    (lambda d: d.update(version=2), "field version: must be 1"),
    (lambda d: d["clusters"][0].update(centroid={"cls": "x"}), "clusters[0].centroid.cls: expected a number"),
])
def test_clusters_json_is_validated(tmp_path, clusters_data, edit, problem):
    (tmp_path / "clusters.json").write_text(json.dumps(_edit(clusters_data, edit)))
    with pytest.raises(AttnkitError) as e:
        load_clusters(tmp_path)
    assert problem in str(e.value) and "clusters.json" in str(e.value)


def test_clusters_json_checked_against_the_run_shape(tmp_path, clusters_data):
    (tmp_path / "clusters.json").write_text(json.dumps(clusters_data))
    assert load_clusters(tmp_path, (3, 4))["run"]["n_layers"] == 3
    with pytest.raises(AttnkitError, match="covers 3 layers × 4 heads, but the run has 6 × 12"):
        load_clusters(tmp_path, (6, 12))
    for top in ([], "x", 3):
        (tmp_path / "clusters.json").write_text(json.dumps(top))
        with pytest.raises(AttnkitError, match="expected an object"):
            load_clusters(tmp_path)


def test_complete_clusters_schema_requires_what_the_report_reads(tmp_path, clusters_data):
    data = _edit(clusters_data, lambda d: d["clusters"][1].pop("centroid"))
    (tmp_path / "clusters.json").write_text(json.dumps(data))
    load_clusters(tmp_path)  # enough for the head types
    with pytest.raises(AttnkitError, match=r"clusters\[1\]: missing 'centroid'"):
        load_clusters(tmp_path, complete=True)


def test_clustered_features_must_be_the_runs(tmp_path, feats):
    from attnkit.analysis.clustering import distance_feature_names

    save_clusters(tmp_path, cluster(feats, k=3, n_stability=2, features_subset=distance_feature_names(feats.names)),
                  feats)
    assert load_clusters(tmp_path, feature_names=feats.names)
    names = [n for n in feats.names if n != "win_3"]
    with pytest.raises(AttnkitError, match="field settings.features: win_3 not among the run's features"):
        load_clusters(tmp_path, feature_names=names)


def test_validate_names_file_field_and_problem():
    with pytest.raises(AttnkitError) as e:
        validate({"run": {"n_layers": True}}, CLUSTERS_SCHEMA, "x/clusters.json")
    assert str(e.value).startswith("x/clusters.json: ")


# --- distances.npz ----------------------------------------------------------------------------------------
def _dist(path, **over):
    arrays = dict(total=np.ones((4, 4)) - np.eye(4), n_rows=np.int64(10), n_layers=np.int64(2), n_heads=np.int64(2))
    arrays.update(over)
    np.savez(path / "distances.npz", **{k: v for k, v in arrays.items() if v is not None})


@pytest.mark.parametrize("over, problem", [
    (dict(total=np.ones((3, 3))), "has shape (3, 3), but 2 layers × 2 heads need 4 × 4"),
    (dict(total=np.ones(16)), "'total' must have 2 dimension"),
    (dict(total=np.full((4, 4), np.nan)), "NaN or infinite"),
    (dict(total=np.array([["a"] * 4] * 4)), "'total' must hold numbers"),
    (dict(n_rows=np.array([1, 2])), "'n_rows' must have 0 dimension"),
    (dict(n_layers=np.float64(2.0)), "'n_layers' must hold integers"),
    (dict(n_heads=None), "array 'n_heads' is missing"),
    (dict(total=-np.ones((4, 4))), "not a distance matrix"),
])
def test_distances_npz_is_validated(tmp_path, over, problem):
    _dist(tmp_path, **over)
    with pytest.raises(AttnkitError) as e:
        HeadDistances.load(tmp_path)
    assert problem in str(e.value) and "distances.npz" in str(e.value)


def test_distances_checked_against_the_run_shape(tmp_path):
    _dist(tmp_path)
    assert HeadDistances.load(tmp_path, (2, 2)).n_rows == 10
    with pytest.raises(AttnkitError, match="covers 2 layers × 2 heads, but the run has 3 × 4"):
        HeadDistances.load(tmp_path, (3, 4))




def test_head_means_say_what_they_hold():
    from attnkit.run.head_means import HeadMeans

    m = HeadMeans(np.zeros((6, 12, 32)), n_tokens=12345, next_index=40)
    assert repr(m) == "HeadMeans(6 layers × 12 heads × 32 dims, mean over 12,345 tokens, in progress, 40 segments measured)"
    m.complete = True
    assert repr(m) == "HeadMeans(6 layers × 12 heads × 32 dims, mean over 12,345 tokens, complete)"
