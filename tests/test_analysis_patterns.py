"""Kovaleva pattern rules on synthetic per-sample feature vectors with known classes, the proportions,
and `attnkit patterns RUN` end to end on a written per_sample.npy."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit.analysis.patterns import (
    BLOCK,
    CLASSES,
    DIAGONAL,
    HETEROGENEOUS,
    MIXED,
    VERTICAL,
    Rules,
    class_counts,
    classify,
    examples_of,
)
from attnkit.cli.main import main
from attnkit.errors import AttnkitError
from attnkit.features import feature_names
from attnkit.run.head_features import HeadFeatures
from attnkit.run.per_sample import PerSampleWriter

NAMES = feature_names(16)


def vec(**mass):
    """A feature vector: bucket masses as given, the rest spread over win_* so the buckets sum to 1."""
    x = np.zeros(len(NAMES), dtype=np.float32)
    for k in ("cls", "sep", "comma", "period", "self"):
        x[NAMES.index(k)] = mass.get(k, 0.0)
    rest = 1.0 - x[:5].sum()
    for i in range(16):
        x[NAMES.index(f"win_{i}")] = rest / 16
    x[NAMES.index("prev")] = mass.get("prev", 0.0)
    x[NAMES.index("next")] = mass.get("next", 0.0)
    intra = mass.get("intra", 1.0)
    x[NAMES.index("intra")], x[NAMES.index("inter")] = intra, 1.0 - intra
    x[NAMES.index("entropy")] = 2.0
    return x


CASES = [
    (vec(cls=0.7, intra=0.6), VERTICAL),                      # [CLS] sink
    (vec(sep=0.4, cls=0.2, prev=0.05, intra=0.5), VERTICAL),  # [SEP] stripes
    (vec(prev=0.8, intra=0.97), DIAGONAL),                    # previous token
    (vec(next=0.3, self=0.3, intra=0.97), DIAGONAL),          # around the diagonal
    (vec(cls=0.3, prev=0.4, intra=0.8), MIXED),
    (vec(sep=0.25, next=0.3, intra=0.8), MIXED),
    (vec(cls=0.05, prev=0.1, intra=0.95), BLOCK),             # a pair, kept inside its sentence
    (vec(cls=0.05, prev=0.1, intra=0.5), HETEROGENEOUS),      # a pair, spread over both sentences
    (vec(cls=0.1, next=0.1, intra=1.0), HETEROGENEOUS),       # a single text: intra is 1, never block
]


@pytest.mark.parametrize("x, want", CASES)
def test_rules_on_known_vectors(x, want):
    assert classify(x, NAMES) == want


def test_pairs_given_explicitly():
    x = vec(cls=0.05, prev=0.1, intra=0.95)
    assert classify(x, NAMES, pairs=False) == HETEROGENEOUS
    single = vec(cls=0.05, intra=1.0)
    assert classify(single, NAMES, pairs=True) == BLOCK  # intra 1 ≥ threshold once the caller says "pair"


def test_counts_and_proportions_stream_over_chunks():
    xs = np.stack([c[0] for c in CASES])  # 9 examples
    per_sample = np.broadcast_to(xs[:, None, None, :], (9, 2, 3, len(NAMES))).copy()
    per_sample[:, 1, 2] = vec(prev=0.9, intra=0.97)  # one head always diagonal
    counts = class_counts(per_sample.astype(np.float16), NAMES, chunk=4)
    assert counts.shape == (2, 3, 5) and np.all(counts.sum(-1) == 9)
    want = np.bincount([c[1] for c in CASES], minlength=5)
    np.testing.assert_array_equal(counts[0, 0], want)
    np.testing.assert_array_equal(counts[1, 2], [0, 9, 0, 0, 0])


def test_missing_feature_is_an_error():
    with pytest.raises(AttnkitError, match="lack next, self"):
        classify(np.zeros((2, 3)), ["cls", "sep", "prev"])


def test_patterns_command(tmp_path):
    rng = np.random.default_rng(0)
    n, L, H = 10, 2, 2
    rows = np.empty((n, L, H, len(NAMES)), dtype=np.float32)
    for i in range(n):
        rows[i, 0, 0] = vec(cls=0.8, intra=0.6)          # vertical everywhere
        rows[i, 0, 1] = vec(prev=0.9, intra=0.97)        # diagonal everywhere
        rows[i, 1, 0] = vec(cls=0.3, prev=0.3, intra=0.8) if i < 5 else vec(cls=0.05, intra=0.95)
        rows[i, 1, 1] = vec(cls=0.05, intra=0.5 + 0.01 * rng.random())
    w = PerSampleWriter(tmp_path, L, H, NAMES)
    w.add(np.arange(n)[::-1], rows[::-1])
    w.close()
    HeadFeatures(rows.mean(0), rows.std(0), NAMES, n, 10 * n).save(tmp_path)  # the run the rows belong to
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--no-svg"])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "patterns.json").read_text())
    assert data["classes"] == list(CLASSES) and data["n_examples"] == n
    assert data["per_layer"]["vertical"] == [0.5, 0.0]
    assert data["per_layer"]["diagonal"] == [0.5, 0.0]
    assert data["per_layer"]["vertical+diagonal"][1] == 0.25 and data["per_layer"]["block"][1] == 0.25
    assert data["per_layer"]["heterogeneous"][1] == 0.5
    assert data["overall"]["heterogeneous"] == 0.25
    assert data["per_head"]["block"][1][0] == 0.5
    assert (tmp_path / "figures" / "pattern_types.png").is_file()
    assert res.output.strip().splitlines()[-1] == (f"wrote {tmp_path}/patterns.json, {tmp_path}/pattern_labels.npy, "
                                                   f"{tmp_path}/figures/pattern_types.png")
    labels = np.load(tmp_path / "pattern_labels.npy")
    assert labels.shape == (n, L, H) and labels.dtype == np.int8
    np.testing.assert_array_equal(labels, classify(rows, NAMES))  # every (example, head), in input order
    assert data["labels"] == "pattern_labels.npy"
    res = CliRunner().invoke(main, ["patterns", str(tmp_path / "figures")])
    assert res.exit_code == 1 and "per_sample.npy is missing" in res.output

    # earlier results are not replaced without --overwrite; with it, the command says what it removed
    (tmp_path / "report.html").write_text("old report")
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--no-svg", "--structured-min", "0.95"])
    assert res.exit_code == 1 and "give --overwrite to replace them" in res.output
    assert json.loads((tmp_path / "patterns.json").read_text()) == data
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--no-svg", "--structured-min", "0.95", "--overwrite",
                                    "-q"])
    assert res.exit_code == 0, res.output
    assert f"--overwrite removed {tmp_path}/{{patterns.json, pattern_labels.npy, figures/pattern_types.png, " \
           "report.html}" in res.output
    assert "report.html" in res.output and not (tmp_path / "report.html").exists()
    again = json.loads((tmp_path / "patterns.json").read_text())
    assert again["rules"]["structured_min"] == 0.95 and again["per_layer"]["vertical"] == [0.0, 0.0]
    np.testing.assert_array_equal(np.load(tmp_path / "pattern_labels.npy"),
                                  classify(rows, NAMES, rules=Rules(structured_min=0.95)))


def test_thresholds_are_options_and_are_checked():
    x = vec(cls=0.3, prev=0.15, intra=1.0)  # v + d = 0.45
    assert classify(x, NAMES) == HETEROGENEOUS
    assert classify(x, NAMES, rules=Rules(structured_min=0.4)) == VERTICAL
    assert classify(x, NAMES, rules=Rules(structured_min=0.4, mix_part_min=0.1)) == MIXED
    with pytest.raises(AttnkitError, match="^mix_part_min must be a share between 0 and 1, got 1.5"):
        classify(x, NAMES, rules=Rules(mix_part_min=1.5))
    res = CliRunner().invoke(main, ["patterns", ".", "--block-intra-min", "2"])
    assert res.exit_code == 2 and "--block-intra-min" in res.output


def test_values_within_3e_5_of_a_threshold_do_not_flip(tmp_path):
    """float16 storage (attnkit 0.1) rounded v + d = 0.49999 up to 0.5; float32 keeps it below."""
    x = vec(cls=0.2, prev=0.29999, intra=1.0)
    assert float(np.float32(x[NAMES.index("cls")]) + np.float32(x[NAMES.index("prev")])) < 0.5
    assert classify(x, NAMES) == HETEROGENEOUS
    assert classify(x.astype(np.float16), NAMES) == DIAGONAL  # the flip float16 caused (v + d rounds to 0.5)
    w = PerSampleWriter(tmp_path, 1, 1, NAMES)
    w.add([0], x[None, None, None])
    w.close()
    HeadFeatures(x[None, None].astype(np.float64), np.zeros((1, 1, len(NAMES))), NAMES, 1, 10).save(tmp_path)
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--no-svg", "-q"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "patterns.json").read_text())["overall"]["heterogeneous"] == 1.0


def test_list_the_examples_that_put_a_head_in_a_class(tmp_path):
    n = 6
    rows = np.stack([vec(cls=c, intra=0.6) for c in (0.9, 0.1, 0.7, 0.8, 0.05, 0.6)])[:, None, None]
    w = PerSampleWriter(tmp_path, 1, 1, NAMES)
    w.add(np.arange(n), rows, [f"text {i}" for i in range(n)])
    w.close()
    HeadFeatures(rows.mean(0), rows.std(0), NAMES, n, 10 * n).save(tmp_path)
    df, total = examples_of(tmp_path, 0, 0, "vertical", n=3)
    assert total == 4 and list(df.index) == [0, 3, 2]  # the clearest first (highest cls + sep)
    assert list(df["text"]) == ["text 0", "text 3", "text 2"] and np.allclose(df["v"], [0.9, 0.8, 0.7])
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--list", "L0H0:heterogeneous", "--list-max", "5"])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert lines[0] == "L0H0 is heterogeneous on 2 examples; the 2 clearest:"
    assert lines[1].startswith("  row 4 (input 0, segment 4): v 0.050") and lines[1].endswith("text 4")
    assert not (tmp_path / "patterns.json").exists()  # listing writes nothing
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--list", "L3H0:vertical"])
    assert res.exit_code == 1 and "outside the run's 1 layers × 1 heads" in res.output
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--list", "L0H0:sideways"])
    assert res.exit_code == 1 and "unknown pattern class 'sideways'" in res.output
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--list", "layer 0"])
    assert res.exit_code == 2 and "e.g. L2H5:vertical" in res.output



def uniform_run(path, n: int, n_samples: int, n_tokens: int, meta=None) -> None:
    """A run of 2 × 2 heads whose per_sample.npy holds `n` rows of 0.01 everywhere, its features.npz saying it
    measured `n_samples` samples."""
    rows = np.full((n, 2, 2, len(NAMES)), 0.01, dtype=np.float32)
    w = PerSampleWriter(path, 2, 2, NAMES)
    w.add(np.arange(n), rows)
    w.close()
    HeadFeatures(rows.mean(0), rows.std(0), NAMES, n_samples, n_tokens, meta=meta or {}).save(path)


def test_a_per_sample_file_that_is_not_its_runs_is_refused(tmp_path):
    """patterns once classified the 5 rows of a per_sample.npy whose run measured 40 samples."""
    uniform_run(tmp_path, 5, 40, 400)
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--no-svg"])
    assert res.exit_code == 1 and not (tmp_path / "patterns.json").exists()
    assert res.stderr.strip() == (f"Error: {tmp_path}/per_sample.npy holds 5 samples × 2 layers × 2 heads × "
                                  f"{len(NAMES)} features, but its run measured 40 samples × 2 layers × 2 heads × "
                                  f"{len(NAMES)} features: it is not this run's per-sample file; run `attnkit "
                                  "extract --per-sample` again")


def test_a_per_sample_file_of_the_right_shape_but_other_samples_is_refused(tmp_path):
    """Same shape, other contents (a file left from a replaced run of as many samples): its mean is not the run's."""
    n, L, H = 6, 1, 2
    rng = np.random.default_rng(0)
    rows = rng.uniform(0, 0.5, (n, L, H, len(NAMES))).astype(np.float32)
    HeadFeatures(rows.astype(np.float64).mean(0), rows.std(0), NAMES, n, 60).save(tmp_path)
    w = PerSampleWriter(tmp_path, L, H, NAMES)
    w.add(np.arange(n), rows)
    w.close()
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--no-svg", "-q"])
    assert res.exit_code == 0, res.output  # the run's own samples
    w = PerSampleWriter(tmp_path, L, H, NAMES)
    w.add(np.arange(n), np.full_like(rows, 0.5))
    w.close()
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--no-svg", "-q", "--overwrite"])
    assert res.exit_code == 1 and "per_sample.npy does not hold the samples of its run: their mean of" in res.stderr
    assert "run `attnkit extract --per-sample` again" in res.stderr


def test_a_decoder_run_is_refused_with_the_reason(tmp_path):
    uniform_run(tmp_path, 4, 4, 40, meta={"model_type": "llama"})
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--no-svg"])
    assert res.exit_code == 1 and not (tmp_path / "patterns.json").exists()
    assert "is a run of a decoder (llama)" in res.stderr and "defined for bidirectional encoders" in res.stderr
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--list", "L0H0:vertical"])
    assert res.exit_code == 1 and "decoder" in res.stderr


def test_patterns_of_a_norm_weighted_run_are_labelled_and_removed_heads_have_no_class(tmp_path):
    """Kovaleva's classes describe attention weights: on a norm-weighted run the command says what it classified
    and patterns.json records the weighting. A head removed by pruning (NaN features) gets no class (-1) and
    counts in no share."""
    n, L, H = 6, 2, 2
    rows = np.empty((n, L, H, len(NAMES)), dtype=np.float32)
    rows[:, 0, 0] = vec(cls=0.8, intra=0.6)    # vertical
    rows[:, 0, 1] = np.nan                     # removed
    rows[:, 1, 0] = vec(prev=0.9, intra=0.97)  # diagonal
    rows[:, 1, 1] = vec(cls=0.05, intra=0.5)   # heterogeneous
    w = PerSampleWriter(tmp_path, L, H, NAMES)
    w.add(np.arange(n), rows)
    w.close()
    HeadFeatures(rows.mean(0), rows.std(0), NAMES, n, 10 * n,
                 {"weighting": "norm", "removed_heads": [[0, 1]]}).save(tmp_path)
    res = CliRunner().invoke(main, ["patterns", str(tmp_path), "--no-svg"])
    assert res.exit_code == 0, res.output
    assert "note: " in res.output and "norm-weighted features: Kovaleva et al.'s classes describe attention " \
                                      "weights" in res.output
    assert "; left out 1 head(s) removed by pruning" in res.output
    data = json.loads((tmp_path / "patterns.json").read_text())
    assert data["weighting"] == "norm" and data["removed_heads"] == [[0, 1]] and data["n_examples"] == n
    assert data["per_layer"]["vertical"] == [1.0, 0.0]  # layer 0: its one kept head, not half of two
    assert data["overall"] == {"vertical": 1 / 3, "diagonal": 1 / 3, "vertical+diagonal": 0.0, "block": 0.0,
                               "heterogeneous": 1 / 3}
    assert data["per_head"]["heterogeneous"][0] == [0.0, None]
    labels = np.load(tmp_path / "pattern_labels.npy")
    assert (labels[:, 0, 1] == -1).all() and (labels[:, 0, 0] == VERTICAL).all()
